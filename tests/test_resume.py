"""kill -9 of `rlhf stage train` after its first checkpoint, then the same command again: it resumes (not
restarts) and ends with the policy of an uninterrupted run. The real CLI in subprocesses, a real SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BIN = Path(sys.executable).parent
SETTINGS = ["train.total_episodes=384", "train.response_length=16", "train.checkpoint_every=1",
            "train.trace_every=0", "prepare.max_prompt_tokens=16"]  # 6 updates of 64 episodes
STARTUP_S = 300  # a bound on waiting, not a timing assertion


def train_command() -> list[str]:
    return [str(BIN / "rlhf"), "stage", "train", *[x for item in SETTINGS for x in ("--set", item)]]


def make_workspace(root: Path, make_policy, make_scorer_model, tokenizer) -> Path:
    root.mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "params.yaml", root / "params.yaml")
    shutil.copytree(Path(__file__).resolve().parent.parent / "infra" / "accelerate", root / "infra" / "accelerate")
    for name, model in (("sft", make_policy()), ("reward", make_scorer_model())):
        model.save_pretrained(root / "models" / name)
        tokenizer.save_pretrained(root / "models" / name)
    (root / "data").mkdir()
    (root / "data" / "prompts_train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"w{2 + i % 12} w{3 + i % 11} w{4 + i % 9}"}) + "\n" for i in range(128)))
    return root


def env() -> dict[str, str]:
    return {**os.environ, "RLHF_TRACKING": "off", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in (root / "checkpoints" / "train").glob("update-*") if not p.name.endswith(".tmp"))


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_rerun_resumes_to_the_same_policy(tmp_path, make_policy,
                                                                         make_scorer_model, tokenizer):
    whole = make_workspace(tmp_path / "whole", make_policy, make_scorer_model, tokenizer)
    killed = make_workspace(tmp_path / "killed", make_policy, make_scorer_model, tokenizer)
    subprocess.run(train_command(), cwd=whole, env=env(), check=True, capture_output=True, timeout=600)

    proc = subprocess.Popen(train_command(), cwd=killed, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + STARTUP_S
    while not checkpoints(killed):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and not (killed / "metrics" / "train.json").exists(), \
        "killed before it finished"

    rerun = subprocess.run(train_command(), cwd=killed, env=env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    metrics = json.loads((killed / "metrics" / "train.json").read_text())
    execution = json.loads((killed / "reports" / "execution" / "train.json").read_text())
    assert execution["resumed_from_update"] >= 1 and metrics["update"] == 6, (metrics, execution)
    resumed, reference = (load_file(root / "models" / "policy" / "model.safetensors") for root in (killed, whole))
    assert resumed.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
