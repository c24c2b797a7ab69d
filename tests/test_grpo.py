"""GRPO (rlhf_core/grpo.py): its pure functions against naive loops, its config under TRL 1.16's names, a short run of
the trainer, and the update equal to TRL 1.16.0's GRPOTrainer (and RLOO to its RLOOTrainer) on identical inputs."""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import target_fraction
from rlhf_core import grpo, ops, rloo
from rlhf_core.checkpoint import list_checkpoints
from rlhf_core.config import RLConfig
from rlhf_core.guards import TrainingDiverged
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.rl_update import PolicyAndValue
from rlhf_core.rollout import Rollout, response_logits
from rlhf_core.scoring import FunctionScorer, WeightedScorer

ROOT = Path(__file__).resolve().parents[1]
TRL116_PYTHON = ROOT / ".venv-trl116" / "bin" / "python"


# ------------------------------------------------------------------------------------------- pure functions

@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_a_loop(scale):
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.5, 3.0, 3.0, 3.0, 3.0])  # two groups of 4; the second has std 0
    out = grpo.group_advantages(rewards, 4, scale)
    all_mean = sum(rewards.tolist()) / 8
    batch_std = math.sqrt(sum((r - all_mean) ** 2 for r in rewards.tolist()) / 7)
    for i, r in enumerate(rewards.tolist()):
        group = rewards[i // 4 * 4:i // 4 * 4 + 4].tolist()
        mean = sum(group) / 4
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / 3)  # Bessel, as TRL's nanstd
        expected = r - mean if scale == "none" else (r - mean) / ({"group": std, "batch": batch_std}[scale] + 1e-4)
        assert out[i].item() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert torch.all(out[4:] == 0), "a group of equal rewards has no advantage"


def _naive_per_token(logp, old, adv, mask, level, loss_type, eps_low, eps_high, delta):
    """One token at a time: the importance weight, then the clipped (or CISPO) loss."""
    B, R = logp.shape
    out = torch.zeros(B, R)
    for b in range(B):
        n = max(float(mask[b].sum()), 1.0)
        seq_w = math.exp(sum(float(logp[b, t] - old[b, t]) for t in range(R) if mask[b, t]) / n)
        for t in range(R):
            w = seq_w if level == "sequence" else math.exp(float(logp[b, t] - old[b, t]))
            a = float(adv[b, 0])
            if loss_type == "cispo":
                out[b, t] = -min(w, eps_high) * a * float(logp[b, t])
            else:
                clipped = min(max(w, 1 - eps_low), 1 + eps_high)
                unclipped = w if delta is None else min(w, delta)
                out[b, t] = -min(unclipped * a, clipped * a)
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
@pytest.mark.parametrize("delta", [None, 1.3])
def test_per_token_losses_match_a_loop(level, loss_type, delta):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=g) * 3
    old = logp + 0.3 * torch.randn(4, 5, generator=g)
    adv = torch.randn(4, 1, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    weights = grpo.importance_weights(logp, old, mask, level)
    assert weights.shape == ((4, 1) if level == "sequence" else (4, 5))
    if loss_type == "cispo":
        per_token = grpo.cispo_token_loss(weights, adv, logp, 1.2)
    else:
        per_token = grpo.clipped_token_loss(weights, adv, 0.2, 0.28, delta)
    expected = _naive_per_token(logp, old, adv, mask, level, loss_type, 0.2, 1.2 if loss_type == "cispo" else 0.28,
                                delta)
    torch.testing.assert_close(per_token.expand(4, 5) * mask, expected * mask, rtol=1e-5, atol=1e-6)


def test_reductions_match_a_loop():
    g = torch.Generator().manual_seed(1)
    per_token = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    rows = [[float(per_token[b, t]) for t in range(4) if mask[b, t]] for b in range(3)]
    tokens = [x for row in rows for x in row]
    expected = {"grpo": sum(sum(r) / max(len(r), 1) for r in rows) / 3,
                "bnpo": sum(tokens) / len(tokens), "dapo": sum(tokens) / len(tokens),
                "dr_grpo": sum(tokens) / (3 * 7)}
    for loss_type, value in expected.items():
        assert grpo.reduce_loss(per_token, mask, loss_type, 7).item() == pytest.approx(value, rel=1e-6)


def test_high_entropy_mask_keeps_the_top_quantile():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    kept = grpo.high_entropy_mask(entropy, mask, 0.5)
    masked = sorted(entropy[mask].tolist())
    threshold = torch.quantile(torch.tensor(masked), 0.5).item()
    assert kept.tolist() == [[e >= threshold and m for e, m in zip(er, mr, strict=True)]
                             for er, mr in zip(entropy.tolist(), mask.tolist(), strict=True)]
    assert not kept[0, 3], "a padding token never enters, whatever its entropy"
    assert grpo.high_entropy_mask(entropy, mask, 1.0).equal(mask)


# ------------------------------------------------------------------------------------------- config

def test_config_takes_trl_grpo_names_and_defaults():
    cfg = RLConfig(algo="grpo", loss_type="bnpo", importance_sampling_level="sequence", scale_rewards=False,
                   num_generations=4, delta=2.0, top_entropy_quantile=0.2)
    assert (cfg.grpo.loss_type, cfg.grpo.importance_sampling_level, cfg.grpo.scale_rewards) == \
        ("bnpo", "sequence", "none")
    assert (cfg.samples_per_prompt, cfg.grpo.delta, cfg.grpo.top_entropy_quantile) == (4, 2.0, 0.2)
    default = RLConfig(algo="grpo")
    assert (default.kl_coef, default.grpo.loss_type, default.grpo.num_generations, default.grpo.scale_rewards) == \
        (0.0, "dapo", 8, "group"), "TRL 1.16 GRPOConfig's defaults: beta 0, dapo, 8 generations, group scaling"
    assert not default.uses_reference and RLConfig(algo="grpo", beta=0.04).uses_reference
    assert RLConfig(algo="rloo", num_generations=4).rloo.rloo_k == 4, "num_generations stays RLOO's k for RLOO"


@pytest.mark.parametrize("key, value, match", [
    ("entropy_coef", 0.01, "entropy_coef: TRL's GRPOConfig option is not implemented"),
    ("multi_objective_aggregation", "normalize_then_sum", "multi_objective_aggregation: TRL's GRPOConfig"),
    ("loss_type", "sapo", "loss_type"),
    ("sapo_temperature_neg", 2.0, "sapo_temperature_neg"),
])
def test_config_refuses_what_it_does_not_implement_by_name(key, value, match):
    with pytest.raises(ValueError, match=match):
        RLConfig(algo="grpo", **{key: value})
    RLConfig(algo="grpo", multi_objective_aggregation="sum_then_normalize")  # TRL's default is what we do
    with pytest.raises(ValueError, match="max_update_kl"):
        RLConfig(algo="grpo", max_update_kl=3.0)  # no reference, no KL to bound


# ------------------------------------------------------------------------------------------- the trainer

def _tiny(**overrides) -> RLConfig:
    base = dict(algo="grpo", total_episodes=32 * 20, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                num_epochs=1, local_rollout_forward_batch_size=32, response_length=8, temperature=1.0,
                stop_token=None, missing_eos_penalty=None, learning_rate=3e-3, lr_scheduler="constant",
                num_generations=4)
    return RLConfig(**{**base, **overrides})


def test_trainer_learns_with_grpo_and_loads_no_reference_at_beta_0(tokenizer, prompts, make_policy):
    trainer = RLTrainer(_tiny(), make_policy(0), FunctionScorer(target_fraction, tokenizer), prompts,
                        pad_token_id=0, stop_token_id=1)
    assert trainer.ref_policy is None, "beta 0: no reference model, as TRL"
    history = trainer.train()
    first = sum(h["objective/scores"] for h in history[:3]) / 3
    last = sum(h["objective/scores"] for h in history[-3:]) / 3
    assert last > first + 0.25, f"grpo did not learn: mean score {first:.3f} -> {last:.3f}"
    assert "objective/kl" not in history[-1] and "clip_ratio/region_mean" in history[-1]


def test_trainer_with_beta_sequence_level_and_entropy_mask(tokenizer, prompts, make_policy):
    cfg = _tiny(total_episodes=64, beta=0.05, num_epochs=2, importance_sampling_level="sequence",
                loss_type="grpo", top_entropy_quantile=0.5, mask_truncated_completions=True,
                stop_token="eos", response_length=4)
    trainer = RLTrainer(cfg, make_policy(0), FunctionScorer(target_fraction, tokenizer), prompts,
                        pad_token_id=0, stop_token_id=1)
    assert trainer.ref_policy is not None
    history = trainer.train()
    assert len(history) == 2 and all(math.isfinite(h["loss/policy_avg"]) for h in history)
    assert "objective/kl" in history[-1] and history[-1]["kl"] > 0, "the loss's k3 KL is logged as TRL's kl"


def _length(prompts: list[str], completions: list[str]) -> list[float]:
    return [float(len(c.split())) for c in completions]


def test_reward_functions_are_summed_with_their_weights_then_normalized_per_group(tokenizer, prompts, make_policy):
    """train.reward_funcs + reward_weights under GRPO: each completion's score is the weighted sum of its sources
    (TRL 1.16's multi_objective_aggregation 'sum_then_normalize', the one implemented), the advantage is that sum
    normalized within its group, and each source is logged as rewards/<name>/mean."""
    seen = []
    scorer = WeightedScorer([(1.0, FunctionScorer(target_fraction, tokenizer)), (-0.25, FunctionScorer(_length,
                                                                                                         tokenizer))],
                            names=["target", "length"])
    trainer = RLTrainer(_tiny(total_episodes=64, scale_rewards="group"), make_policy(0), scorer, prompts,
                        pad_token_id=0, stop_token_id=1, on_update=lambda t, batch, stats: seen.append(batch))
    history = trainer.train()
    for batch, logged in zip(seen, history, strict=True):
        sources = scorer.by_source(batch)
        expected = sources["target"] - 0.25 * sources["length"]
        torch.testing.assert_close(batch.scores, expected)
        assert sources["length"].std() > 0, "the second source must vary for the check to see it"
        torch.testing.assert_close(batch.advantages[:, 0], grpo.group_advantages(expected, 4, "group"))
        assert logged["rewards/length/mean"] == pytest.approx(sources["length"].mean().item(), rel=1e-5)
        assert logged["objective/scores"] == pytest.approx(expected.mean().item(), rel=1e-5, abs=1e-6)


def _nan_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [float("nan") if i == 3 else 0.5 for i in range(len(completions))]


def test_a_nan_reward_stops_grpo_before_any_checkpoint(tmp_path, tokenizer, prompts, make_policy):
    """The guards under GRPO: one NaN reward poisons its group's advantages; the update is logged, nothing is
    checkpointed and TrainingDiverged names the figure."""
    trainer = RLTrainer(_tiny(total_episodes=64, checkpoint_every=1), make_policy(0),
                        FunctionScorer(_nan_reward, tokenizer), prompts, pad_token_id=0, stop_token_id=1,
                        checkpoint_dir=tmp_path)
    with pytest.raises(TrainingDiverged, match=r"update 1: .*objective/scores = nan"):
        trainer.train()
    assert not list_checkpoints(tmp_path)


def test_max_update_kl_bounds_grpos_kl_when_beta_loads_a_reference(tmp_path, tokenizer, prompts, make_policy):
    """With beta > 0 GRPO has a reference and logs objective/kl: train.max_update_kl stops the update that crosses
    it, after the updates before it were checkpointed."""
    def trainer(name, **bound):
        cfg = _tiny(total_episodes=32 * 3, beta=0.01, learning_rate=3e-2, checkpoint_every=1, **bound)
        return RLTrainer(cfg, make_policy(0), FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                         stop_token_id=1, checkpoint_dir=tmp_path / name)

    kls = [row["objective/kl"] for row in trainer("free").train()]
    assert kls[0] < kls[2], f"a high learning rate drifts from the reference: {kls}"
    bound = (kls[0] + kls[2]) / 2
    crossing = next(i for i, kl in enumerate(kls) if kl > bound) + 1
    with pytest.raises(TrainingDiverged, match=rf"update {crossing}: objective/kl = [0-9.]+ \(train.max_update_kl"):
        trainer("bounded", max_update_kl=bound).train()
    assert [p.name for p in list_checkpoints(tmp_path / "bounded")] == [f"update-{u:06d}" for u in range(1, crossing)]


@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_the_reward_flow_trace_of_a_grpo_update_is_written_with_and_without_a_reference(tmp_path, tokenizer, prompts,
                                                                                        make_policy, beta):
    """The train stage's trace (JSON + heatmap) of a GRPO update; at TRL's beta 0 there is no reference, so no KL
    (the heatmap's title once formatted the missing KL and failed the stage at its first traced update)."""
    from rlhf_core.trace import trace_update
    from tasks.reports.plots import plot_trace

    traces = []
    cfg = _tiny(total_episodes=32, beta=beta)
    trainer = RLTrainer(cfg, make_policy(0), FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                        stop_token_id=1, on_update=lambda t, batch, stats: traces.append(
                            trace_update(batch, stats, cfg, update=t.state.update, decode=tokenizer.decode)))
    trainer.train()
    trace = traces[-1]
    assert ("kl" in trace["quantities"]) == (beta > 0) and (trace["rollouts"][0]["kl_sum"] is None) == (beta == 0)
    plot_trace(trace, tmp_path / "update.png")
    assert (tmp_path / "update.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------- TRL 1.16.0 equality

N_PROMPTS, K, P, R, TEMPERATURE = 4, 4, 5, 6, 0.9


def _episodes(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts (B, P) of one length (k copies each), completions (B, R) padded after EOS, their mask, rewards."""
    g = torch.Generator().manual_seed(3)
    queries = torch.randint(2, vocab, (N_PROMPTS, P), generator=g).repeat_interleave(K, 0)  # (B, P)
    responses = torch.randint(2, vocab, (N_PROMPTS * K, R), generator=g)
    stops = torch.tensor([1, 3, R - 1, -1] * N_PROMPTS)  # where EOS lands; -1: truncated, never stops
    for row, stop in enumerate(stops.tolist()):
        if stop >= 0:
            responses[row, stop] = 1
            responses[row, stop + 1:] = 0
    mask = torch.arange(R)[None, :] <= torch.where(stops < 0, R, stops)[:, None]  # (B, R) up to EOS
    rewards = torch.randn(N_PROMPTS * K, generator=g)
    rewards[K:2 * K] = 0.5  # a group of equal rewards: std 0
    return queries, responses, mask, rewards


def _logprobs(model, queries, responses, mask, share=False) -> torch.Tensor:
    logits = response_logits(model, (queries, torch.ones_like(queries, dtype=torch.bool), responses, mask),
                             TEMPERATURE, share_prompts=share)
    return ops.selective_log_softmax(logits, responses) * mask


def _run_trl(directory: Path, cases: list[dict]) -> list[dict]:
    """TRL 1.16.0's side of `cases`, in its own venv, in one process."""
    if not TRL116_PYTHON.exists():
        pytest.fail(f"{TRL116_PYTHON} is missing: `make trl116` builds TRL 1.16.0's venv (make test does)")
    torch.save(cases, directory / "cases.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    done = subprocess.run([str(TRL116_PYTHON), str(ROOT / "tests" / "trl116_side.py"), str(directory / "cases.pt"),
                           str(directory / "out.pt")], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(directory / "out.pt", weights_only=True)


def _grads_close(ours: dict[str, torch.Tensor], trl: dict[str, torch.Tensor], label: str) -> dict:
    assert set(ours) == set(trl), f"{label}: parameters differ"
    worst_abs = max((ours[k] - trl[k]).abs().max().item() for k in ours)
    scale = max(trl[k].abs().max().item() for k in trl)
    assert scale > 0, f"{label}: TRL's gradient is zero; the check would be empty"
    for name in ours:
        torch.testing.assert_close(ours[name], trl[name], rtol=1e-4, atol=1e-5 * scale, msg=f"{label}: {name}")
    return {"max_abs": worst_abs, "max_rel": worst_abs / scale}


def _world(tmp_path_factory, tiny_config):
    """The reference saved where TRL loads it from, and the policy moved away from it (so the KL is not 0)."""
    from rlhf_core.bench import word_tokenizer
    from rlhf_core.models import init_causal_lm

    model_dir = tmp_path_factory.mktemp("trl116") / "policy"
    ref = init_causal_lm(tiny_config, seed=0)
    ref.save_pretrained(model_dir, safe_serialization=True)
    word_tokenizer(tiny_config.vocab_size).save_pretrained(model_dir)
    policy = init_causal_lm(tiny_config, seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model_dir, ref.eval(), policy


def _ours(algo, cfg: RLConfig, batch: Rollout, policy) -> dict:
    """Our advantages, loss and gradients of one update on `batch` (one micro-batch: the whole mini-batch)."""
    module = {"grpo": grpo, "rloo": rloo}[algo]
    batch, _ = module.compute_advantages(batch, cfg)
    policy.zero_grad()
    # the training forward the trainer builds (the fused log-probs and entropy)
    out = PolicyAndValue(policy)(
        batch.queries, batch.query_mask, batch.responses, batch.response_mask, TEMPERATURE, share_prompts=True,
        with_entropy=True)
    loss, stats = module.loss(out, batch, cfg)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in policy.named_parameters() if p.grad is not None}
    return {"batch": batch, "loss": loss.detach(), "stats": stats, "grads": grads}


def _ours_steps(cfg: RLConfig, batch: Rollout, policy) -> list[dict[str, torch.Tensor]]:
    """The policy's weights after each optimizer step of our trainer's update phase (`RLTrainer.optimize`: its
    shuffled mini-batch, micro-batches and accumulation) on `batch`, from `policy`'s weights."""
    import copy

    from rlhf_core.metrics import MetricAccumulator

    trainer = RLTrainer(cfg, copy.deepcopy(policy), FunctionScorer(_length, None), [[2, 3]] * N_PROMPTS, pad_token_id=0,
                        stop_token_id=1)
    weights = []
    trainer._sync_reference = lambda step: weights.append(  # called after each optimizer step
        {name: p.detach().clone() for name, p in trainer.unwrapped.policy.named_parameters()})
    filled, _ = trainer.compute_advantages(batch)
    trainer.optimize(filled, MetricAccumulator())
    return weights


def _case(algo, world, config: dict, old=None, steps: dict | None = None) -> dict:
    model_dir, _, policy = world
    queries, responses, mask, rewards = _episodes(policy.config.vocab_size)
    return {"algo": algo, "model_dir": str(model_dir), "policy_state": policy.state_dict(), "steps": steps,
            "prompt_ids": queries.tolist(), "rewards": rewards, "old_logprobs": old,
            "completion_ids": [row[:int(n)].tolist() for row, n in zip(responses, mask.sum(1), strict=True)],
            "config": dict(num_generations=K, max_completion_length=R, temperature=TEMPERATURE,
                           gradient_checkpointing=False, **config)}


GRPO_CASES = [(loss_type, level) for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")
              for level in ("token", "sequence")]
# beside the loss types: TRL's default beta 0 (no reference, no KL term), and the two other reward scalings
GRPO_SETTINGS = {"beta0": dict(beta=0.0), "scale_batch": dict(scale_rewards="batch"),
                 "scale_none": dict(scale_rewards="none")}
# optimizer steps: two micro-batches accumulated into one step (forced old log-probs), and two iterations over one
# generation (TRL computes the old log-probs itself); losses whose sum does not depend on how the micro-batches
# are drawn (TRL shuffles them, ours too, differently), the high-entropy mask off for the same reason
LR, ADAM_EPS = 1e-3, 1e-5
GRPO_STEPS = {"micro2/grpo": dict(loss_type="grpo", micro_batches=2, iterations=1),
              "micro2/dapo": dict(loss_type="dapo", micro_batches=2, iterations=1),
              "iterations2/grpo": dict(loss_type="grpo", micro_batches=2, iterations=2)}


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory, tiny_config) -> dict:
    """Ours and TRL 1.16.0's update for every GRPO case and RLOO: {name: (ours, TRL's)}.

    Same weights (the policy moved from the reference TRL loads), prompts, completions (some stop at EOS, some are
    truncated), rewards (one group all equal) and, for GRPO, old log-probs off the policy's by noise, so the
    ratios clip; beta 0.1, clip-higher, delta, truncated completions masked, the entropy mask on."""
    world = _world(tmp_path_factory, tiny_config)
    _, ref, policy = world
    queries, responses, mask, rewards = _episodes(policy.config.vocab_size)
    contains_stop = responses.eq(1).any(1)
    with torch.no_grad():
        current = _logprobs(policy, queries, responses, mask, share=True)
        g = torch.Generator().manual_seed(7)  # off by token and by sequence: both importance levels clip
        old = (current + 0.2 * torch.randn(mask.shape, generator=g) + 0.3 * torch.randn(len(mask), 1, generator=g))
        old = old * mask
        ref_logprobs = _logprobs(ref, queries, responses, mask)
    episodes = Rollout(queries=queries, query_mask=torch.ones_like(queries, dtype=torch.bool), responses=responses,
                       response_mask=mask, logprobs=old, ref_logprobs=ref_logprobs, contains_stop=contains_stop,
                       scores=rewards)
    sizes = dict(response_length=R, temperature=TEMPERATURE, total_episodes=len(queries), num_epochs=1,
                 per_device_train_batch_size=len(queries), gradient_accumulation_steps=1,
                 local_rollout_forward_batch_size=len(queries))
    ours, cases = {}, []
    grpo_cases = {f"{loss_type}/{level}": dict(loss_type=loss_type, importance_sampling_level=level)
                  for loss_type, level in GRPO_CASES}
    grpo_cases.update({name: dict(loss_type="grpo", importance_sampling_level="token", **settings)
                       for name, settings in GRPO_SETTINGS.items()})
    for name, case in grpo_cases.items():
        options = dict(scale_rewards="group", delta=1.25, top_entropy_quantile=0.6, beta=0.1, epsilon=0.2,
                       epsilon_high=1.2 if case["loss_type"] == "cispo" else 0.28, mask_truncated_completions=True)
        options.update(case)
        cfg = RLConfig(algo="grpo", num_generations=K, **sizes, **options)
        ours[name] = _ours("grpo", cfg, replace(episodes, in_loss=contains_stop), policy)
        cases.append(_case("grpo", world, options, old=old))
    for name, case in GRPO_STEPS.items():
        micro, iterations = case["micro_batches"], case["iterations"]
        options = dict(loss_type=case["loss_type"], scale_rewards="group", delta=1.25, beta=0.1, epsilon=0.2,
                       epsilon_high=0.28, mask_truncated_completions=True)
        cfg = RLConfig(algo="grpo", num_generations=K, **{**sizes, "per_device_train_batch_size": len(queries) // micro,
                       "gradient_accumulation_steps": micro, "num_epochs": iterations}, learning_rate=LR,
                       adam_eps=ADAM_EPS, weight_decay=0.0, lr_scheduler="constant", max_grad_norm=None, **options)
        forced = old if iterations == 1 else None  # with iterations, TRL reads them off the policy as ours does
        batch = replace(episodes, logprobs=current if forced is None else forced, in_loss=contains_stop)
        ours[name] = {"weights": _ours_steps(cfg, batch, policy)}
        steps = dict(micro_batches=micro, iterations=iterations, lr=LR, eps=ADAM_EPS)
        cases.append(_case("grpo", world, {**options, "num_iterations": iterations}, old=forced, steps=steps))
    # RLOO: TRL 1.16 puts the k1 KL of its own rollout log-probs in the reward, so ours takes the policy's too; with
    # mask_truncated_completions a truncated completion pays no KL and counts in the loss's mean at zero gradient
    for name, masked in (("rloo", False), ("rloo/masked", True)):
        cfg = RLConfig(algo="rloo", num_generations=K, beta=0.1, epsilon=0.2, kl_estimator="k1",
                       mask_truncated_completions=masked, **sizes)
        ours[name] = _ours("rloo", cfg, replace(episodes, logprobs=current, in_loss=contains_stop if masked else None),
                           policy)
        cases.append(_case("rloo", world, dict(beta=0.1, epsilon=0.2, mask_truncated_completions=masked)))
    trl = _run_trl(tmp_path_factory.mktemp("trl116-runs"), cases)
    runs = {name: (ours[name], theirs) for name, theirs in zip(ours, trl, strict=True)}
    runs["policy"] = ({}, {name: p.detach().clone() for name, p in policy.named_parameters()})
    return runs


def _world_weights(trl_runs: dict) -> tuple[None, None, dict[str, torch.Tensor]]:
    """The policy's weights before any step (what every case started from)."""
    return None, None, trl_runs["policy"][1]


@pytest.mark.parametrize("name", [*(f"{loss_type}/{level}" for loss_type, level in GRPO_CASES), *GRPO_SETTINGS])
def test_grpo_update_equals_trl_1_16(name, trl_runs):
    """One update's advantages, reference log-probs, loss and gradients equal TRL 1.16.0's (fp32 CPU)."""
    ours, trl = trl_runs[name]
    batch, stats = ours["batch"], ours["stats"]
    assert stats["cispo_clip_ratio" if name.startswith("cispo") else "clip_ratio/region_mean"] > 0, \
        "the case must clip somewhere"
    torch.testing.assert_close(batch.advantages, trl["advantages"][:, None], rtol=1e-5, atol=1e-6)
    if name == "beta0":  # TRL loads no reference at beta 0, and ours reads none into the loss
        assert "ref_per_token_logps" not in trl and "kl" not in stats
    else:  # TRL drops a truncated completion from the attention mask too (mask_truncated_completions): the rest
        kept = batch.loss_mask
        torch.testing.assert_close(batch.ref_logprobs * kept, trl["ref_per_token_logps"] * kept, rtol=1e-5, atol=1e-5)
    assert ours["loss"].item() == pytest.approx(trl["loss"].item(), rel=1e-5, abs=1e-7)
    figures = _grads_close(ours["grads"], trl["grads"], name)
    print(f"grpo {name}: loss {ours['loss'].item():.6g} vs {trl['loss'].item():.6g}, gradients {figures}")


@pytest.mark.parametrize("name", list(GRPO_STEPS))
def test_grpo_optimizer_steps_equal_trl_1_16(name, trl_runs, tiny_config):
    """Micro-batches accumulated into an optimizer step, and num_iterations > 1 (the second pass over a generation
    with the moved policy against the generation's old log-probs): the weights after every AdamW step equal TRL
    1.16.0's to float rounding (Adam divides each gradient by its own magnitude: tolerance 2 % of the step)."""
    ours, trl = trl_runs[name]
    _, _, policy = _world_weights(trl_runs)
    assert len(ours["weights"]) == len(trl["weights"]) == GRPO_STEPS[name]["iterations"]
    for step, (mine, theirs) in enumerate(zip(ours["weights"], trl["weights"], strict=True), 1):
        assert set(mine) == set(theirs), "parameters differ"
        moved = max((theirs[k] - policy[k]).abs().max().item() for k in theirs)
        assert moved > LR / 2, f"step {step}: TRL's weights did not move; the check would be empty"
        for key in mine:
            torch.testing.assert_close(mine[key] - policy[key], theirs[key] - policy[key], rtol=1e-3, atol=0.02 * LR,
                                       msg=f"{name}, step {step}: {key}")


@pytest.mark.parametrize("name", ["rloo", "rloo/masked"])
def test_rloo_update_equals_trl_1_16(name, trl_runs):
    """RLOO (the sequence's k1 KL in the reward, the summed-log-prob ratio) against TRL 1.16.0's RLOOTrainer, and
    with mask_truncated_completions: a truncated completion's reward carries no KL penalty (its tokens are out of
    the mask the KL is summed over), it stays in its group's baseline, and it counts in the loss's mean at zero
    gradient."""
    ours, trl = trl_runs[name]
    torch.testing.assert_close(ours["batch"].advantages.view(-1), trl["advantages"].view(-1), rtol=1e-5, atol=1e-5)
    assert ours["loss"].item() == pytest.approx(trl["loss"].item(), rel=1e-5, abs=1e-6)
    figures = _grads_close(ours["grads"], trl["grads"], name)
    print(f"{name}: loss {ours['loss'].item():.6g} vs {trl['loss'].item():.6g}, gradients {figures}")
