"""The tracker interface the trainer logs through, so the loop never branches on whether logging is on.

`rlhf_core` knows only this protocol; the MLflow implementation lives with the pipeline stages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...


class NullTracker:
    """Logs nothing (nanochat's DummyWandb)."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        pass


class JsonlTracker(NullTracker):
    """Appends one JSON line per `log_metrics` call: `{"step": ..., **metrics}` (DVC plots read it)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


class MemoryTracker(NullTracker):
    """Keeps every logged metric in memory; handy in tests and notebooks."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.history: list[dict[str, float]] = []

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.params.update(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.history.append({"step": step, **metrics})


class FanOutTracker(NullTracker):
    """Hands every call to several trackers (say a JSONL history and an MLflow run)."""

    def __init__(self, *trackers: Tracker):
        self.trackers = trackers

    def log_params(self, params: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.log_params(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        for t in self.trackers:
            t.log_artifact(path, artifact_path)
