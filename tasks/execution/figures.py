"""Figures of a stage's execution rather than of its result: wall-clock seconds, episodes/s, peak GPU memory,
the update a run resumed from.

They change with every run and machine, so they stay out of everything DVC tracks (`metrics/`, the train
history, `dvc.lock`): an unchanged rerun then gives the same bytes. The user still sees them: `rlhf stage`
prints them, the stage's MLflow run logs them (per update for train), and `reports/execution/` keeps the last
run's (git-ignored and no DVC output): `<stage>.json` per stage and train's per-update log `train_log.jsonl`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_core.jsonio import write_json
from tasks.parameters.paths import Paths

EXECUTION_KEYS = frozenset({"eps", "train_seconds", "stage_seconds", "resumed_from_update", "threads",
                            "weight_gathers",  # ZeRO-3's gathers in this process: a resumed run counts fewer
                            "ray"})  # a Ray launch: the cluster and where each rank ran
EXECUTION_PREFIXES = ("time/", "gpu/")


def is_execution_figure(key: str) -> bool:
    return key in EXECUTION_KEYS or key.startswith(EXECUTION_PREFIXES)


def results(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What DVC tracks: the figures of the result, the same for the same inputs on the same runtime."""
    return {k: v for k, v in metrics.items() if not is_execution_figure(k)}


def execution_figures(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if is_execution_figure(k)}


def write_execution(paths: Paths, stage: str, metrics: Mapping[str, Any]) -> None:
    """reports/execution/<stage>.json: the execution figures of the stage's last run."""
    write_json(paths.execution_file(stage), execution_figures(metrics))
