"""The guards of RL training (in RLTrainer, on by default): training stops at the first update with a NaN/inf loss,
reward, gradient norm or ratio, or a KL above `train.max_update_kl`, naming the update and the figure, before that
update is checkpointed; the train stage keeps the message. On 2 ranks both stop at the same update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer, tiny_config
from typer.testing import CliRunner

from cli.main import app
from rlhf_core.checkpoint import list_checkpoints
from rlhf_core.guards import TrainingDiverged, out_of_bounds
from rlhf_core.tracking import NullTracker

TINY_TRAIN = ["train.total_episodes=64", "train.response_length=8", "train.checkpoint_every=1",
              "train.trace_every=0", "prepare.max_prompt_tokens=16"]


def test_the_bounds_name_each_figure_out_of_them():
    figures = {"loss/policy_avg": 0.1, "objective/scores": float("nan"), "time/update_s": float("inf"),
               "policy/grad_norm": float("inf"), "objective/kl": 3.0}
    assert sorted(out_of_bounds(figures)) == ["objective/scores", "policy/grad_norm"], "timings are not guarded"
    assert out_of_bounds(figures, max_update_kl=2.5)["objective/kl"] == 3.0
    assert "objective/kl" not in out_of_bounds(figures, max_update_kl=3.0), "a bound is inclusive"


def test_the_trainer_stops_at_the_update_whose_kl_exceeds_the_bound_before_checkpointing_it(
        tmp_path, tokenizer, prompts, make_policy, make_scorer_model):
    """`train.max_update_kl`: the update that crosses it is logged, not checkpointed, and the error names the update,
    the KL, the bound and the newest checkpoint, which stays the newest; the updates before it were kept."""
    logged = []

    class Recorder(NullTracker):
        def log_metrics(self, metrics, step):
            logged.append((step, metrics["objective/kl"]))

    def trainer(**bound):
        cfg = tiny_config("rloo", total_episodes=32 * 4, learning_rate=3e-2, checkpoint_every=1, **bound)
        return make_trainer(cfg, tokenizer, prompts, make_policy, make_scorer_model, tracker=Recorder(),
                            checkpoint_dir=tmp_path / ("bounded" if bound else "free"))

    kls = [row["objective/kl"] for row in trainer().train(max_updates=3)]
    assert kls[0] < kls[2], f"a high learning rate drifts from the reference: {kls}"
    bound = (kls[0] + kls[2]) / 2  # crossed at the second or third update, after a checkpoint
    crossing = next(i for i, kl in enumerate(kls) if kl > bound) + 1
    logged.clear()
    with pytest.raises(TrainingDiverged, match=rf"update {crossing}: objective/kl = [0-9.]+ \(train.max_update_kl = "
                                               rf"{bound}\); training stopped before checkpointing it \(the last "
                                               r"good checkpoint, .*, stays the newest\)"):
        trainer(max_update_kl=bound).train()
    assert [step for step, _ in logged] == list(range(1, crossing + 1)), "the crossing update is logged too"
    saved = [p.name for p in list_checkpoints(tmp_path / "bounded")]
    assert saved == [f"update-{u:06d}" for u in range(1, crossing)], saved


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


def test_two_ranks_stop_at_the_same_update_when_only_one_sees_the_nan(tmp_path):
    """2 CPU ranks under torchrun (tests/distributed_diverge.py): only rank 1's reward is NaN, at update 3. The guard
    reads the figures reduced across ranks, so both stop at update 3 with the same message, which names rank 1's NaN
    reward and the newest good checkpoint (update 2); update 3 is never checkpointed; both meet at a final barrier."""
    script = Path(__file__).with_name("distributed_diverge.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parent.parent)}
    proc = subprocess.run([*torchrun, str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["num_processes"] for r in ranks] == [2, 2], ranks
    assert [r["update"] for r in ranks] == [3, 3], f"both ranks stop at the update that diverged: {ranks}"
    first, second = (r["error"] for r in ranks)
    assert first is not None and first == second, f"the same stop on both ranks:\n{first}\n{second}"
    newest = tmp_path / "checkpoints" / "update-000002"
    assert first.startswith("update 3: ") and "objective/scores = nan" in first, first
    assert f"training stopped before checkpointing it (the last good checkpoint, {newest}, stays the newest)" in first
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["update-000001", "update-000002"], f"no checkpoint (nor a partial one) of update 3: {saved}"
