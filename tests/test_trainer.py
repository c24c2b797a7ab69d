"""The trainer end to end on a tiny model: it learns, it is split-invariant, it resumes exactly."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB, target_fraction
from rlhf_core.checkpoint import list_checkpoints
from rlhf_core.config import RLConfig
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.scoring import FunctionScorer
from rlhf_core.tracking import MemoryTracker


def tiny_config(algo: str, **overrides) -> RLConfig:
    base = dict(algo=algo, total_episodes=32 * 30, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                num_epochs=4 if algo == "ppo" else 1, local_rollout_forward_batch_size=32, response_length=8,
                temperature=1.0, stop_token=None, missing_eos_penalty=None, kl_coef=0.01,
                learning_rate=1e-3 if algo == "ppo" else 3e-3, lr_scheduler="constant", rloo={"rloo_k": 4})
    return RLConfig(**{**base, **overrides})


def make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model, *, policy_seed=0, **kwargs):
    value = make_scorer_model(policy_seed + 1) if cfg.algo == "ppo" else None
    return RLTrainer(cfg, make_policy(policy_seed), FunctionScorer(target_fraction, tokenizer), prompts,
                     pad_token_id=0, stop_token_id=1, value_model=value, **kwargs)


def params(trainer: RLTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.unwrapped.state_dict().items()}


@pytest.mark.parametrize("algo,min_gain", [("ppo", 0.5), ("rloo", 0.3)])
def test_learns_a_learnable_reward(algo, min_gain, tokenizer, prompts, make_policy, make_scorer_model):
    """The target-word fraction starts near 1/16 and must rise clearly within 30 updates."""
    tracker = MemoryTracker()
    trainer = make_trainer(tiny_config(algo), tokenizer, prompts, make_policy, make_scorer_model, tracker=tracker)
    history = trainer.train()
    assert len(history) == 30 and [h["update"] for h in tracker.history] == list(range(1, 31))
    first = sum(h["objective/scores"] for h in history[:3]) / 3
    last = sum(h["objective/scores"] for h in history[-3:]) / 3
    assert first < 0.15, f"the untrained policy should rarely emit {TINY_VOCAB}-way target: {first:.3f}"
    assert last > first + min_gain, f"{algo} did not learn: mean score {first:.3f} -> {last:.3f}"
    assert history[-1]["objective/kl"] > 0.1, "learning must move the policy away from the reference"


def test_runs_are_deterministic(tokenizer, prompts, make_policy, make_scorer_model):
    runs = []
    for _ in range(2):
        trainer = make_trainer(tiny_config("ppo", total_episodes=64), tokenizer, prompts, make_policy,
                               make_scorer_model)
        trainer.train()
        runs.append(params(trainer))
    for name in runs[0]:
        torch.testing.assert_close(runs[0][name], runs[1][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("algo, num_mini_batches", [("ppo", 1), ("rloo", 1), ("ppo", 2), ("rloo", 2)])
def test_micro_batch_split_invariance(algo, num_mini_batches, tokenizer, prompts, make_policy, make_scorer_model):
    """64 episodes as 16 x 4 and as 32 x 2 (micro-batch x accumulation) per optimizer step give the same update;
    with 2 mini-batches (TRL's steps_per_generation = 2 x accumulation: one generation, several steps) too."""
    results = []
    for micro, accumulation in [(16 // num_mini_batches, 4), (32 // num_mini_batches, 2)]:
        cfg = tiny_config(algo, total_episodes=64, per_device_train_batch_size=micro,
                          gradient_accumulation_steps=accumulation, local_rollout_forward_batch_size=64,
                          stop_token="eos", missing_eos_penalty=1.0, num_epochs=2, num_mini_batches=num_mini_batches)
        trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
        before = params(trainer)
        trainer.train()
        results.append(params(trainer))
    moved = sum((results[0][k] - before[k]).abs().sum() for k in before)
    assert moved > 0, "the update must change the parameters"
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=1e-5, atol=1e-6, msg=name)


class CrashAfter(MemoryTracker):
    """Simulates a crash: raises when update `n` is logged (after update n-1 was checkpointed)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def log_metrics(self, metrics, step):
        if step == self.n:
            raise KeyboardInterrupt(f"killed during update {step}")
        super().log_metrics(metrics, step)


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_resume_matches_uninterrupted_run(algo, tmp_path, tokenizer, prompts, make_policy, make_scorer_model):
    cfg = tiny_config(algo, total_episodes=32 * 5, checkpoint_every=1, keep_checkpoints=2)
    straight = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model)
    straight_history = straight.train()

    crashed = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model,
                           tracker=CrashAfter(4), checkpoint_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    saved = list_checkpoints(tmp_path)
    assert [p.name for p in saved] == ["update-000002", "update-000003"], "keeps the 2 newest checkpoints"

    # a fresh process: the same reference (the SFT model a real restart reloads), and trained
    # models initialized differently so that their weights can only come from the checkpoint
    resumed = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model, policy_seed=123,
                           ref_policy=make_policy(0), checkpoint_dir=tmp_path)
    resumed.load_checkpoint(saved[-1])
    assert resumed.state.update == 3 and resumed.state.episode == 3 * 32
    resumed_history = resumed.train()
    assert [h["update"] for h in resumed_history] == [4, 5]

    for name, value in params(straight).items():
        torch.testing.assert_close(params(resumed)[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for key in ("objective/scores", "objective/kl", "loss/policy_avg", "lr"):
        assert resumed_history[-1][key] == pytest.approx(straight_history[-1][key], rel=1e-4, abs=1e-6), key


def test_checkpoint_refuses_a_different_run(tmp_path, tokenizer, prompts, make_policy, make_scorer_model):
    cfg = tiny_config("rloo", total_episodes=32)
    trainer = make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model, checkpoint_dir=tmp_path)
    trainer.train()
    other = make_trainer(tiny_config("rloo", total_episodes=32, seed=1), tokenizer, prompts, make_policy,
                         make_scorer_model)
    with pytest.raises(ValueError, match="seed=0"):
        other.load_checkpoint(list_checkpoints(tmp_path)[-1])
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        other.load_checkpoint(tmp_path)


def test_interrupted_save_is_never_listed(tmp_path):
    (tmp_path / "update-000001").mkdir()
    (tmp_path / "update-000002.tmp").mkdir()  # a save that crashed before its rename
    assert [p.name for p in list_checkpoints(tmp_path)] == ["update-000001"]


def test_ppo_needs_a_value_model(tokenizer, prompts, make_policy):
    with pytest.raises(ValueError, match="value_model"):
        RLTrainer(tiny_config("ppo"), make_policy(), FunctionScorer(target_fraction, tokenizer), prompts,
                  pad_token_id=0, stop_token_id=1)
