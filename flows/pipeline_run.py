"""The MLflow run of one pipeline run (the flow's parent of the stage runs): named as its Prefect flow run,
`<profile>-<algo>-<overrides>-<MMDD-HHMMSS>` (mlflow_store.run_name), tagged with the hash of its resolved
params (`rlhf.params_hash`: runs of the same params share it), opened with the resolved params and overrides,
closed with dvc.lock, metrics/*.json and the headline metrics lifted onto it. Opening it ends the RUNNING runs
of processes that died (mlflow_store.end_runs_of_dead_processes).

Its writes go as a stage's do (tasks/tracking/mlflow_tracker.py): on a tracking server, opening it is retried and
made once; its params, artifacts, metrics and end are queued and retried through an outage, and closing it
waits for them, then fails the run naming what was not sent or what was refused. Its reads (the run, its stage
runs, the experiment) are retried the same way, up to the same limit (RLHF_MLFLOW_RETRY_S)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from rlhf_core.jsonio import read_json_object
from tasks.execution.transient import redact
from tasks.parameters.params import Params, load_params
from tasks.tracking.lineage import lineage_tags
from tasks.tracking.mlflow_store import (
    TrackingError,
    end_runs_of_dead_processes,
    experiment_id,
    get_client,
    is_remote,
    owner_tags,
    run_page_url,
    tracking_enabled,
    tracking_uri,
    unique_run_name,
)
from tasks.tracking.mlflow_store import run_name as _run_name
from tasks.tracking.mlflow_tracker import MlflowTracker, retrying_client
from tasks.tracking.stage_tracking import OVERRIDES_TAG

log = logging.getLogger(__name__)

# Prefect state names the flow may pass to end_pipeline_run, mapped to MLflow run statuses
_STATUS = {"COMPLETED": "FINISHED", "SUCCESS": "FINISHED", "CANCELLED": "KILLED", "CRASHED": "FAILED"}


def start_pipeline_run(root: str | Path, profile: str | None, overrides: list[str], name: str | None = None,
                       parent: str = "", experiment: str = "") -> str:
    """Open the parent run of one pipeline run and return its id ('' when tracking is off).

    `parent`: a run to nest it under (a sweep's); `experiment`: the DVC experiment it is saved as (a tag).

    `name`: the Prefect flow run's (run_name's when None; made unique in the experiment). Params: the
    resolved parameters flattened (`train.kl_coef`, ...) and `overrides` verbatim. Tags: lineage (git commit,
    dirty flag, profile, dvc.lock md5), the params hash, the overrides and the owner process. Creates the store
    and the experiment, so the stage processes that follow never race to create them."""
    if not tracking_enabled():
        return ""
    from flows.servers import ServerUnreachable, check_mlflow

    try:  # a tracking server that does not answer fails the run here, before any stage, in one short request
        check_mlflow()
    except ServerUnreachable as err:
        raise TrackingError(str(err)) from None
    root = Path(root).resolve()
    params = load_params(root, profile, list(overrides))
    client = _client(root)
    tags = {**lineage_tags(root, params.base.profile), "rlhf.kind": "pipeline", "rlhf.root": str(root),
            OVERRIDES_TAG: json.dumps(list(overrides)), PARAMS_HASH_TAG: params_hash(params), **owner_tags()}
    if parent:
        tags["mlflow.parentRunId"] = parent
    if experiment:
        tags[EXPERIMENT_TAG] = experiment
    exp = experiment_id(client, root)
    name = unique_run_name(client, exp, name or run_name(params, overrides))
    tags["mlflow.note.content"] = _description(params, overrides, experiment)  # the run page's Description
    run = client.create_run(exp, run_name=name, tags=tags)
    end_runs_of_dead_processes(client, exp, run.info.run_id, name)  # a run killed with -9 before this one
    tracker = open_tracker(root, run.info.run_id)
    _open[run.info.run_id] = (root, tracker)
    tracker.log_params({**params.model_dump(mode="json"), "overrides": json.dumps(list(overrides))})
    return run.info.run_id


def _description(params, overrides: list[str], experiment: str) -> str:
    """What the run is, for the MLflow UI's Description: the profile, algorithm, overrides, and where the rest is."""
    lines = [f"RLHF pipeline run: profile `{params.base.profile}`, algorithm `{params.train.algo}`, overrides "
             + (", ".join(f"`{o}`" for o in overrides) if overrides else "none") + ".",
             "",
             "Each stage is a nested run below it (prepare, validate, sft, reward-model, inspect, train, evaluate, "
             "register); its params are the resolved parameters, its artifacts `dvc.lock` and `metrics/`, its "
             "tags the git commit and `dvc.lock`'s md5 it ran with."]
    if experiment:
        lines.append(f"Saved as the DVC experiment `{experiment}` (`rlhf exps`).")
    return "\n".join(lines)


_open: dict[str, tuple[Path, MlflowTracker]] = {}  # pipeline runs opened by this process: their root and queue


def _client(root: str | Path):
    """The store's client; on a server every call, read or write, retried through an outage, a creation made
    once (mlflow_tracker.retrying_client)."""
    return retrying_client(root)


def open_tracker(root: Path, run_id: str) -> MlflowTracker:
    """The write queue of a run this process opened (pipeline or sweep): retried through outages on a server."""
    uri = tracking_uri(root)
    return MlflowTracker(get_client(root), run_id, background=is_remote(uri), server=redact(uri))


PARAMS_HASH_TAG = "rlhf.params_hash"
EXPERIMENT_TAG = "rlhf.experiment"  # the DVC experiment a sweep's point is saved as


def run_name(params: Params, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The name of a pipeline run (Prefect's and MLflow's), e.g. demo-ppo-kl_coef=0.07-1126-150207: profile,
    algorithm, the overrides, when it started (mlflow_store.run_name)."""
    return _run_name(params.base.profile, params.train.algo, list(overrides))


def params_hash(params: Params) -> str:
    """7 hex digits of the resolved parameters: runs with the same hash (tag rlhf.params_hash) ran the same
    parameters."""
    return hashlib.md5(json.dumps(params.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:7]


def end_pipeline_run(run_id: str, status: str, root: str | Path = ".") -> None:
    """Close the parent run: attach dvc.lock and metrics/*.json, lift the headline metrics onto it (so
    the runs table shows them), set its status (MLflow's or Prefect's state names), and wait until the store has
    taken every write of the run. Raises TrackingUnavailable naming what a server never took, TrackingRefused
    naming what it refused."""
    if not run_id or not tracking_enabled():
        return
    if run_id in _open:
        root, tracker = _open.pop(run_id)
    else:  # opened by another process (a resumed or remote flow)
        tracker = open_tracker(Path(root), run_id)
        tags = _client(root).get_run(run_id).data.tags
        root = Path(tags.get("rlhf.root", root))
    if (root / "dvc.lock").is_file():
        tracker.log_artifact(root / "dvc.lock")
    for file in sorted((root / "metrics").glob("*.json")):
        tracker.log_artifact(file, "metrics")
        if file.stem in ("eval", "register"):
            figures = read_json_object(file)
            if figures is None:
                log.warning("%s is not a JSON object of metrics", file)
            else:
                tracker.log_metrics({f"{file.stem}/{k}": v for k, v in figures.items()}, 0)
    tracker.end(_STATUS.get(status.strip().upper(), status.strip().upper()))
    tracker.close()


def run_url(run_id: str, root: str | Path = ".") -> str | None:
    """A link to the run in the MLflow UI (mlflow_store.run_page_url), or None without tracking."""
    exp = _experiment_of(run_id, root)
    return None if exp is None else run_page_url(exp, run_id, root)


def _experiment_of(run_id: str, root: str | Path) -> str | None:
    if not run_id or not tracking_enabled():
        return None
    try:  # a server that is restarting is waited for; one that stays down costs the link, not the run
        return _client(root).get_run(run_id).info.experiment_id
    except Exception as err:
        log.warning("no MLflow link for run %s: %s", run_id, err)
        return None


def iter_runs(root: str | Path, parent_run_id: str) -> Iterator:
    """The stage runs nested under a pipeline run, oldest first."""
    client = _client(root)
    parent = client.get_run(parent_run_id)
    yield from client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                  order_by=["attributes.start_time ASC"])
