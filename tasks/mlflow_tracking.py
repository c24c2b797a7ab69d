"""MLflow tracking for the pipeline: one parent run per pipeline run, one run per stage, lineage tags.

- Local by default: `sqlite:///<root>/mlflow.db`, artifacts in `<root>/mlartifacts`; `MLFLOW_TRACKING_URI`
  moves everything to a server.
- Run ids are passed explicitly (`MlflowClient`); MLflow's per-thread active run is never used, so stages
  run inside Prefect tasks or DVC subprocesses log to the right run.
- A stage run nests under the pipeline run named by `RLHF_PARENT_RUN_ID` (the flow sets it for the DVC
  subprocesses), else it is a standalone run. `RLHF_TRACKING=off` switches tracking off.
- Logging never fails a stage: after a stage has started, MLflow errors are logged as warnings. Only a
  misconfiguration the user asked for (a tracking server or parent run that cannot be reached) fails,
  and it fails before the stage starts.

mlflow is imported inside the functions that need it: importing this module is free.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from rlhf_core.tracking import NullTracker, Tracker

log = logging.getLogger(__name__)

EXPERIMENT_NAME = "rlhf-pipeline"  # MLFLOW_EXPERIMENT_NAME overrides it, as everywhere in MLflow
PARENT_RUN_ENV = "RLHF_PARENT_RUN_ID"
TRACKING_ENV = "RLHF_TRACKING"
LOCAL_UI_ENV = "RLHF_MLFLOW_UI"  # where `mlflow ui` serves a local store (for run links)
FLUSH_EVERY = 10  # updates per log_batch: one round trip instead of ~50 per update (STACK.md: 4.6 s / 50 calls)
MAX_TABLE_ROWS = 5000
# MLflow's own limits per log_batch call
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_VALUE = 6000
# Prefect state names the flow may pass to end_pipeline_run, mapped to MLflow run statuses
_STATUS = {"COMPLETED": "FINISHED", "SUCCESS": "FINISHED", "CANCELLED": "KILLED", "CRASHED": "FAILED"}


class TrackingError(RuntimeError):
    """Tracking is misconfigured in a way the user asked for (a server or parent run that is not there)."""


def tracking_enabled() -> bool:
    return os.environ.get(TRACKING_ENV, "on").strip().lower() not in {"off", "0", "false", "no"}


def tracking_uri(root: str | Path = ".") -> str:
    """`MLFLOW_TRACKING_URI` if set, else a sqlite store in the workspace root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def _asked_for_tracking() -> bool:
    """Whether the user named a tracking server or a parent run (then a failure to reach it is an error)."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI") or os.environ.get(PARENT_RUN_ENV, "").strip())


def _is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://", "databricks"))


def _quiet_offline() -> None:
    """No telemetry and no pings out: the pipeline runs offline."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")


@lru_cache(maxsize=8)
def _client_for(uri: str):
    """One client per store. Creating a sqlite store runs its migrations (~10 s): a file lock makes the
    first process create it while parallel writers wait, instead of racing on the schema."""
    _quiet_offline()
    from mlflow import MlflowClient

    if uri.startswith("sqlite:///"):
        from filelock import FileLock

        db = Path(uri.removeprefix("sqlite:///"))
        if db.exists() and not db.is_file():  # else MLflow retries opening it for ~100 s before failing
            raise TrackingError(f"{db} is not a sqlite file")
        db.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{db}.lock"):
            client = MlflowClient(uri, registry_uri=uri)
            client.search_experiments(max_results=1)  # opens the store: creates or upgrades the schema
        return client
    return MlflowClient(uri, registry_uri=uri)


def get_client(root: str | Path = "."):
    uri = tracking_uri(root)
    try:
        return _client_for(uri)
    except Exception as err:
        raise TrackingError(f"cannot open the MLflow store {uri!r}: {err}. Unset MLFLOW_TRACKING_URI for the "
                            f"local store, or set {TRACKING_ENV}=off to run without tracking.") from err


def experiment_id(client, root: str | Path = ".") -> str:
    """The pipeline's experiment, created on first use; local stores keep artifacts in <root>/mlartifacts."""
    from mlflow.exceptions import MlflowException

    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT_NAME)
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None if _is_remote(tracking_uri(root)) else str(Path(root).resolve() / "mlartifacts")
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # another process created it first
        return client.get_experiment_by_name(name).experiment_id


# ---------------------------------------------------------------- flattening and lineage

def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'rloo': {'rloo_k': 2}}} -> {'train.rloo.rloo_k': 2}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics MLflow can plot: numbers and booleans of a flattened dict; text is left out."""
    return {k: float(v) for k, v in flatten(metrics).items()
            if isinstance(v, bool | int | float) and not (isinstance(v, float) and math.isinf(v))}


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, list | tuple) else str(value)
    return text[:_MAX_PARAM_VALUE]


def file_md5(path: Path) -> str:
    """md5 of a file, or of a directory's sorted relative paths and file contents."""
    digest = hashlib.md5()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def lineage_tags(root: str | Path, profile: str) -> dict[str, str]:
    """Git commit and dirty flag of the code, the profile, and the md5 of dvc.lock."""
    root = Path(root).resolve()
    commit = _git(root, "rev-parse", "HEAD")
    # dvc.lock changes as a consequence of running; anything else uncommitted changes what runs
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)dvc.lock")
    tags = {"rlhf.profile": profile, "rlhf.git_commit": commit or "unknown",
            "rlhf.git_dirty": "unknown" if status is None else str(bool(status)).lower()}
    if commit:
        tags["mlflow.source.git.commit"] = commit
    lock = root / "dvc.lock"
    if lock.is_file():
        tags["rlhf.dvc_lock_md5"] = file_md5(lock)
    return tags


def dvc_stage(root: str | Path, name: str) -> dict:
    """The stage's entry in the workspace's dvc.yaml, else in the dvc.yaml shipped with this code."""
    for path in (Path(root) / "dvc.yaml", Path(__file__).resolve().parent.parent / "dvc.yaml"):
        if path.is_file():
            stages = (yaml.safe_load(path.read_text()) or {}).get("stages", {})
            if name in stages:
                return stages[name]
    return {}


def _entries(stage: dict, *keys: str) -> list[str]:
    """Paths of dvc.yaml list entries, which are either 'path' or {'path': {options}}."""
    return [next(iter(item)) if isinstance(item, dict) else item for key in keys for item in stage.get(key, [])]


def data_hashes(root: str | Path, name: str) -> dict[str, str]:
    """md5 of the stage's data and model inputs (its dvc.yaml deps under data/ and models/); code inputs
    are covered by the git commit."""
    root = Path(root)
    return {f"rlhf.data.{dep}": file_md5(root / dep) for dep in _entries(dvc_stage(root, name), "deps")
            if dep.startswith(("data/", "models/")) and (root / dep).exists()}


# ---------------------------------------------------------------- the batched tracker

class MlflowTracker:
    """`rlhf_core.tracking.Tracker` on one MLflow run. Metrics are buffered and sent with one `log_batch`
    every `flush_every` steps and at `close()`. Errors are logged, never raised: a broken store must not
    stop a training run."""

    def __init__(self, client, run_id: str, flush_every: int = FLUSH_EVERY):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self.errors = 0
        self.last_step = 0
        self.logged: set[str] = set()  # metric keys with a history already
        self._pending: list = []
        self._steps = 0

    def safely(self, what: str, fn: Callable, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as err:  # logging must never fail the stage
            self.errors += 1
            if self.errors == 1:
                log.warning("MLflow %s failed for run %s (%s); the stage goes on without it", what, self.run_id, err)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_value(v)) for k, v in flatten(params).items()]
        for start in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.safely("log params", self.client.log_batch, self.run_id,
                         params=items[start:start + _MAX_PARAMS_PER_BATCH], synchronous=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = numeric(metrics)
        self._pending += [Metric(k, v, now, step) for k, v in values.items()]
        self.logged.update(values)
        self.last_step = max(self.last_step, step)
        self._steps += 1
        if self._steps % self.flush_every == 0:
            self.flush()

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.safely("log artifact", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), _MAX_METRICS_PER_BATCH):
            self.safely("log metrics", self.client.log_batch, self.run_id,
                         metrics=pending[start:start + _MAX_METRICS_PER_BATCH], synchronous=True)

    def close(self) -> None:
        self.flush()


class _FanOut(NullTracker):
    """Hands every call to several trackers (the stage's JSONL history and its MLflow run)."""

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


# ---------------------------------------------------------------- stage runs

@dataclass
class StageRun:
    """The MLflow run of the stage in progress."""

    client: Any
    run_id: str
    experiment_id: str
    uri: str
    tracker: MlflowTracker = field(init=False)

    def __post_init__(self):
        self.tracker = MlflowTracker(self.client, self.run_id)


_current: ContextVar[StageRun | None] = ContextVar("rlhf_stage_run", default=None)


def current_stage_run() -> StageRun | None:
    """The MLflow run of the stage running in this context (None when tracking is off)."""
    return _current.get()


def stage_tracker(*local: Tracker) -> Tracker:
    """`local` trackers plus the running stage's MLflow tracker, as one Tracker."""
    run = _current.get()
    return _FanOut(*local, run.tracker) if run is not None else _FanOut(*local)


def _section(params, stage: str) -> dict:
    """The stage's own params section (plus base), as a plain dict."""
    dumped = params.model_dump(mode="json")
    own = stage.replace("-", "_")
    return {"base": dumped["base"], **({own: dumped[own]} if own in dumped else {})}


def _open_stage_run(name: str, root: Path, params) -> StageRun:
    client = get_client(root)
    parent_id = os.environ.get(PARENT_RUN_ENV, "").strip()
    tags = {**lineage_tags(root, params.base.profile), **data_hashes(root, name), "rlhf.stage": name}
    if parent_id:
        try:
            exp = client.get_run(parent_id).info.experiment_id
        except Exception as err:
            raise TrackingError(f"{PARENT_RUN_ENV}={parent_id}: no such MLflow run in {tracking_uri(root)} "
                                f"({err}); unset it to log a standalone stage run") from err
        tags["mlflow.parentRunId"] = parent_id
    else:
        exp = experiment_id(client, root)
    run = client.create_run(exp, run_name=name, tags=tags)
    stage_run = StageRun(client, run.info.run_id, exp, tracking_uri(root))
    stage_run.tracker.log_params(_section(params, name))
    return stage_run


def _log_outputs(run: StageRun, root: Path, name: str) -> None:
    """The stage's reports and metrics files (its dvc.yaml outs, metrics and plots under reports/ and
    metrics/), JSONL reports also as MLflow tables, and dvc.lock."""
    tracker = run.tracker
    for out in _entries(dvc_stage(root, name), "outs", "metrics", "plots"):
        path = root / out
        if not out.startswith(("reports/", "metrics/")) or not path.exists():
            continue
        if path.is_dir():
            tracker.safely("log artifacts", run.client.log_artifacts, run.run_id, str(path), out)
            for table in sorted(path.rglob("*.jsonl")):
                _log_table(run, table, f"tables/{table.relative_to(root).with_suffix('.json').as_posix()}")
        else:
            tracker.log_artifact(path, str(Path(out).parent))
    if (root / "dvc.lock").is_file():
        tracker.log_artifact(root / "dvc.lock")


def _log_table(run: StageRun, path: Path, artifact_file: str) -> None:
    import pandas as pd

    from tasks.io import read_jsonl

    def log() -> None:
        rows = read_jsonl(path)[:MAX_TABLE_ROWS]
        run.client.log_table(run.run_id, data=pd.DataFrame(rows), artifact_file=artifact_file)

    run.tracker.safely("log table", log)


def _close_stage_run(run: StageRun, root: Path, name: str, metrics: Mapping[str, Any], status: str,
                     error: str | None = None) -> None:
    # the stage's result, but not again where the stage logged a history (train's per-update metrics)
    summary = {k: v for k, v in numeric(metrics).items() if k not in run.tracker.logged}
    if summary:
        run.tracker.log_metrics(summary, step=run.tracker.last_step)
    run.tracker.close()
    _log_outputs(run, root, name)
    if error:
        run.tracker.safely("log error", run.client.log_text, run.run_id, error, "error.txt")
    run.tracker.safely("end run", run.client.set_terminated, run.run_id, status)


def track_stage(name: str, root: str | Path, params, work: Callable[[], dict]) -> dict:
    """Run `work()` (the stage) inside its MLflow run: params before, metrics and reports after; the run
    ends FAILED with the traceback as `error.txt` when the stage raises."""
    if not tracking_enabled():
        return work()
    root = Path(root).resolve()
    try:
        run = _open_stage_run(name, root, params)
    except Exception as err:
        if _asked_for_tracking():  # a server or parent run the user named: fail now, before any work
            if isinstance(err, TrackingError):
                raise
            raise TrackingError(f"MLflow at {tracking_uri(root)}: {err}. Unset MLFLOW_TRACKING_URI to track into "
                                f"the local store, or set {TRACKING_ENV}=off") from err
        # the default local store is ours to manage: run the stage untracked rather than not at all
        log.warning("MLflow tracking unavailable (%s); stage %s runs untracked", err, name)
        return work()
    token = _current.set(run)
    try:
        metrics = work()
    except BaseException as err:
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        _close_stage_run(run, root, name, {}, status, traceback.format_exc())
        raise
    finally:
        _current.reset(token)
    _close_stage_run(run, root, name, metrics, "FINISHED")
    return metrics


# ---------------------------------------------------------------- pipeline runs (the flow's API)

def start_pipeline_run(root: str | Path, profile: str | None, overrides: list[str]) -> str:
    """Open the parent run of one pipeline run and return its id ('' when tracking is off).

    Params: the resolved parameters flattened (`train.kl_coef`, ...) and `overrides` verbatim. Tags:
    lineage (git commit, dirty flag, profile, dvc.lock md5) and the overrides. Creates the store and
    the experiment, so the stage processes that follow never race to create them."""
    if not tracking_enabled():
        return ""
    from tasks.params import load_params

    root = Path(root).resolve()
    params = load_params(root, profile, list(overrides))
    client = get_client(root)
    tags = {**lineage_tags(root, params.base.profile), "rlhf.kind": "pipeline", "rlhf.root": str(root),
            "rlhf.overrides": json.dumps(list(overrides))}
    run = client.create_run(experiment_id(client, root), run_name=f"pipeline-{params.base.profile}", tags=tags)
    MlflowTracker(client, run.info.run_id).log_params({**params.model_dump(mode="json"),
                                                       "overrides": json.dumps(list(overrides))})
    return run.info.run_id


def end_pipeline_run(run_id: str, status: str, root: str | Path = ".") -> None:
    """Close the parent run: attach dvc.lock and metrics/*.json, lift the headline metrics onto it (so
    the runs table shows them), and set its status (MLflow's or Prefect's state names)."""
    if not run_id or not tracking_enabled():
        return
    client = get_client(root)
    tracker = MlflowTracker(client, run_id)
    try:
        root = Path(client.get_run(run_id).data.tags.get("rlhf.root", root))
    except Exception as err:
        log.warning("MLflow run %s not found (%s); nothing to close", run_id, err)
        return
    if (root / "dvc.lock").is_file():
        tracker.log_artifact(root / "dvc.lock")
    for file in sorted((root / "metrics").glob("*.json")):
        tracker.log_artifact(file, "metrics")
        if file.stem in ("eval", "register"):
            try:
                tracker.log_metrics({f"{file.stem}/{k}": v for k, v in json.loads(file.read_text()).items()}, 0)
            except (ValueError, AttributeError) as err:
                log.warning("%s is not a JSON object of metrics (%s)", file, err)
    tracker.close()
    state = status.strip().upper()
    tracker.safely("end run", client.set_terminated, run_id, _STATUS.get(state, state))


def run_url(run_id: str, root: str | Path = ".") -> str | None:
    """A link to the run in the MLflow UI: the server's, or the one `mlflow ui` serves for a local store
    (http://127.0.0.1:5000 unless RLHF_MLFLOW_UI says otherwise)."""
    if not run_id or not tracking_enabled():
        return None
    uri = tracking_uri(root)
    try:
        exp = get_client(root).get_run(run_id).info.experiment_id
    except Exception:
        return None
    base = uri if uri.startswith(("http://", "https://")) else os.environ.get(LOCAL_UI_ENV, "http://127.0.0.1:5000")
    return f"{base.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"


def iter_runs(root: str | Path, parent_run_id: str) -> Iterator:
    """The stage runs nested under a pipeline run, oldest first."""
    client = get_client(root)
    parent = client.get_run(parent_run_id)
    yield from client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                  order_by=["attributes.start_time ASC"])
