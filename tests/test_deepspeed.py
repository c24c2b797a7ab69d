"""DeepSpeed ZeRO-2 and ZeRO-3 through accelerate on the CPU (DS_ACCELERATOR=cpu): the real train stage with the
infra/accelerate configs, checked for the engine and process count that really ran; gradient clipping as configured;
a 2-rank ZeRO-3 rollout's collectives and forwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_launcher import LAYOUTS, stage_train
from test_pipeline import TINY, invoke

CONFIGS = Path(__file__).resolve().parent.parent / "infra" / "accelerate"


def prepared(workspace: Path, copies: list[str]) -> dict[str, Path]:
    """The workspace after every stage before train, and copies of it (one per run to compare)."""
    for name in ("prepare", "validate", "sft", "reward-model", "inspect"):
        invoke("stage", name, *[x for item in TINY for x in ("--set", item)])
    roots = {}
    for copy in copies:
        roots[copy] = workspace.parent / f"{workspace.name}-{copy}"
        shutil.copytree(workspace, roots[copy])
    return roots


def trained(root: Path, overrides: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    proc = stage_train(root, overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = {**json.loads((root / "metrics" / "train.json").read_text()),  # the results and, below, the execution
               **json.loads((root / "reports" / "execution" / "train.json").read_text())}
    return metrics, load_file(root / "models" / "policy" / "model.safetensors")


@pytest.mark.slow
def test_zero2_and_zero3_update_as_the_plain_stage_does_and_clip_as_configured(workspace):
    """The same update as the plain stage, with train.max_grad_norm reaching DeepSpeed's own clipping: 0.01 under
    ZeRO-2 is the plain 0.01 (accelerate alone would have filled 1.0), and 0.01 is not 1.0."""
    roots = prepared(workspace, ["plain", "plain-clip", "zero2", "zero3"])
    plain_metrics, plain = trained(roots["plain"], LAYOUTS[1])
    assert plain_metrics["distributed_type"] == "NO"
    clip = ["train.max_grad_norm=0.01"]
    _, plain_clipped = trained(roots["plain-clip"], [*LAYOUTS[1], *clip])
    assert any(not torch.allclose(plain_clipped[k], plain[k], rtol=1e-4, atol=1e-5) for k in plain), \
        "max_grad_norm 0.01 clips this update: it differs from 1.0's"
    for stage, reference, extra in ((2, plain_clipped, clip), (3, plain, [])):
        config = f"infra/accelerate/deepspeed_zero{stage}.yaml"  # the workspace's copy (tests/conftest.py)
        metrics, policy = trained(roots[f"zero{stage}"], [*LAYOUTS[1], *extra, f"runtime.accelerate_config={config}"])
        assert metrics["distributed_type"] == "DEEPSPEED" and metrics["num_processes"] == 1, metrics
        for name, tensor in reference.items():
            torch.testing.assert_close(policy[name], tensor, rtol=1e-4, atol=1e-5, msg=f"zero{stage} {name}")


@pytest.mark.slow
def test_zero3_on_two_processes_gathers_the_policy_once_per_rollout(workspace):
    """Each rank holds a shard: the policy is gathered once per rollout (counted: one gather per update), so
    generation makes no per-token collective a rank that stopped early would leave waiting; the update is the
    plain 2-process run's (torchrun, gloo) on the same global batches, and the saved policy is whole."""
    roots = prepared(workspace, ["zero3", "ddp"])
    sft = load_file(workspace / "models" / "sft" / "model.safetensors")
    ddp_metrics, ddp = trained(roots["ddp"], LAYOUTS[2])
    assert ddp_metrics["distributed_type"] == "MULTI_CPU" and ddp_metrics["weight_gathers"] == 0, ddp_metrics
    config = "infra/accelerate/deepspeed_zero3.yaml"
    metrics, policy = trained(roots["zero3"], [*LAYOUTS[2], f"runtime.accelerate_config={config}"])
    assert metrics["distributed_type"] == "DEEPSPEED" and metrics["num_processes"] == 2, metrics
    assert metrics["weight_gathers"] == metrics["update"] == 2, "one gather per rollout"
    assert {k: v.shape for k, v in policy.items()} == {k: v.shape for k, v in sft.items()}
    assert any(not torch.equal(policy[k], sft[k]) for k in sft), "the policy was trained"
    for name, weight in ddp.items():
        torch.testing.assert_close(policy[name], weight, rtol=1e-4, atol=1e-5, msg=name)


SCRIPT = Path(__file__).with_name("zero3_rollout.py")


def run_group(command: list[str], cwd: Path, timeout: int) -> None:
    """Run `command` in its own process group; past `timeout` (a hang: ranks waiting on each other), kill every
    process of it and fail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(SCRIPT.parent.parent)}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{command[-2]} did not finish in {timeout} s (ranks waiting on each other):\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_zero3_ranks_run_equal_forwards_and_no_collective_per_token(tmp_path):
    """2 ranks under ZeRO-3, the reference and reward model sharded: rank 0's rollout chunk shares a prompt and rank
    1's does not, yet the step finishes and updates as 1 process does; the collectives of a rollout do not grow
    with the response length (the policy is gathered once, generation makes none per token); on the gathered policy
    the decode loop draws what transformers' generate draws."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "deepspeed_zero3.yaml"),
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    run_group([*launch, str(SCRIPT), "two"], tmp_path, timeout=300)
    run_group([sys.executable, str(SCRIPT), "one"], tmp_path, timeout=300)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"two.{rank}.json").read_text())
        assert report["distributed_type"] == "DEEPSPEED", report
        counts = report["collectives"]
        assert counts["3"] == counts["9"] > 0, f"rank {rank}: collectives per rollout of 3 and 9 tokens: {counts}"
        assert report["decode_equals_generate"], f"rank {rank}: the decode loop on the gathered policy left generate"
    one, two = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("one", "two"))
    assert one.keys() == two.keys() and any(k.startswith("ref.") for k in one)
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
