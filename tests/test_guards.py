"""The NaN/inf guard of RL training: the stage stops at the first non-finite loss, reward or gradient norm,
naming the update and the quantity, before that update is checkpointed."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from rlhf_core.tracking import NullTracker
from tasks.common.guards import NonFiniteGuard, NonFiniteTraining, non_finite

TINY_TRAIN = ["train.total_episodes=64", "train.response_length=8", "train.checkpoint_every=1",
              "train.trace_every=0", "prepare.max_prompt_tokens=16"]


def test_the_guard_names_the_update_and_the_quantity(tmp_path):
    found = non_finite({"loss/policy_avg": 0.1, "objective/scores": float("nan"), "time/update_s": float("inf"),
                        "policy/grad_norm": float("inf")})
    assert sorted(found) == ["objective/scores", "policy/grad_norm"], found
    logged = []

    class Recorder(NullTracker):
        def log_metrics(self, metrics, step):
            logged.append(step)

    guard = NonFiniteGuard(Recorder(), tmp_path, lambda: tmp_path / "update-000002")
    guard.log_metrics({"loss/policy_avg": 0.5}, 2)
    with pytest.raises(NonFiniteTraining, match=r"update 3: loss/policy_avg = nan; training stopped before "
                                                r"checkpointing it \(the last good checkpoint, .*update-000002, stays\)"):
        guard.log_metrics({"loss/policy_avg": float("nan")}, 3)
    assert logged == [2, 3], "the bad update is still logged"


def test_a_nan_reward_stops_the_train_stage_before_any_checkpoint(workspace, make_policy, make_scorer_model,
                                                                     tokenizer):
    reward = make_scorer_model()
    with torch.no_grad():
        reward.score.weight.fill_(float("nan"))
    for name, model in (("sft", make_policy()), ("reward", reward)):
        model.save_pretrained(workspace / "models" / name)
        tokenizer.save_pretrained(workspace / "models" / name)
    (workspace / "data").mkdir()
    (workspace / "data" / "prompts_train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"w{2 + i % 12} w{3 + i % 11}"}) + "\n" for i in range(64)))
    result = CliRunner().invoke(app, ["stage", "train", *[x for o in TINY_TRAIN for x in ("--set", o)]])
    assert result.exit_code == 1, result.output
    assert "update 1: " in result.output and "objective/scores = nan" in result.output, result.output
    assert "no checkpoint in" in result.output and "Traceback" not in result.output
    assert not list((workspace / "checkpoints" / "train").glob("update-*")), "nothing non-finite was checkpointed"
    assert not (workspace / "models" / "policy").exists()
