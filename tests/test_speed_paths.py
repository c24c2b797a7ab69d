"""The trainer's fast paths against the plain computations they replace: the same update to rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from test_trainer import make_trainer, params, tiny_config

from rlhf_core.metrics import MetricAccumulator


@pytest.mark.parametrize("algo", ["ppo", "rloo", "grpo"])
def test_fused_and_plain_log_probs_give_the_same_update(algo, tokenizer, prompts, make_policy, make_scorer_model):
    """Each algorithm trains on the fused log-prob and entropy pass (`ops.token_logprobs_and_entropy`); the plain
    one (`selective_log_softmax` and `entropy_from_logits` of the joined, scaled logits) gives the same update and
    logged statistics to rounding, from the same weights on the same batch (EOS on: padded responses)."""
    overrides = {"grpo": {"num_generations": 4, "kl_coef": 0.05}}.get(algo, {})
    cfg = tiny_config(algo, total_episodes=64, per_device_train_batch_size=16, stop_token="eos",
                      missing_eos_penalty=1.0, num_epochs=2, **overrides)
    trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    assert trainer.unwrapped.fused_logprobs, f"{algo} must train on the fused pass"
    batch = trainer.rollout(trainer.sampler.next_indices())
    batch, _ = trainer.compute_advantages(trainer.score(batch))
    states = [trainer.model, trainer.optimizer, trainer.scheduler]
    start = [copy.deepcopy(state.state_dict()) for state in states]
    before, results = params(trainer), {}
    for fused in (True, False):
        for state, saved in zip(states, start, strict=True):
            state.load_state_dict(saved)
        trainer.unwrapped.fused_logprobs = fused
        metrics = MetricAccumulator()
        trainer.optimize(batch, metrics)
        results[fused] = params(trainer), metrics.reduce(trainer.accelerator)
    (fused_weights, fused_logs), (plain_weights, plain_logs) = results[True], results[False]
    assert sum((fused_weights[k] - before[k]).abs().sum() for k in before) > 0, "the update must move the weights"
    for name, value in plain_weights.items():
        torch.testing.assert_close(fused_weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert fused_logs.keys() == plain_logs.keys() and "policy/entropy_avg" in fused_logs
    for key, value in plain_logs.items():  # a clipped fraction counts tokens: one at a bound may flip by rounding
        flips = 0.02 if "clip" in key else 1e-6
        assert fused_logs[key] == pytest.approx(value, rel=1e-4, abs=flips), key
