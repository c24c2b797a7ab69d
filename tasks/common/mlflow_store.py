"""Which MLflow store the pipeline tracks into, and the client and experiment on it.

- Local by default: `sqlite:///<root>/mlflow.db`, artifacts in `<root>/mlartifacts`; `MLFLOW_TRACKING_URI`
  moves everything to a server.
- `RLHF_TRACKING=off` switches tracking off; `RLHF_PARENT_RUN_ID` nests a stage run under a pipeline run.
- A misconfiguration the user asked for (a tracking server or parent run that cannot be reached) is a
  TrackingError; the default local store is ours to manage.

mlflow is imported inside the functions that need it: importing this module is free.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from tasks.common.errors import StageFailed

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

