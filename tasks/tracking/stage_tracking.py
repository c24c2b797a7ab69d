"""The MLflow run of one stage: opened before the stage with its params and lineage tags, closed after it
with its metrics, reports and dvc.lock (FAILED, with the traceback, when the stage raises).

On a tracking server nothing is lost to an outage (tasks/tracking/mlflow_tracker.py): opening the run is retried
until the server answers, every later write is queued and retried, and the run is closed only when the server
has taken them all, else the stage fails naming what was not sent (TrackingUnavailable) or what it refused
(TrackingRefused). On a GPU machine the system metrics go through the same queue (SystemMetrics).

Run ids are passed explicitly (`MlflowClient`); MLflow's per-thread active run is never used, so stages run
inside Prefect tasks or DVC subprocesses log to the right run. A stage run nests under the pipeline run named
by `RLHF_PARENT_RUN_ID` (the flow sets it for the DVC subprocesses), else it is a standalone run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core import chat
from rlhf_core.jsonio import read_jsonl
from rlhf_core.tracking import FanOutTracker, Tracker
from tasks.dag.dvc_yaml import entry_paths, stage_entry
from tasks.execution.transient import redact
from tasks.tracking.lineage import data_hashes, lineage_tags
from tasks.tracking.mlflow_store import (
    PARENT_RUN_ENV,
    TRACKING_ENV,
    TrackingError,
    asked_for_tracking,
    end_runs_of_dead_processes,
    experiment_id,
    get_client,
    is_remote,
    owner_tags,
    run_name,
    stage_run_name,
    tracking_enabled,
    tracking_uri,
    unique_run_name,
)
from tasks.tracking.mlflow_tracker import MlflowTracker, RetryingClient, TrackingUnavailable, numeric

log = logging.getLogger(__name__)

MAX_TABLE_ROWS = 5000
OVERRIDES_TAG = "rlhf.overrides"  # JSON list of the `section.key=value` overrides of a pipeline or stage run
SYSTEM_METRICS_ENV = "RLHF_SYSTEM_METRICS"  # off: no GPU system metrics even on a GPU machine
LAUNCH_PARAMS = ("num_processes", "distributed_type")  # of a model stage's metrics, logged as params too


@dataclass
class MlflowStageRun:
    """The MLflow run of the stage in progress."""

    client: Any
    run_id: str
    experiment_id: str
    uri: str
    overrides: list[str] = field(default_factory=list)
    """The `section.key=value` overrides behind this run: the pipeline run's when nested, else the stage's."""
    tracker: MlflowTracker = field(init=False)

    def __post_init__(self):
        # a tracking server: writes are queued and retried from a background thread, and the stage's calls that
        # must happen now (registering a model) are retried in line; a local store: in line, as they come
        remote = is_remote(self.uri)
        self.tracker = MlflowTracker(self.client, self.run_id, background=remote, server=redact(self.uri))
        if remote:
            self.client = RetryingClient(self.client, redact(self.uri))


_current: ContextVar[MlflowStageRun | None] = ContextVar("rlhf_stage_run", default=None)


def current_stage_run() -> MlflowStageRun | None:
    """The MLflow run of the stage running in this context (None when tracking is off)."""
    return _current.get()


def stage_tracker(*local: Tracker) -> Tracker:
    """`local` trackers plus the running stage's MLflow tracker, as one Tracker."""
    run = _current.get()
    return FanOutTracker(*local, run.tracker) if run is not None else FanOutTracker(*local)


def log_history(log_file: Path) -> None:
    """Log every row of a train log (JSON lines `{"step": ..., **metrics}`) into the running stage's MLflow run, as the
    stage would have logged them: for a run whose updates were logged elsewhere (ranks on a Ray cluster)."""
    if log_file.is_file():
        tracker = stage_tracker()
        for row in read_jsonl(log_file):
            tracker.log_metrics({k: v for k, v in row.items() if k != "step"}, row["step"])


def _section(params, stage: str) -> dict:
    """The stage's own params section (plus base), as a plain dict."""
    dumped = params.model_dump(mode="json")
    own = stage.replace("-", "_")
    return {"base": dumped["base"], "runtime": dumped["runtime"], **({own: dumped[own]} if own in dumped else {})}


def _open_stage_run(name: str, root: Path, params, overrides: list[str]) -> MlflowStageRun:
    uri = tracking_uri(root)
    store = get_client(root)
    # a server that is restarting: wait for it (up to RLHF_MLFLOW_RETRY_S) rather than fail
    client = RetryingClient(store, redact(uri)) if is_remote(uri) else store
    parent_id = os.environ.get(PARENT_RUN_ENV, "").strip()
    tags = {**lineage_tags(root, params.base.profile), **data_hashes(root, name), "rlhf.stage": name,
            **owner_tags()}
    if parent_id:
        try:
            parent = client.get_run(parent_id)
        except TrackingUnavailable:
            raise
        except Exception as err:
            raise TrackingError(f"{PARENT_RUN_ENV}={parent_id}: no such MLflow run in {tracking_uri(root)} "
                                f"({err}); unset it to log a standalone stage run") from err
        exp = parent.info.experiment_id
        tags["mlflow.parentRunId"] = parent_id
        overrides = [*json.loads(parent.data.tags.get(OVERRIDES_TAG, "[]")), *overrides]
        run_name_ = stage_run_name(name, parent.info.run_name)
    else:
        exp = experiment_id(client, root)
        run_name_ = unique_run_name(client, exp, stage_run_name(name, run_name(
            params.base.profile, params.train.algo, overrides)))
    tags[OVERRIDES_TAG] = json.dumps(overrides)
    run = client.create_run(exp, run_name=run_name_, tags=tags)
    end_runs_of_dead_processes(client, exp, run.info.run_id, run_name_)  # a run killed with -9 before this one
    stage_run = MlflowStageRun(store, run.info.run_id, exp, uri, overrides)
    stage_run.tracker.log_params(_section(params, name))
    return stage_run


def _log_outputs(run: MlflowStageRun, root: Path, name: str) -> None:
    """The stage's reports and metrics files (its dvc.yaml outs, metrics and plots under reports/ and
    metrics/), JSONL reports also as MLflow tables, and dvc.lock."""
    tracker = run.tracker
    for out in entry_paths(stage_entry(root, name), "outs", "metrics", "plots"):
        path = root / out
        if not out.startswith(("reports/", "metrics/")) or not path.exists():
            continue
        if path.is_dir():
            tracker.write(f"artifacts {out}", tracker.client.log_artifacts, run.run_id, str(path), out)
            for table in sorted(path.rglob("*.jsonl")):
                _log_table(run, table, f"tables/{table.relative_to(root).with_suffix('.json').as_posix()}")
        else:
            tracker.log_artifact(path, str(Path(out).parent))
    if (root / "dvc.lock").is_file():
        tracker.log_artifact(root / "dvc.lock")


def _log_table(run: MlflowStageRun, path: Path, artifact_file: str) -> None:
    import pandas as pd


    rows = [{k: chat.as_text(v) if chat.is_conversation(v) else v for k, v in row.items()}  # messages as lines
            for row in read_jsonl(path)[:MAX_TABLE_ROWS]]
    run.tracker.write(f"table {artifact_file}", run.tracker.client.log_table, run.run_id, data=pd.DataFrame(rows),
                      artifact_file=artifact_file)


def _close_stage_run(run: MlflowStageRun, root: Path, name: str, metrics: Mapping[str, Any], status: str,
                     error: str | None = None) -> None:
    """Queue the stage's last writes, the run's end last, and wait until the store has taken them all (raises
    TrackingUnavailable when a server never does)."""
    tracker = run.tracker
    launch = {k: metrics[k] for k in LAUNCH_PARAMS if k in metrics}
    if launch:  # the launch the stage really ran under (runtime.* are what was asked for)
        tracker.log_params(launch)
    # the stage's result, but not again where the stage logged a history (train's per-update metrics)
    summary = {k: v for k, v in numeric(metrics).items() if k not in tracker.logged}
    if summary:
        tracker.log_metrics(summary, step=tracker.last_step)
    tracker.flush()
    _log_outputs(run, root, name)
    if error:
        tracker.write("error.txt", tracker.client.log_text, run.run_id, error, "error.txt")
    tracker.end(status)
    tracker.close()


def track_stage(name: str, root: str | Path, params, work: Callable[[], dict], overrides: Sequence[str] = ()) -> dict:
    """Run `work()` (the stage) inside its MLflow run: params before, metrics and reports after; the run
    ends FAILED with the traceback as `error.txt` when the stage raises."""
    if not tracking_enabled():
        return work()
    root = Path(root).resolve()
    try:
        run = _open_stage_run(name, root, params, list(overrides))
    except Exception as err:
        if asked_for_tracking():  # a server or parent run the user named: fail now, before any work
            fix = f"Unset MLFLOW_TRACKING_URI to track into the local store, or set {TRACKING_ENV}=off"
            if isinstance(err, TrackingUnavailable):
                raise TrackingUnavailable(f"{err}. {fix}", err.transient) from err
            if isinstance(err, TrackingError):
                raise
            raise TrackingError(f"MLflow at {redact(tracking_uri(root))}: {err}. {fix}") from err
        # the default local store is ours to manage: run the stage untracked rather than not at all
        log.warning("MLflow tracking unavailable (%s); stage %s runs untracked", err, name)
        return work()
    token = _current.set(run)
    monitor = _gpu_system_metrics(run)
    try:
        metrics = work()
    except BaseException as err:
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        _current.reset(token)
        if monitor is not None:  # its last sample before the run's end, never after it
            monitor.stop()
        try:
            _close_stage_run(run, root, name, {}, status, traceback.format_exc())
        except TrackingError as lost:  # the stage's own error is the story; this one is said beside it
            log.error("%s", lost)
        raise
    _current.reset(token)
    if monitor is not None:
        monitor.stop()
    _close_stage_run(run, root, name, metrics, "FINISHED")
    return metrics


class SystemMetrics:
    """MLflow's system monitors (CPU, memory, disk, network, GPU) sampled from a thread, each aggregate sent as
    `system/<name>` metrics at steps 0, 1, ... through the stage run's tracker: the same ordered, retried queue as
    every other write, so an outage loses none and none lands after the run's end (`stop()` comes first)."""

    def __init__(self, run: MlflowStageRun, interval_s: float = 10):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # MLflow's monitor for its samplers and settings (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL, ...); its own
        # loop is not used: it reads the run on every sample and logs beside the queue, from its thread
        self._monitor = SystemMetricsMonitor(run.run_id, sampling_interval=interval_s, tracking_uri=run.uri)
        self._tracker, self._stop, self._step = run.tracker, threading.Event(), 0
        self._prefix = "system/" + (f"{self._monitor.node_id}/" if self._monitor.node_id else "")
        self._thread = threading.Thread(target=self._run, name=f"rlhf-system-metrics-{run.run_id[:8]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        monitor = self._monitor
        while not self._stop.is_set():
            for _ in range(monitor.samples_before_logging):
                monitor.collect_metrics()
                if self._stop.wait(monitor.sampling_interval):
                    break
            self._publish()

    def _publish(self) -> None:
        figures = {f"{self._prefix}{k}": v for k, v in self._monitor.aggregate_metrics().items()}
        for sampler in self._monitor.monitors:
            sampler.clear_metrics()
        if figures:
            self._tracker.log_metrics(figures, self._step)
            self._tracker.flush()
            self._step += 1

    def stop(self) -> None:
        """Take the last sample and stop; returns when the thread has ended (its writes are all queued)."""
        self._stop.set()
        self._thread.join()


def _gpu_system_metrics(run: MlflowStageRun) -> SystemMetrics | None:
    """On a GPU machine, system metrics (GPU utilisation and memory, CPU, disk) every 10 s into the stage run; on a
    laptop they would only add noise to every run. None when there is no GPU or RLHF_SYSTEM_METRICS=off."""
    if shutil.which("nvidia-smi") is None or os.environ.get(SYSTEM_METRICS_ENV, "on").lower() in {"off", "0", "false"}:
        return None
    try:
        return SystemMetrics(run)
    except Exception as err:  # a missing NVML, an old driver: the stage goes on without them
        log.warning("MLflow system metrics unavailable (%s)", err)
        return None
