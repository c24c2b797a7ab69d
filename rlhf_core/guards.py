"""The guard after each update: figures out of bounds stop training before the update is checkpointed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from rlhf_core.checkpoint import list_checkpoints

GUARDED_PREFIXES = ("loss/", "objective/", "policy/", "val/ratio")
"""The figures that stop training when NaN or inf: losses, rewards (objective/scores, objective/rlhf_reward,
objective/kl), gradient norms and the policy ratio."""


class TrainingDiverged(RuntimeError):
    """An update's figures left their bounds (NaN/inf, or a KL above `max_update_kl`). Raised on every process at
    the same update, after it was logged and before it was checkpointed; the message names the update, the figures
    and the newest checkpoint, which stays the newest."""


def out_of_bounds(metrics: Mapping[str, float], max_update_kl: float | None = None) -> dict[str, float]:
    """The figures of one update's (reduced) metrics that stop training."""
    bad = {k: v for k, v in metrics.items()
           if k.startswith(GUARDED_PREFIXES) and isinstance(v, int | float) and not math.isfinite(v)}
    kl = metrics.get("objective/kl")
    if max_update_kl is not None and kl is not None and kl > max_update_kl:
        bad["objective/kl"] = kl
    return bad


def stop_if_out_of_bounds(logs: Mapping[str, float], *, update: int, max_update_kl: float | None,
                          checkpoint_dir: Path | None) -> None:
    """Raise TrainingDiverged after an update whose figures are out of bounds. `logs` were reduced across
    processes, so every process reads the same figures and stops at the same update, with no collective of its own."""
    bad = out_of_bounds(logs, max_update_kl)
    if not bad:
        return
    figures = ", ".join(f"{k} = {v:.6g}" for k, v in sorted(bad.items()))
    bound = (f" (train.max_update_kl = {max_update_kl})"
             if "objective/kl" in bad and math.isfinite(bad["objective/kl"]) else "")
    kept = list_checkpoints(checkpoint_dir) if checkpoint_dir else []
    where = (f"the last good checkpoint, {kept[-1]}, stays the newest" if kept else
             f"no checkpoint in {checkpoint_dir} yet" if checkpoint_dir else "nothing was checkpointed")
    raise TrainingDiverged(f"update {update}: {figures}{bound}; training stopped before checkpointing "
                           f"it ({where}). Lower train.learning_rate or train.max_grad_norm, raise train.kl_coef, "
                           "or check the reward model's scores")
