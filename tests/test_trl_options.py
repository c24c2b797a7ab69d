"""TRL RLOO's options, each shown by its effect: clip-higher, truncation masking, generation reuse under TRL's
names, reference sync, generation kwargs, and their validation."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch
from test_trainer import make_trainer, params, tiny_config

from rlhf_core import ops, rloo
from rlhf_core.batching import pad
from rlhf_core.checkpoint import REFERENCE_FILE, list_checkpoints
from rlhf_core.config import RLConfig
from rlhf_core.data import mini_batch_indices
from rlhf_core.decode import TokenChoice, decode
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.rollout import PolicyOutput, response_logits

# ------------------------------------------------------------------ clip-higher


def test_clip_higher_leaves_a_positive_advantage_unclipped_between_the_bounds():
    """ratio 1.25 with A > 0: clipped (no gradient) by the symmetric 0.2, not by epsilon_high 0.28."""
    old = torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    advantages = torch.ones(1, 1)
    grads = {}
    for high in (None, 0.28):
        logprobs = torch.full((1, 1), torch.log(torch.tensor(1.25)).item(), requires_grad=True)
        loss, clipfrac = ops.ppo_policy_loss(logprobs, old, advantages, mask, 0.2, high)
        loss.backward()
        grads[high] = logprobs.grad.item()
        assert clipfrac.item() == (1.0 if high is None else 0.0)
    assert grads[None] == 0.0 and grads[0.28] == pytest.approx(-1.25)


def test_clip_ratios_count_each_side_as_a_naive_loop_does():
    generator = torch.Generator().manual_seed(0)
    ratio = torch.exp(0.4 * torch.randn(6, 9, generator=generator))
    advantages = torch.randn(6, 9, generator=generator)
    mask = torch.rand(6, 9, generator=generator) > 0.3
    out = ops.clip_ratios(ratio, advantages, mask, 0.2, 0.28)
    low = high = n = 0
    for r, a, m in zip(ratio.flatten().tolist(), advantages.flatten().tolist(), mask.flatten().tolist(),
                       strict=True):
        if m:
            n += 1
            low += r < 0.8 and a < 0
            high += r > 1.28 and a > 0
    assert out["clip_ratio/low_mean"].item() == pytest.approx(low / n)
    assert out["clip_ratio/high_mean"].item() == pytest.approx(high / n)
    assert out["clip_ratio/region_mean"].item() == pytest.approx((low + high) / n)


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_epsilon_high_reaches_the_trainers_loss(algo, tokenizer, prompts, make_policy, make_scorer_model):
    """A batch whose old log-probs put every ratio at 1.25: where the advantage is positive the symmetric clip
    (cliprange 0.2) stops the gradient and epsilon_high 0.28 lets it through, so the policy's update differs;
    epsilon_high equal to cliprange is the symmetric clip, to the last bit."""
    updates, clipped = {}, {}
    for high in (None, 0.2, 0.28):
        cfg = tiny_config(algo, total_episodes=32, epsilon_high=high, num_epochs=1)
        trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
        batch, _ = trainer.compute_advantages(trainer.score(trainer.rollout(list(range(32 // cfg.samples_per_prompt)))))
        # every ratio 1.25: per token (PPO), or per sequence of summed log-probs (RLOO's default)
        lengths = batch.response_lengths[:, None] if algo == "rloo" else 1
        batch = replace(batch, logprobs=batch.logprobs - math.log(1.25) / lengths * batch.response_mask)
        before = params(trainer)
        metrics = MetricAccumulator()
        trainer.optimize(batch, metrics)
        updates[high] = {k: v - before[k] for k, v in params(trainer).items() if k.startswith("policy.")}
        clipped[high] = metrics.reduce()["clip_ratio/high_mean"]
    assert clipped[None] == clipped[0.2] > 0.2 and clipped[0.28] == 0.0, clipped
    for name, delta in updates[None].items():
        assert torch.equal(delta, updates[0.2][name]), name
    assert any(not torch.allclose(delta, updates[0.28][name]) for name, delta in updates[None].items())


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_clip_metrics_are_logged(algo, tokenizer, prompts, make_policy, make_scorer_model):
    cfg = tiny_config(algo, total_episodes=32, epsilon_high=0.28)
    history = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model).train()
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert 0.0 <= history[0][key] <= 1.0, key


# ------------------------------------------------------------------ truncation masking


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_truncated_completions_contribute_zero_gradient(algo, tokenizer, prompts, make_policy, make_scorer_model):
    """With stop_token eos and 8-token responses, the tiny random policy rarely stops: the completions that
    never reached EOS are left out, so with every completion truncated nothing moves; without masking the
    same run moves the policy."""
    moved = {}
    for masked in (False, True):
        cfg = tiny_config(algo, total_episodes=32, stop_token="eos", mask_truncated_completions=masked)
        trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
        batch = trainer.score(trainer.rollout(list(range(32 // cfg.samples_per_prompt))))
        trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
        before = params(trainer)
        stopped = batch.contains_stop
        keep = torch.zeros(len(batch), dtype=torch.bool)  # every episode counts as truncated
        filled, _ = trainer.compute_advantages(batch)
        filled = replace(filled, in_loss=keep) if masked else filled
        trainer.optimize(filled, MetricAccumulator())
        after = params(trainer)
        moved[masked] = sum((after[k] - before[k]).abs().sum().item() for k in before)
        assert masked is False or torch.equal(batch.in_loss, stopped)
    assert moved[False] > 0 and moved[True] == 0.0


def test_truncation_masking_only_removes_the_truncated_episodes(tokenizer, prompts, make_policy,
                                                                make_scorer_model):
    """The loss over a batch where some episodes are left out equals the loss over the kept ones alone."""
    cfg = tiny_config("rloo", total_episodes=32, rloo={"rloo_k": 2, "kl_level": "token"})
    trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    batch, _ = trainer.compute_advantages(trainer.score(trainer.rollout(list(range(16)))))
    keep = torch.arange(len(batch)) % 3 != 0
    logprobs = batch.logprobs.clone().requires_grad_()
    out = PolicyOutput(logprobs=logprobs, entropy=torch.zeros_like(logprobs))
    masked_loss, _ = rloo.loss(out, replace(batch, in_loss=keep), cfg)
    masked_loss.backward()
    assert logprobs.grad[~keep].abs().sum() == 0 and logprobs.grad[keep].abs().sum() > 0
    kept = batch[keep]
    kept_out = PolicyOutput(logprobs=kept.logprobs, entropy=torch.zeros_like(kept.logprobs))
    kept_loss, _ = rloo.loss(kept_out, kept, cfg)
    assert masked_loss.item() == pytest.approx(kept_loss.item(), rel=1e-6)


# ------------------------------------------------------------------ generation reuse (TRL names)


def test_trl_generation_reuse_names_map_onto_the_batch_hierarchy():
    cfg = RLConfig(gradient_accumulation_steps=4, steps_per_generation=8, num_iterations=3)
    assert (cfg.num_mini_batches, cfg.num_epochs, cfg.steps_per_generation, cfg.num_iterations) == (2, 3, 8, 3)
    assert "steps_per_generation" not in cfg.model_dump()
    with pytest.raises(ValueError, match="steps_per_generation=6 must be a positive multiple of "
                                         "gradient_accumulation_steps=4"):
        RLConfig(gradient_accumulation_steps=4, steps_per_generation=6)
    with pytest.raises(ValueError, match="num_mini_batches=3 is set"):
        RLConfig(gradient_accumulation_steps=4, steps_per_generation=8, num_mini_batches=3)
    with pytest.raises(ValueError, match="num_iterations=2 and num_epochs=4"):
        RLConfig(num_iterations=2, num_epochs=4)


def test_steps_per_generation_two_accumulations_generates_half_as_often(tokenizer, prompts, make_policy,
                                                                         make_scorer_model):
    counts = {}
    for steps in (4, 8):  # gradient_accumulation_steps is 4: one or two optimizer steps per generation
        cfg = tiny_config("rloo", total_episodes=128, steps_per_generation=steps,
                          per_device_train_batch_size=8, num_epochs=1)
        trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
        calls = []
        rollout = trainer.rollout
        trainer.rollout = lambda indices, calls=calls, rollout=rollout: calls.append(len(indices)) or rollout(indices)
        trainer.train()
        counts[steps] = (len(calls), trainer.plan.num_optimizer_steps)
    assert counts[4] == (4, 4) and counts[8] == (2, 4)


def test_second_iteration_sees_ratios_that_are_not_one(tokenizer, prompts, make_policy, make_scorer_model):
    """num_iterations 2: the first pass trains on-policy (ratio exactly 1), the second on the moved policy."""
    cfg = tiny_config("rloo", total_episodes=32, num_epochs=2, learning_rate=3e-2)
    assert cfg.num_iterations == 2
    trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    ratios = []
    algo_loss = trainer.algo.loss

    class Recording:
        def __getattr__(self, name):
            return getattr(trainer.algo_module, name)

        @staticmethod
        def loss(out, mb, cfg):
            value, stats = algo_loss(out, mb, cfg)
            ratios.append(stats["val/ratio"].item())
            return value, stats

    trainer.algo_module, trainer.algo = trainer.algo, Recording()
    trainer.train()
    steps = cfg.gradient_accumulation_steps
    assert len(ratios) == 2 * steps
    assert ratios[0] == pytest.approx(1.0, abs=1e-6)
    assert all(abs(r - 1.0) > 1e-4 for r in ratios[steps:]), ratios


# ------------------------------------------------------------------ reference sync


def test_reference_follows_the_policy_by_the_mixup_rule(tokenizer, prompts, make_policy, make_scorer_model):
    cfg = tiny_config("rloo", total_episodes=32, sync_ref_model=True, ref_model_sync_steps=1,
                      ref_model_mixup_alpha=0.6)
    trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    reference_before = {k: v.clone() for k, v in trainer.ref_policy.state_dict().items()}
    trainer.train()  # one update, one optimizer step
    policy = trainer.unwrapped.policy.state_dict()
    moved = 0.0
    for name, value in trainer.ref_policy.state_dict().items():
        expected = 0.6 * policy[name].float() + 0.4 * reference_before[name].float()
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
        moved += (value - reference_before[name]).abs().sum().item()
    assert moved > 0


def test_reference_sync_every_n_steps_only(tokenizer, prompts, make_policy, make_scorer_model):
    cfg = tiny_config("rloo", total_episodes=32, sync_ref_model=True, ref_model_sync_steps=2)
    trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    before = {k: v.clone() for k, v in trainer.ref_policy.state_dict().items()}
    trainer.train()  # one optimizer step: not yet the second
    for name, value in trainer.ref_policy.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_resume_with_reference_sync_and_generation_reuse(tmp_path, tokenizer, prompts, make_policy,
                                                         make_scorer_model):
    """The moved reference is part of the checkpoint; with two optimizer steps per generation the resumed
    run ends where the uninterrupted one does."""
    cfg = tiny_config("ppo", total_episodes=64 * 3, steps_per_generation=8, num_epochs=1, checkpoint_every=1,
                      sync_ref_model=True, ref_model_sync_steps=1)
    straight = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    straight.train()
    first = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model, checkpoint_dir=tmp_path)
    first.train(max_updates=2)
    checkpoint = list_checkpoints(tmp_path)[-1]
    assert (checkpoint / REFERENCE_FILE).is_file()
    resumed = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model, policy_seed=5,
                           ref_policy=make_policy(0), checkpoint_dir=tmp_path)
    resumed.load_checkpoint(checkpoint)
    resumed.train()
    for name, value in params(straight).items():
        torch.testing.assert_close(params(resumed)[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for name, value in straight.ref_policy.state_dict().items():
        torch.testing.assert_close(resumed.ref_policy.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_reference_sync_is_refused_where_it_cannot_work(tokenizer, prompts, make_policy, make_scorer_model):
    with pytest.raises(ValueError, match="kl_coef=0"):
        RLConfig(sync_ref_model=True, kl_coef=0.0)
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(make_policy(0), LoraConfig(r=4, target_modules=["query_key_value"]))
    cfg = tiny_config("rloo", total_episodes=32, sync_ref_model=True)
    with pytest.raises(ValueError, match="with LoRA the reference is the base model"):
        make_trainer(cfg, tokenizer, prompts, lambda seed: policy, make_scorer_model)


# ------------------------------------------------------------------ generation kwargs


def test_top_k_one_samples_the_most_likely_token(make_policy, prompts):
    queries = torch.tensor([prompts[0]] * 4)
    mask = torch.ones_like(queries, dtype=torch.bool)
    responses, _ = decode(make_policy(0), queries, mask, response_length=6, choice=TokenChoice(top_k=1),
                          pad_token_id=0, stop_token_id=None)
    assert (responses == responses[0]).all(), "top_k=1 leaves one token to sample: every row is the same"
    free, _ = decode(make_policy(0), queries, mask, response_length=6, choice=TokenChoice(), pad_token_id=0,
                     stop_token_id=None)
    assert not (free == free[0]).all()


def test_top_p_draws_only_from_the_nucleus(make_policy, prompts):
    """Every token drawn with top_p 0.6 lies in the smallest set of most likely tokens whose probability reaches
    0.6 at its step (softmax(logits / T) of the prefix it was drawn after); without top_p many do not."""
    policy = make_policy(0)
    queries, mask = pad(prompts[:32], 0, "left")
    kwargs = dict(response_length=8, pad_token_id=0, stop_token_id=None, noise_keys=torch.arange(32))
    outside = {}
    for top_p in (0.6, 1.0):
        responses, _ = decode(policy, queries, mask, choice=TokenChoice(temperature=0.8, top_p=top_p), **kwargs)
        full = torch.ones_like(responses, dtype=torch.bool)
        with torch.no_grad():
            probs = response_logits(policy, (queries, mask, responses, full), 0.8).softmax(-1)  # (B, R, V)
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # the probability of the tokens ranked above each
        in_nucleus = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < 0.6 + 1e-6)
        outside[top_p] = (~in_nucleus.gather(-1, responses[..., None])).float().mean().item()
    assert outside[0.6] == 0.0 and outside[1.0] > 0.1, outside


def test_truncated_sampling_warns_about_the_ratio(caplog, tokenizer, prompts, make_policy, make_scorer_model):
    with caplog.at_level(logging.WARNING, logger="rlhf_core.rl_trainer"):
        make_trainer(tiny_config("rloo", total_episodes=32), tokenizer, prompts, make_policy, make_scorer_model)
        assert not caplog.records
        make_trainer(tiny_config("rloo", total_episodes=32, top_p=0.9), tokenizer, prompts, make_policy,
                     make_scorer_model)
    assert "off-policy" in caplog.text


# ------------------------------------------------------------------ reward functions


def length_reward(prompts, completions):
    """A reward function importable by path (this test module is on sys.path)."""
    return [float(len(c.split())) for c in completions]


NOT_CALLABLE = 3


def test_reward_functions_by_import_path_and_their_errors():
    from rlhf_core.reward_functions import import_reward_function

    assert import_reward_function("test_trl_options:length_reward") is length_reward
    for path, message in (("test_trl_options.length_reward", "expected 'package.module:function'"),
                          ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
                          ("test_trl_options:missing", "has no 'missing'"),
                          ("test_trl_options:NOT_CALLABLE", "is a int, not callable")):
        with pytest.raises(ValueError, match=message):
            import_reward_function(path)


def test_each_reward_source_is_logged(tokenizer, prompts, make_policy, make_scorer_model):
    from conftest import target_fraction
    from rlhf_core.scoring import FunctionScorer, WeightedScorer

    scorer = WeightedScorer([(1.0, FunctionScorer(target_fraction, tokenizer)),
                             (0.5, FunctionScorer(length_reward, tokenizer))], names=["target", "length"])
    cfg = tiny_config("rloo", total_episodes=32)
    trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    trainer.scorer = scorer
    history = trainer.train()
    first = history[0]
    assert 0.0 < first["rewards/length/mean"] <= 8.0 and first["rewards/length/std"] >= 0.0  # words, 8 at most
    assert 0.0 <= first["rewards/target/mean"] <= 1.0
    assert first["objective/scores"] == pytest.approx(first["rewards/target/mean"] + 0.5 * first["rewards/length/mean"])
    with pytest.raises(ValueError, match="distinct names"):
        WeightedScorer([(1.0, scorer), (1.0, scorer)], names=["a", "a"])


# ------------------------------------------------------------------ monitors


def test_a_monitor_is_logged_and_changes_nothing(tokenizer, prompts, make_policy, make_scorer_model):
    """A gold reward watched during training: logged as monitor/<name>, the training itself identical."""
    from rlhf_core.scoring import GoldScorer

    seen = []

    def gold(prompt, completion, ended):
        seen.append((prompt, completion, ended))
        return float(len(completion.split()))

    runs = {}
    for monitored in (False, True):
        cfg = tiny_config("ppo", total_episodes=64)
        monitors = {"gold": GoldScorer(gold, tokenizer)} if monitored else None
        trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model, monitors=monitors)
        runs[monitored] = (trainer.train(), params(trainer))
    (plain, plain_params), (watched, watched_params) = runs[False], runs[True]
    assert "monitor/gold" not in plain[0] and 0.0 < watched[0]["monitor/gold"] <= 8.0
    assert len(seen) == 64 and all(isinstance(e, bool) and isinstance(p, str) for p, _, e in seen)
    for name, value in plain_params.items():
        assert torch.equal(watched_params[name], value), name


@pytest.mark.parametrize("num_mini_batches", [2, 4])
def test_mini_batches_are_the_same_episodes_whatever_the_process_count(num_mini_batches):
    """Generation reuse across processes: mini-batch m holds the same global episodes with 1, 2 or 4 processes,
    an equal share on each process, and every episode once per epoch."""
    size = 32
    def global_minis(processes):
        generator, per_rank = torch.Generator(), []
        for rank in range(processes):
            generator.manual_seed(7)  # every process draws the same numbers
            per_rank.append([(rank * size // processes + idx).tolist() for idx in
                             mini_batch_indices(size, num_mini_batches, rank=rank, num_processes=processes,
                                                generator=generator)])
        assert all(len(m) == size // processes // num_mini_batches for rank in per_rank for m in rank)
        return [sorted(sum((rank[m] for rank in per_rank), [])) for m in range(num_mini_batches)]
    one = global_minis(1)
    assert sorted(sum(one, [])) == list(range(size))
    assert global_minis(2) == one and global_minis(4) == one
    assert one[0] != list(range(size // num_mini_batches)), "mini-batches are drawn at random"


def test_one_mini_batch_keeps_a_prompts_samples_side_by_side():
    """One mini-batch: the shard is shuffled by prompt, so each micro-batch holds whole groups of k samples
    (their prompt is computed once); with k = 1 it is the plain shuffle."""
    [order] = mini_batch_indices(24, 1, rank=0, num_processes=1, generator=torch.Generator().manual_seed(3),
                                 group_size=3)
    assert sorted(order.tolist()) == list(range(24)) and order.tolist() != list(range(24))
    groups = order.view(8, 3)
    assert (groups // 3 == groups[:, :1] // 3).all() and (groups % 3 == torch.arange(3)).all()
    [plain] = mini_batch_indices(24, 1, rank=0, num_processes=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(plain, torch.randperm(24, generator=torch.Generator().manual_seed(3)))


def test_episode_keyed_sampling_gives_each_episode_its_completion_whatever_the_batch(tokenizer, prompts, make_policy,
                                                                                     make_scorer_model):
    """sampling_seed=episode: the rollout of the same prompts is the same in chunks of 32 or 8, and changes with
    the update; with the process stream (default) two rollouts differ."""
    def rollout(chunk, update=0, sampling_seed="episode"):
        cfg = tiny_config("rloo", total_episodes=64, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                          local_rollout_forward_batch_size=chunk, sampling_seed=sampling_seed, stop_token="eos")
        trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
        trainer.state.update = update
        torch.manual_seed(chunk)  # the global stream differs: keyed sampling must not read it
        return trainer.rollout(list(range(8))).responses
    base = rollout(32)
    assert torch.equal(base, rollout(8)), "the same completions whatever the rollout batch"
    assert not torch.equal(base, rollout(32, update=1))
    assert not torch.equal(rollout(32, sampling_seed="process"), rollout(8, sampling_seed="process"))
