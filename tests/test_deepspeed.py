"""DeepSpeed ZeRO-2 and ZeRO-3 through accelerate on the CPU (DS_ACCELERATOR=cpu): the real train stage with the
infra/accelerate configs, checked for the engine and process count that really ran."""

from __future__ import annotations

import json
import shutil
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
    metrics = json.loads((root / "metrics" / "train.json").read_text())
    return metrics, load_file(root / "models" / "policy" / "model.safetensors")


@pytest.mark.slow
def test_zero2_and_zero3_update_as_the_plain_stage_does(workspace):
    roots = prepared(workspace, ["plain", "zero2", "zero3"])
    plain_metrics, plain = trained(roots["plain"], LAYOUTS[1])
    assert plain_metrics["distributed_type"] == "NO"
    for stage in (2, 3):
        config = CONFIGS / f"deepspeed_zero{stage}.yaml"
        metrics, policy = trained(roots[f"zero{stage}"], [*LAYOUTS[1], f"runtime.accelerate_config={config}"])
        assert metrics["distributed_type"] == "DEEPSPEED" and metrics["num_processes"] == 1, metrics
        assert metrics["objective/scores"] == pytest.approx(plain_metrics["objective/scores"], abs=1e-5)
        for name, tensor in plain.items():
            torch.testing.assert_close(policy[name], tensor, rtol=1e-4, atol=1e-5, msg=f"zero{stage} {name}")


@pytest.mark.slow
def test_zero3_on_two_processes_gathers_the_policy_once_per_rollout(workspace):
    """Each rank holds a shard: the policy is gathered once per rollout, so generation makes no per-token
    collective a rank that stopped early would leave waiting; the saved policy is whole (gathered)."""
    roots = prepared(workspace, ["zero3"])
    sft = load_file(workspace / "models" / "sft" / "model.safetensors")
    config = CONFIGS / "deepspeed_zero3.yaml"
    metrics, policy = trained(roots["zero3"], [*LAYOUTS[2], f"runtime.accelerate_config={config}"])
    assert metrics["distributed_type"] == "DEEPSPEED" and metrics["num_processes"] == 2, metrics
    assert {k: v.shape for k, v in policy.items()} == {k: v.shape for k, v in sft.items()}
    assert any(not torch.equal(policy[k], sft[k]) for k in sft), "the policy was trained"
