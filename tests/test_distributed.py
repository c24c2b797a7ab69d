"""1 process vs 2 processes (a real gloo world under torchrun) give the same update."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("distributed_update.py")


def run(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parent.parent)}
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("algo, mini_batches", [pytest.param("ppo", "1", marks=pytest.mark.slow),
                                                 pytest.param("rloo", "1", marks=pytest.mark.slow),
                                                 pytest.param("rloo", "2", marks=pytest.mark.slow), ("grpo", "2")])
def test_two_processes_match_one(algo, mini_batches, tmp_path):
    """With 2 mini-batches, one generation feeds two optimizer steps per epoch (TRL's steps_per_generation). GRPO:
    the batch-wide std (scale_rewards batch) and dapo's token mean over each optimizer step are global."""
    run([sys.executable, str(SCRIPT), algo, "one.pt", mini_batches], tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run([*torchrun, str(SCRIPT), algo, "two.pt", mini_batches], tmp_path)
    one, two = (torch.load(tmp_path / f, weights_only=True) for f in ("one.pt", "two.pt"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
