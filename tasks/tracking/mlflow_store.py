"""Which MLflow store the pipeline tracks into, and the client and experiment on it.

- Local by default: `sqlite:///<root>/mlflow.db`, artifacts in `<root>/mlartifacts`; `MLFLOW_TRACKING_URI`
  moves everything to a server.
- `RLHF_TRACKING=off` switches tracking off; `RLHF_PARENT_RUN_ID` nests a stage run under a pipeline run.
- A misconfiguration the user asked for (a tracking server or parent run that cannot be reached) is a
  TrackingError; the default local store is ours to manage.
- Run names that tell runs apart (`run_name`, `stage_run_name`), and the process that owns each run (host,
  pid, start time) so that the next run ends the RUNNING runs of a process that died (`end_runs_of_dead_processes`).

mlflow is imported inside the functions that need it: importing this module is free.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tasks.execution.errors import StageFailed

log = logging.getLogger(__name__)

EXPERIMENT_NAME = "rlhf-pipeline"  # MLFLOW_EXPERIMENT_NAME overrides it, as everywhere in MLflow
PARENT_RUN_ENV = "RLHF_PARENT_RUN_ID"
TRACKING_ENV = "RLHF_TRACKING"
LOCAL_UI_ENV = "RLHF_MLFLOW_UI"  # where `mlflow ui` serves a local store (for run links)
LOCAL_UI = "http://127.0.0.1:5000"
# MLflow 3's UI opens an experiment without this tag in its GenAI views (traces, prompts); ours trains models.
# The tag alone is not enough (MLflow 3.17 keeps a per-browser choice, GenAI by default): every link we print
# names the view, `?workflowType=machine_learning`, which opens the runs table in any browser.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
ML_VIEW = "workflowType=machine_learning"


class TrackingError(StageFailed, RuntimeError):
    """Tracking is misconfigured in a way the user asked for (a server or parent run that is not there)."""


def tracking_enabled() -> bool:
    return os.environ.get(TRACKING_ENV, "on").strip().lower() not in {"off", "0", "false", "no"}


def tracking_uri(root: str | Path = ".") -> str:
    """`MLFLOW_TRACKING_URI` if set, else a sqlite store in the workspace root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def asked_for_tracking() -> bool:
    """Whether the user named a tracking server or a parent run (then a failure to reach it is an error)."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI") or os.environ.get(PARENT_RUN_ENV, "").strip())


def is_remote(uri: str) -> bool:
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


def ui_base(root: str | Path = ".") -> str:
    """The MLflow UI of the store: the tracking server itself, or what `mlflow ui` serves for a local store
    (http://127.0.0.1:5000 unless RLHF_MLFLOW_UI says otherwise)."""
    uri = tracking_uri(root)
    base = uri if uri.startswith(("http://", "https://")) else os.environ.get(LOCAL_UI_ENV, LOCAL_UI)
    return base.rstrip("/")


def experiment_url(exp_id: str, root: str | Path = ".") -> str:
    """The experiment's runs table in the MLflow UI (not its GenAI overview)."""
    return f"{ui_base(root)}/#/experiments/{exp_id}/runs?{ML_VIEW}"


def run_page_url(exp_id: str, run_id: str, root: str | Path = ".") -> str:
    """One run's page, with the UI in its machine-learning view (its side bar leads to runs and models)."""
    return f"{ui_base(root)}/#/experiments/{exp_id}/runs/{run_id}?{ML_VIEW}"


def experiment_id(client, root: str | Path = ".") -> str:
    """The pipeline's experiment, created on first use; local stores keep artifacts in <root>/mlartifacts."""
    from mlflow.exceptions import MlflowException

    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", EXPERIMENT_NAME)
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.tags.get(EXPERIMENT_KIND_TAG) is None:  # made before the tag, or by hand: the UI's classic views
            client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return found.experiment_id
    location = None if is_remote(tracking_uri(root)) else str(Path(root).resolve() / "mlartifacts")
    try:
        return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except MlflowException:  # another process created it first
        return client.get_experiment_by_name(name).experiment_id



# ------------------------------------------------------------------------------------------ run names

STAGE_SEP = " · "  # "train · demo-ppo-kl_coef=0.07-1126-150207": the stage, then its pipeline run
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.=,+-]+")


def run_name(profile: str, algo: str, overrides: list[str] | tuple[str, ...] = (), when: datetime | None = None,
             width: int = 40) -> str:
    """`<profile>-<algo>[-<what changed>]-<MMDD-HHMMSS>`, e.g. demo-ppo-kl_coef=0.07-1126-150207: what changed
    is the overrides by their last key (`train.kl_coef=0.07` -> kl_coef=0.07), cut to `width` characters with a
    count of the rest; the start time (to the second) tells apart runs of the same parameters."""
    what, shown = "", 0
    for item in overrides:
        key, _, value = item.partition("=")
        part = _NAME_UNSAFE.sub("_", f"{key.rsplit('.', 1)[-1]}={value}")
        if what and len(what) + 1 + len(part) > width:
            break
        what, shown = f"{what},{part}" if what else part[:width], shown + 1
    if len(overrides) > shown:
        what += f"+{len(overrides) - shown}"
    stamp = (when or datetime.now()).strftime("%m%d-%H%M%S")
    return "-".join(p for p in (profile, algo, what, stamp) if p)


def stage_run_name(stage: str, pipeline_run_name: str) -> str:
    """A stage run's name: `train · <its pipeline run's name>` (compare views then read which run it was)."""
    return f"{stage}{STAGE_SEP}{pipeline_run_name}"


def unique_run_name(client, exp_id: str, name: str) -> str:
    """`name`, or `name-2`, `-3`... when the experiment already has a run of that name (two runs started in the
    same second with the same overrides)."""
    taken = {r.info.run_name for r in client.search_runs(
        [exp_id], f"attributes.run_name LIKE '{name.replace(chr(39), '_')}%'", max_results=1000)}
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    return candidate


# --------------------------------------------------------------- runs whose process died (kill -9, OOM)

OWNER_HOST, OWNER_PID, OWNER_STARTED = "rlhf.owner.host", "rlhf.owner.pid", "rlhf.owner.started"
FOUND_DEAD_TAG = "rlhf.found_dead"


def _process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None when there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # exists, another user's: alive as far as we can tell
        return float("nan")


def owner_tags() -> dict[str, str]:
    """What identifies the process that opens a run: host, pid and the pid's start time (a pid reused by a
    later process has another start time)."""
    started = _process_start(os.getpid())
    return {OWNER_HOST: socket.gethostname(), OWNER_PID: str(os.getpid()), OWNER_STARTED: f"{started:.2f}"}


def owner_is_gone(tags: dict[str, str]) -> bool:
    """Whether the run's owner, on this host, is no longer running. False for runs of other hosts (we cannot
    see their processes) and runs that recorded no owner."""
    if tags.get(OWNER_HOST) != socket.gethostname() or OWNER_PID not in tags:
        return False
    try:
        pid, started = int(tags[OWNER_PID]), float(tags.get(OWNER_STARTED, "nan"))
    except ValueError:
        return False
    now = _process_start(pid)
    if now is None:
        return True
    # /proc's start time counts clock ticks from boot: the same process gives the same figure to 1/100 s
    return abs(now - started) > 0.5 if now == now and started == started else False


def end_runs_of_dead_processes(client, exp_id: str, by_run_id: str, by_run_name: str) -> list[str]:
    """Mark KILLED every RUNNING run of the experiment whose owner process on this host is gone (killed with
    SIGKILL, by the OOM killer, a machine that lost power), with a tag saying so and which run found it.
    Returns their ids. Never fails the run that looks: a store error is a warning."""
    ended = []
    try:
        for run in client.search_runs([exp_id], "attributes.status = 'RUNNING'", max_results=1000):
            if run.info.run_id == by_run_id or not owner_is_gone(run.data.tags):
                continue
            tags = run.data.tags
            started = datetime.fromtimestamp(float(tags[OWNER_STARTED])).isoformat(timespec="seconds") \
                if tags.get(OWNER_STARTED, "nan") != "nan" else "?"
            client.set_tag(run.info.run_id, FOUND_DEAD_TAG,
                           f"its process (pid {tags[OWNER_PID]} on {tags[OWNER_HOST]}, started {started}) was gone "
                           f"when run {by_run_name} ({by_run_id}) started: set to KILLED")
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
            log.warning("MLflow run %s (%s) was RUNNING but its process %s is gone: set to KILLED",
                        run.info.run_name, run.info.run_id, tags[OWNER_PID])
    except Exception as err:  # cleaning up after another run never stops this one
        log.warning("could not look for MLflow runs of dead processes: %s", err)
    return ended
