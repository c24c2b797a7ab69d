"""`bench/gpu_check.sh --cpu-dry-run`: the GPU check's every part (the decode loop against generate, the side-by-side
against TRL 1.9.0 and 1.16.0, the gpu-marked tests, the DeepSpeed launches, the whole pipeline) at tiny shapes on the CPU, so
the one GPU call can fail only for a reason that needs a GPU to show. `make test-gpu-check` runs it (not `make test`:
it is the GPU suite's rehearsal, ~3 min of both cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.gpu_check  # make test-gpu-check: before the GPU call, not in make test
@pytest.mark.timeout(1600)  # the dry run's deadline is 1500 s (bench/gpu_check.sh)
def test_the_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu-dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + log[-6000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["environment"]["device"].startswith("cpu")
    assert [(p["part"], p["exit"]) for p in report["parts"]] == [
        ("env", 0), ("decode", 0), ("vs_trl", 0), ("gpu_tests", 0), ("pipeline", 0)]
    decode = report["decode"]  # timed beside generate, and its agreement recorded in both dtypes
    assert decode["shapes"] == "dry-run" and decode["ppo"]["decode_median_ms"] > 0 < decode["rloo"]["speedup_decode"]
    assert decode["ppo"]["agreement"]["float32"]["decode"]["same_arithmetic_identical"]
    for case in ("ppo", "rloo"):
        for dtype in ("float32", "bfloat16"):
            assert all(a["within_tolerance"] for a in decode[case]["agreement"][dtype].values()), (case, dtype)
    # every side ran and was timed: ours with decode_graphs off and auto, TRL 1.9.0 (PPO, RLOO) and 1.16.0 (RLOO, GRPO)
    assert {(r["algo"], r["side"]) for r in report["vs_trl_runs"]} == {
        ("ppo", "ours"), ("ppo", "ours_graphs"), ("ppo", "trl"),
        ("rloo", "ours"), ("rloo", "ours_graphs"), ("rloo", "trl"), ("rloo", "trl116"),
        ("grpo", "ours"), ("grpo", "ours_graphs"), ("grpo", "trl116")}
    assert not report["vs_trl_failed"]
    assert {r["version"] for r in report["vs_trl_runs"] if r["side"].startswith("trl")} == {"trl 1.9.0", "trl 1.16.0"}
    for algo, peer in (("ppo", "trl"), ("rloo", "trl"), ("grpo", "trl116")):
        row = report["vs_trl"][algo]
        assert all(row[side]["episodes_per_s"] > 0 for side in ("ours", "ours_graphs", peer))
        assert set(row["ours"]["phases_s"]) >= {"rollout", "score", "update"}
    outcomes = report["gpu_test_outcomes"]
    assert len(outcomes) == 8 and set(outcomes.values()) == {"passed"}, outcomes
    ran = {(t["test"], t["algo"], t["variant"]) for t in report["gpu_tests"]}
    assert ran == {(test, algo, variant) for algo in ("ppo", "rloo")
                   for test, variant in (("in_process", "full"), ("in_process", "lora"),
                                         ("deepspeed", "zero2"), ("deepspeed", "zero3"))}
    pipeline = report["pipeline"]
    assert pipeline["ok"] and list(pipeline["stages"]) == [
        "prepare", "validate", "sft", "reward-model", "inspect", "train", "evaluate", "register"]
    assert pipeline["metrics"]["train"]["update"] == 2 and pipeline["metrics"]["eval"]["mean_kl"] >= 0
    # every target was computed from figures (whether a tiny CPU run meets the GPU targets says nothing); the CPU
    # has no CUDA graphs to time
    assert all(t["value"] is not None for name, t in report["targets"].items() if name != "decode_graphs_x_eager"), \
        report["targets"]
    assert report["targets"]["approxkl_lr0_bf16_max"]["holds"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {algo} |" in markdown for algo in ("ppo", "rloo", "grpo")) and "all stages passed" in markdown
