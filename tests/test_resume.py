"""kill -9 of `rlhf stage train` after its first checkpoint, then the same command again: it resumes (not
restarts) and ends with the policy of an uninterrupted run. The real CLI in subprocesses, a real SIGKILL."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# a real kill -9 of the stage process, and a sitecustomize it imports at start: never the warm stage server
pytestmark = pytest.mark.usefixtures("plain_stages")

BIN = Path(sys.executable).parent
SETTINGS = ["train.total_episodes=384", "train.response_length=16", "train.checkpoint_every=1",
            "train.trace_every=0", "prepare.max_prompt_tokens=16"]  # 6 updates of 64 episodes
STARTUP_S = 300  # a bound on waiting, not a timing assertion


def train_command(extra: list[str] = ()) -> list[str]:
    return [str(BIN / "rlhf"), "stage", "train", *[x for item in [*SETTINGS, *extra] for x in ("--set", item)]]


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


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "RLHF_TRACKING": "off", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra}


# GRPO at TRL's beta 0 (no reference model), on one fixed thread count: torch's reductions then add in one order in
# both runs, so the resumed policy must be bit-identical (the thread count otherwise follows the machine's load)
ALGOS = {"ppo": ([], {}, 1e-5), "grpo": (["train.algo=grpo", "train.kl_coef=0"], {"RLHF_THREADS": "1"}, 0.0)}


def checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in (root / "checkpoints" / "train").glob("update-*") if not p.name.endswith(".tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(ALGOS))
def test_sigkill_after_a_checkpoint_then_rerun_resumes_to_the_same_policy(tmp_path, make_policy,
                                                                         make_scorer_model, tokenizer, algo):
    settings, extra_env, tolerance = ALGOS[algo]
    whole = make_workspace(tmp_path / "whole", make_policy, make_scorer_model, tokenizer)
    killed = make_workspace(tmp_path / "killed", make_policy, make_scorer_model, tokenizer)
    subprocess.run(train_command(settings), cwd=whole, env=env(**extra_env), check=True, capture_output=True,
                   timeout=600)

    proc = subprocess.Popen(train_command(settings), cwd=killed, env=env(**extra_env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + STARTUP_S
    while not checkpoints(killed):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and not (killed / "metrics" / "train.json").exists(), \
        "killed before it finished"

    rerun = subprocess.run(train_command(settings), cwd=killed, env=env(**extra_env), capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    metrics = json.loads((killed / "metrics" / "train.json").read_text())
    execution = json.loads((killed / "reports" / "execution" / "train.json").read_text())
    assert execution["resumed_from_update"] >= 1 and metrics["update"] == 6, (metrics, execution)
    assert ("objective/kl" in metrics) == (algo == "ppo"), "GRPO at beta 0 trains with no reference: no KL"
    resumed, reference = (load_file(root / "models" / "policy" / "model.safetensors") for root in (killed, whole))
    assert resumed.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(resumed[name], value, rtol=tolerance, atol=tolerance / 10, msg=name)


def _disk_of(size_bytes: int, where: Path) -> bool:
    """A tmpfs of `size_bytes` mounted at `where` (a size-limited file system); False where the machine allows
    none (not root, no mount permission)."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


# Where no file system can be size-limited: the disk fills at the second checkpoint's first safetensors write
ENOSPC_AT_SECOND_SAVE = """import errno, safetensors.torch as st
_save = st.save_file
def save_file(tensors, filename, *args, **kwargs):
    if "update-000002" in str(filename):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return _save(tensors, filename, *args, **kwargs)
st.save_file = save_file
"""


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_the_rerun_resumes(tmp_path, make_policy,
                                                                                 make_scorer_model, tokenizer):
    """The disk fills while the second checkpoint is written: the stage fails naming the checkpoint it could not
    save and the one it kept; that one is whole, nothing half-written is left, and once there is room again the
    same command resumes from it to the policy of a run that never ran out."""
    whole = make_workspace(tmp_path / "whole", make_policy, make_scorer_model, tokenizer)
    full = make_workspace(tmp_path / "full", make_policy, make_scorer_model, tokenizer)
    subprocess.run(train_command(), cwd=whole, env=env(), check=True, capture_output=True, timeout=600)
    one = sum(f.stat().st_size for f in checkpoints(whole)[-1].rglob("*") if f.is_file())
    disk = full / "checkpoints"
    limited = _disk_of(int(one * 1.5), disk)  # room for one checkpoint, not for the next beside it
    run_env = env()
    if not limited:
        (tmp_path / "inject").mkdir()
        (tmp_path / "inject" / "sitecustomize.py").write_text(ENOSPC_AT_SECOND_SAVE)
        run_env["PYTHONPATH"] = str(tmp_path / "inject")
    try:
        failed = subprocess.run(train_command(), cwd=full, env=run_env, capture_output=True, text=True, timeout=600)
        assert failed.returncode == 1, failed.stderr[-3000:]
        assert "error: checkpoint update-000002 not saved in" in failed.stderr, failed.stderr[-3000:]
        assert "the previous one, update-000001, is kept: free space and run again" in failed.stderr, \
            failed.stderr[-3000:]
        if limited:  # torch.save on a full tmpfs says only "unexpected pos": the message gives the space left
            free = float(re.search(r"([\d.]+) MiB were free on its disk", failed.stderr).group(1))
            assert free * 2**20 < one / 2, failed.stderr[-3000:]
        else:
            assert "No space left on device (injected)" in failed.stderr, failed.stderr[-3000:]
        assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
        assert [p.name for p in (disk / "train").glob("update-*")] == ["update-000001"], "nothing half-written"
        kept = checkpoints(full)[-1]
        assert json.loads((kept / "trainer_state.json").read_text())["trainer"]["update"] == 1
        reference = checkpoints(whole)  # the whole run keeps its newest: compare the kept one's files by name
        assert sorted(p.name for p in kept.iterdir()) == sorted(p.name for p in reference[-1].iterdir())
    finally:
        if limited:
            moved = tmp_path / "kept-checkpoints"
            shutil.copytree(disk, moved)  # room again: the checkpoints move back onto the ordinary disk
            subprocess.run(["umount", str(disk)], check=True)
            shutil.rmtree(disk)
            shutil.copytree(moved, disk)
    rerun = subprocess.run(train_command(), cwd=full, env=env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    execution = json.loads((full / "reports" / "execution" / "train.json").read_text())
    assert execution["resumed_from_update"] == 1, execution
    resumed, reference = (load_file(root / "models" / "policy" / "model.safetensors") for root in (full, whole))
    for name, value in reference.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
