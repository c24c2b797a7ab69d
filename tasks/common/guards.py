"""Stop RL training at the first NaN or inf loss, reward or gradient norm, naming the update and the quantity.

A tracker wrapper rather than a change to the trainer: the trainer logs an update's metrics before it
checkpoints that update, so raising here leaves the last good checkpoint as the newest one, and a NaN
never reaches a checkpoint, the policy or a later update (where it would surface as a sampling error).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_core.tracking import NullTracker, Tracker
from tasks.common.errors import StageFailed

# losses, rewards (objective/scores, objective/rlhf_reward, objective/kl), gradient norms and PPO's ratio
GUARDED_PREFIXES = ("loss/", "objective/", "policy/", "val/ratio")


class NonFiniteTraining(StageFailed, RuntimeError):
    """A guarded training figure became NaN or inf; the message names the update and the quantities."""


def non_finite(metrics: Mapping[str, float]) -> dict[str, float]:
    """The guarded figures of one update that are NaN or inf."""
    return {k: v for k, v in metrics.items()
            if k.startswith(GUARDED_PREFIXES) and isinstance(v, int | float) and not math.isfinite(v)}


class NonFiniteGuard(NullTracker):
    """Hands each update's metrics on (so the NaN is logged too), then raises NonFiniteTraining on a NaN/inf."""

    def __init__(self, inner: Tracker, checkpoints: Path, newest_checkpoint):
        self.inner, self.checkpoints, self.newest_checkpoint = inner, checkpoints, newest_checkpoint

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.inner.log_params(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)
        bad = non_finite(metrics)
        if bad:
            newest = self.newest_checkpoint()
            kept = f"the last good checkpoint, {newest}, stays" if newest else f"no checkpoint in {self.checkpoints} yet"
            raise NonFiniteTraining(f"update {step}: {', '.join(f'{k} = {v}' for k, v in sorted(bad.items()))}; "
                                    f"training stopped before checkpointing it ({kept}). Lower train.learning_rate or "
                                    "train.max_grad_norm, or check the reward model's scores")

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.inner.log_artifact(path, artifact_path)
