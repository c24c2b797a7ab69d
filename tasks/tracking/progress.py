"""What the person running the pipeline sees: progress bars with ETA inside the stages, quiet library logs,
and the summary at the end of `rlhf run`.

rlhf_core knows nothing of rich: the stages hand it plain callbacks (`progress(step, logs)` of SFT and
reward-model training, `on_batch(n)` of evaluation) or wrap its tracker (`ProgressTracker` for RL updates).
Bars go to stderr, keeping stdout for the stage's JSON result. When stderr is not a terminal (a log file, a
Prefect worker's log, the flow's relay of `rlhf run > out.log`), a bar is plain lines instead, each flushed as it
is written: the first move, one each tenth of the bar or half minute, and the last.

Each bar also appends its moves, one JSON object a line, to the file named by RLHF_PROGRESS_FILE when the
flow sets it (flows/progress.py forwards them to the Prefect task's log and a progress artifact): a side
channel, so the terminal and the stage's log keep the bar as they have it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlhf_core.jsonio import read_json_object
from rlhf_core.tracking import NullTracker, Tracker

PROGRESS_FILE_ENV = "RLHF_PROGRESS_FILE"
NOISY_LOGGERS = ("transformers", "accelerate", "torch", "datasets", "huggingface_hub", "urllib3", "filelock",
                 "git", "alembic", "mlflow", "httpx", "great_expectations", "matplotlib", "PIL")


def quiet_libraries() -> None:
    """Only warnings and errors from libraries: the stage's own lines and bars stay readable."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # mlflow resets its logger's level on import


def _columns():
    from rich.progress import (
        BarColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return (TextColumn("[bold]{task.description:<14}"), BarColumn(bar_width=30), TaskProgressColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))


LINE_FRACTION = 0.1  # without a terminal, a progress line at each tenth of a bar,
LINE_EVERY_S = 30.0  # or half a minute after the last one, whichever comes first (and the first and last moves)


def progress_label(stage: str, bar: str) -> str:
    """`train`, or `stage (bar)` when the bar is named otherwise (the bar of reward-model is "reward model")."""
    return stage if bar.replace(" ", "-") == stage.replace(" ", "-") else f"{stage} ({bar})"


def move_line(label: str, done: float, total: float, info: str, eta_s: float | None) -> str:
    """`train: update 3/8  reward 0.41 ...  (38%, eta 0:00:05)`: one move of a bar as a line."""
    from datetime import timedelta

    when = "" if eta_s is None else f", eta {timedelta(seconds=round(eta_s))}"
    return f"{label}: {info or f'{done:g}/{total:g}'}  ({100 * done / (total or 1.0):.0f}%{when})"


class _Clock:
    """Elapsed time and ETA from the rate of this process's own moves (a resumed run's first updates were done
    before it started)."""

    def __init__(self, total: float, completed: float):
        self.total, self.completed, self.start = total, completed, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def eta(self, done: float) -> float | None:
        elapsed = self.elapsed()
        rate = (done - self.completed) / elapsed if elapsed > 0 and done > self.completed else 0.0
        return (self.total - done) / rate if rate > 0 else None


@contextmanager
def progress_bar(description: str, total: float, completed: float = 0,
                 enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A bar with elapsed time and ETA; yields `update(completed, info="")` (a no-op when not `enabled`: the
    other ranks of a launched stage draw none). Without a terminal (a log file, a flow's relay), plain lines
    instead, each written as it happens: rich would print the bar once, when it ends (a 16-minute SFT stage's
    log stayed empty until then)."""
    if not enabled:
        yield lambda done, info="": None
        return
    from rich.console import Console

    clock = _Clock(total, completed)
    console = Console(stderr=True)
    lines = None if console.is_terminal else _Lines(description, total, clock)
    with _progress_file(description, total, clock, own_lines=lines is not None) as report:
        if lines is not None:
            def update(done: float, info: str = "") -> None:
                lines.write(done, info)
                report(done, info)

            yield update
            return
        from rich.progress import Progress

        with Progress(*_columns(), console=console, refresh_per_second=2) as progress:
            bar = progress.add_task(description, total=total, completed=completed, info="")

            def update(done: float, info: str = "") -> None:
                progress.update(bar, completed=done, info=info)
                report(done, info)

            yield update


class _Lines:
    """A bar's moves as lines on stderr, flushed at once: the first move, one at each tenth of the bar or
    LINE_EVERY_S after the last line, and the last."""

    def __init__(self, description: str, total: float, clock: _Clock):
        self.description, self.total, self.clock = description, total, clock
        self.last, self.last_at = None, 0.0

    def write(self, done: float, info: str) -> None:
        now = time.monotonic()
        due = self.last is None or done >= self.total or done - self.last >= LINE_FRACTION * self.total \
            or now - self.last_at >= LINE_EVERY_S
        if not due or done == self.last:
            return
        eta = self.clock.eta(done)
        sys.stderr.write(move_line(self.description, done, self.total, info, eta) + "\n")
        sys.stderr.flush()
        self.last, self.last_at = done, now


@contextmanager
def _progress_file(description: str, total: float, clock: _Clock,
                   own_lines: bool) -> Iterator[Callable[[float, str], None]]:
    """`report(done, info)` appending {"bar", "done", "total", "info", "elapsed_s", "eta_s", "own_lines"} lines
    to RLHF_PROGRESS_FILE (a no-op without it). `own_lines`: the stage writes its progress lines itself (no
    terminal), so they reach the flow's log with its output and the flow need not log them again."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        yield lambda done, info: None
        return
    with open(path, "a", buffering=1) as out:  # line-buffered: each move is readable as soon as it is written

        def report(done: float, info: str) -> None:
            eta = clock.eta(done)
            out.write(json.dumps({"bar": description, "done": done, "total": total, "info": info,
                                  "elapsed_s": round(clock.elapsed(), 1),
                                  "eta_s": None if eta is None else round(eta, 1), "own_lines": own_lines}) + "\n")

        yield report


def _figures(logs: Mapping[str, float], keys: Mapping[str, str]) -> str:
    """'score 0.41  kl 0.02' from the logged metrics `keys` names (metric -> label)."""
    return "  ".join(f"{label} {logs[k]:.3g}" for k, label in keys.items() if k in logs)


class ProgressTracker(NullTracker):
    """Moves a bar on every RL update (step = updates done so far), then hands the metrics on."""

    KEYS = {"objective/scores": "reward", "objective/kl": "kl", "eps": "episodes/s", "val/response_length": "length"}

    def __init__(self, inner: Tracker, update: Callable[..., None], total: int):
        self.inner, self.update, self.total = inner, update, total

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.inner.log_params(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.update(step, f"update {step}/{self.total}  {_figures(metrics, self.KEYS)}")
        self.inner.log_metrics(metrics, step)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.inner.log_artifact(path, artifact_path)


def epoch_callback(update: Callable[..., None], epochs: int) -> Callable[[int, Mapping[str, float]], None]:
    """For SFT / reward-model training: the bar counts epochs (fractional: the loop reports `epoch`)."""
    def progress(step: int, logs: Mapping[str, float]) -> None:
        info = _figures(logs, {"train/loss": "loss", "eval/loss": "eval loss", "eval/accuracy": "eval acc"})
        update(logs.get("epoch", 0.0), f"epoch {logs.get('epoch', 0.0):.2f}/{epochs}  {info}")
    return progress


def count_callback(update: Callable[..., None], unit: str) -> Callable[[int], None]:
    """For batched loops that report how many items each batch did (evaluation's generation)."""
    done = 0

    def on_batch(n: int) -> None:
        nonlocal done
        done += n
        update(done, f"{done} {unit}")
    return on_batch


# ------------------------------------------------------------------- the end of `rlhf run`

SUMMARY_METRICS = (("win_rate_rm", "win rate vs SFT (reward model)"), ("win_rate_gold", "win rate vs SFT (gold)"),
                   ("mean_score_rm", "reward-model score"), ("ref_mean_score_rm", "  SFT reference"),
                   ("mean_score_gold", "gold score"), ("ref_mean_score_gold", "  SFT reference"),
                   ("mean_kl", "KL to SFT"), ("eos_rate", "EOS rate"))


def prefect_ui_hint(flow_run_id: str | None) -> str:
    api = os.environ.get("PREFECT_API_URL", "")
    if api:
        ui = api.rstrip("/").removesuffix("/api")
        return f"{ui}/runs/flow-run/{flow_run_id}" if flow_run_id else ui
    # the temporary server (and the UI behind the "View at" link it printed) stopped with the run; its state stays
    home = os.environ.get("PREFECT_HOME", ".prefect")
    page = f"/runs/flow-run/{flow_run_id}" if flow_run_id else ""
    return f"PREFECT_HOME={home} prefect server start, then http://127.0.0.1:4200{page}"


def mlflow_ui_hint(root: Path, uri: str, run_id: str) -> list[str]:
    """Lines saying where to see the run in MLflow: how to serve a local store, then the experiment's runs
    table and the run's page (links that open MLflow's machine-learning view, not its GenAI overview)."""
    from tasks.tracking.mlflow_store import experiment_url, get_client, is_remote, run_page_url

    try:
        exp = get_client(root).get_run(run_id).info.experiment_id
    except Exception:
        exp = None
    serve = [] if is_remote(uri) else [f"mlflow ui --backend-store-uri {uri}, then open"]
    if exp is None:
        return [*serve, f"the run {run_id}"]
    return [*serve, f"runs:     {experiment_url(exp, root)}", f"this run: {run_page_url(exp, run_id, root)}"]


def print_run_summary(root: Path, result: Mapping[str, Any], mlflow_uri: str | None, registry: str | None) -> None:
    """Stages, headline metrics, the registry's verdict (a line read from the registry), and where to look next."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    stages = Table(title="stages", title_justify="left")
    for column in ("stage", "", "seconds"):
        stages.add_column(column)
    for s in result.get("stages", []):
        how = "ran" if s["ran"] else "restored from DVC's run cache" if s.get("restored") else \
            "[dim]unchanged, skipped[/dim]"
        stages.add_row(s["stage"], how, f"{s['seconds']:.1f}")
    console.print(stages)

    evaluation = read_json_object(root / "metrics" / "eval.json") or {}
    if evaluation:
        table = Table(title="evaluation (metrics/eval.json)", title_justify="left")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, label in SUMMARY_METRICS:
            if key in evaluation:
                table.add_row(label, f"{evaluation[key]:.3f}")
        console.print(table)
    if registry:
        console.print(f"[bold]registry:[/bold] {registry}")
    if result.get("params_changed"):
        changed = ", ".join(f"{k}={new!r}" for k, _, new in result["params_changed"])
        console.print(f"[bold]overrides[/bold] {changed} were for this run only: params.yaml is back as it was "
                      "(the run record, MLflow and Prefect keep them), while the workspace's outputs (models/, "
                      "metrics/, dvc.lock) are this run's: the next plain run or `dvc repro` reruns the stages whose "
                      "parameters differ (DVC's run cache brings back those it ran before)"
                      + (f"; this run is the DVC experiment {result['dvc_experiment']}" if
                         result.get("dvc_experiment") else ""))
    console.print("[bold]where to look[/bold]")
    if mlflow_uri and result.get("mlflow_run_id"):
        for i, line in enumerate(mlflow_ui_hint(root, mlflow_uri, result["mlflow_run_id"])):
            console.print(f"  {'MLflow:' if i == 0 else '':8} {line}", soft_wrap=True)  # links stay whole
    console.print(f"  Prefect: {prefect_ui_hint(result.get('flow_run_id'))}", soft_wrap=True)
    console.print(f"  reports: {root / 'reports'}/ (eval/, logs/, runs/)   metrics: {root / 'metrics'}/", soft_wrap=True)
