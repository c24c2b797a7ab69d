"""The reward-flow trace agrees with the ops: rewards sum to score - KL penalty, returns = advantages + values
(PPO), sequence reward - leave-one-out baseline = advantage (RLOO); the train stage writes JSON + PNG."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import target_fraction
from rlhf_core import ops
from rlhf_core.config import RLConfig
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.scoring import FunctionScorer
from rlhf_core.trace import trace_due, trace_update
from tasks.parameters.params import Params
from tasks.stages.train import _prune_traces, _trace_writer

SMALL = dict(total_episodes=32, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_epochs=1,
             local_rollout_forward_batch_size=16, response_length=6, temperature=1.0, kl_coef=0.1,
             learning_rate=3e-3, lr_scheduler="constant", stop_token="eos", missing_eos_penalty=1.0)


def traces_of(cfg: RLConfig, tokenizer, prompts, make_policy, make_scorer_model, rollouts: int = 4) -> list[dict]:
    """Train 2 updates, tracing every update through the trainer's hook."""
    traces = []

    def hook(trainer, batch, stats):
        traces.append(trace_update(batch, stats, trainer.cfg, update=trainer.state.update, decode=tokenizer.decode,
                                   rollouts=rollouts))

    value = make_scorer_model(1) if cfg.algo == "ppo" else None
    RLTrainer(cfg, make_policy(0), FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
              stop_token_id=1, value_model=value, on_update=hook).train()
    assert [t["update"] for t in traces] == [1, 2]
    assert any(abs(tok["kl"]) > 1e-4 for r in traces[1]["rollouts"] for tok in r["tokens"]), \
        "after one update the policy differs from the reference: the KL terms are exercised"
    return traces


def column(rollout: dict, name: str) -> torch.Tensor:
    return torch.tensor([tok[name] for tok in rollout["tokens"]], dtype=torch.float64)


def assert_close(a, b) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5)


def check_shaped_rewards(rollout: dict, kl_coef: float) -> None:
    """r_t = -kl_coef * KL_t, plus the score on the final response token; sum_t r_t = score - KL penalty."""
    kl, reward, score = column(rollout, "kl"), column(rollout, "reward"), column(rollout, "score")
    assert_close(column(rollout, "kl"), column(rollout, "logprob") - column(rollout, "ref_logprob"))  # k1
    assert rollout["score_position"] == rollout["response_length"] - 1
    assert_close(score, [rollout["score"] if t == rollout["score_position"] else 0.0 for t in range(len(score))])
    assert_close(reward, -kl_coef * kl + score)
    assert_close(reward.sum(), rollout["score"] - kl_coef * kl.sum())
    assert_close(reward.sum(), rollout["rlhf_reward"])


def test_ppo_trace_agrees_with_the_ops(tokenizer, prompts, make_policy, make_scorer_model):
    cfg = RLConfig(algo="ppo", whiten_advantages=False, ppo={"lam": 1.0}, **SMALL)
    for trace in traces_of(cfg, tokenizer, prompts, make_policy, make_scorer_model):
        assert trace["quantities"] == ["logprob", "ref_logprob", "kl", "kl_penalty", "score", "reward", "value",
                                       "advantage", "return"]
        for rollout in trace["rollouts"]:
            check_shaped_rewards(rollout, cfg.kl_coef)
            reward, value, advantage, ret = (column(rollout, k) for k in ("reward", "value", "advantage", "return"))
            assert_close(ret, advantage + value)  # GAE's value target
            assert_close(ret, reward.flip(0).cumsum(0).flip(0))  # gamma = lam = 1: the reward-to-go
            penalty = cfg.missing_eos_penalty if not rollout["contains_stop"] else 0.0
            assert rollout["missing_eos_penalty"] == penalty
            assert rollout["contains_stop"] == (rollout["tokens"][-1]["token"] == "[EOS]")


def test_ppo_trace_shows_the_whitened_advantages_the_loss_uses(tokenizer, prompts, make_policy, make_scorer_model):
    cfg = RLConfig(algo="ppo", **SMALL)  # whiten_advantages=True: over the whole batch, so trace all 16 rollouts
    trace = traces_of(cfg, tokenizer, prompts, make_policy, make_scorer_model, rollouts=16)[-1]
    assert len(trace["rollouts"]) == 16
    advantages = torch.cat([column(r, "advantage") for r in trace["rollouts"]])  # every real token of the batch
    raw = torch.cat([column(r, "return") - column(r, "value") for r in trace["rollouts"]])  # GAE before whitening
    assert_close(advantages, ops.masked_whiten(raw, torch.ones_like(raw, dtype=torch.bool)))


@pytest.mark.parametrize("kl_level,k", [("sequence", 2), ("token", 4)])
def test_rloo_trace_agrees_with_the_ops(kl_level, k, tokenizer, prompts, make_policy, make_scorer_model):
    cfg = RLConfig(algo="rloo", rloo={"rloo_k": k, "kl_level": kl_level}, **SMALL)
    for trace in traces_of(cfg, tokenizer, prompts, make_policy, make_scorer_model):
        rollouts = trace["rollouts"]
        for r in rollouts:
            kl = column(r, "kl")
            assert_close(r["rlhf_reward"], r["score"] - cfg.kl_coef * kl.sum())
            assert_close(r["sequence_reward"], r["rlhf_reward"])  # G_0 at token level: the same total
            siblings = [s["sequence_reward"] for s in rollouts if s["prompt_group"] == r["prompt_group"] and s is not r]
            assert len(siblings) == k - 1, "the traced rollouts hold whole prompt groups"
            assert_close(r["baseline"], sum(siblings) / (k - 1))  # leave-one-out mean
            if kl_level == "sequence":
                assert r["score_position"] is None and "reward" not in r["tokens"][0]
                assert_close(r["advantage"], r["sequence_reward"] - r["baseline"])
            else:
                check_shaped_rewards(r, cfg.kl_coef)
                to_go = column(r, "reward").flip(0).cumsum(0).flip(0)
                assert_close(column(r, "advantage"), to_go - r["baseline"])


def test_trace_schedule():
    assert [u for u in range(1, 46) if trace_due(u, 45, 20)] == [20, 40, 45]
    assert not any(trace_due(u, 45, 0) for u in range(1, 46))


def test_train_stage_hook_writes_json_and_heatmap(tmp_path, tokenizer, prompts, make_policy, make_scorer_model):
    params = Params.model_validate({"train": {**SMALL, "algo": "ppo", "trace_every": 1, "trace_rollouts": 2}})
    out = tmp_path / "trace"
    RLTrainer(params.rl_config(), make_policy(0), FunctionScorer(target_fraction, tokenizer), prompts,
              pad_token_id=0, stop_token_id=1, value_model=make_scorer_model(1),
              on_update=_trace_writer(params, tokenizer, out)).train()
    assert sorted(p.name for p in out.iterdir()) == ["update-0001.json", "update-0001.png", "update-0002.json",
                                                    "update-0002.png"]
    trace = json.loads((out / "update-0002.json").read_text())
    assert trace["update"] == 2 and len(trace["rollouts"]) == 2 and trace["rollouts"][0]["tokens"]
    assert (out / "update-0002.png").read_bytes()[:4] == b"\x89PNG"
    _prune_traces(out, resumed=1)  # a run resumed from update 1 redoes update 2
    assert sorted(p.name for p in out.iterdir()) == ["update-0001.json", "update-0001.png"]
