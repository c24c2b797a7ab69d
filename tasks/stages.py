"""The pipeline's stages by name, in order; `rlhf stage NAME` and dvc.yaml call them through here."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from pathlib import Path

from tasks.mlflow_tracking import track_stage
from tasks.params import load_params
from tasks.paths import Paths

STAGES = {  # name -> module with `run(params, paths) -> dict`
    "prepare": "tasks.prepare",
    "validate": "tasks.validate",
    "sft": "tasks.sft",
    "reward-model": "tasks.reward_model",
    "inspect": "tasks.inspect_rm",
    "train": "tasks.train",
    "evaluate": "tasks.evaluate",
    "register": "tasks.register",
}


def run_stage(name: str, root: str | Path = ".", profile: str | None = None, overrides: Sequence[str] = ()) -> dict:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    params = load_params(root, profile, list(overrides))
    module = importlib.import_module(STAGES[name])

    def work() -> dict:
        start = time.perf_counter()
        metrics = module.run(params, Paths.at(root))
        return {**metrics, "stage_seconds": time.perf_counter() - start}

    return track_stage(name, root, params, work)  # an MLflow run per stage, unless RLHF_TRACKING=off
