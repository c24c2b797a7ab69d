"""Where each stage reads and writes, relative to the workspace root (what dvc.yaml declares)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPLITS = ("sft_train", "sft_eval", "prefs_train", "prefs_eval", "prompts_train", "prompts_eval")


@dataclass(frozen=True)
class Paths:
    root: Path

    @classmethod
    def at(cls, root: str | Path = ".") -> Paths:
        return cls(Path(root).resolve())

    @property
    def data(self) -> Path:
        return self.root / "data"

    def split(self, name: str) -> Path:
        assert name in SPLITS, f"unknown split {name!r}; expected one of {SPLITS}"
        return self.data / f"{name}.jsonl"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def tokenizer(self) -> Path:
        return self.models / "tokenizer"

    @property
    def sft_model(self) -> Path:
        return self.models / "sft"

    @property
    def reward_model(self) -> Path:
        return self.models / "reward"

    @property
    def policy(self) -> Path:
        return self.models / "policy"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints" / "train"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    def metrics_file(self, stage: str) -> Path:
        return self.metrics / f"{stage}.json"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def train_history(self) -> Path:
        """A JSON list, one object per RL update: the train stage's result metrics (no timings), tracked by
        git; DVC plots and evaluate's plots read it."""
        return self.metrics / "train_history.json"

    @property
    def execution(self) -> Path:
        """Figures of each stage's last execution (seconds, episodes/s, memory): git-ignored, no DVC output."""
        return self.reports / "execution"

    def execution_file(self, stage: str) -> Path:
        return self.execution / f"{stage}.json"

    @property
    def train_log(self) -> Path:
        """One JSON line per RL update as the trainer logs it, timings included: what a resumed run keeps
        and replays into MLflow; train_history.json is written from it."""
        return self.execution / "train_log.jsonl"
