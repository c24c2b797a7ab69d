"""The Prefect flow `rlhf-pipeline`: every stage of dvc.yaml, in its order, each a task that runs it via DVC.

Typed parameters (the UI shows them as a form): a profile, `section.key=value` overrides, and how long to
wait for another run that holds the workspace. One run:

1. takes the workspace lock (flows/lock.py), so two runs never interleave in one workspace;
2. validates the overrides (keys, source files, overrides the data source ignores) and writes them into
   params.yaml for this run only: the file is restored when the run ends (flows/overrides.py); a bad key
   fails here, before anything runs, naming the key;
3. opens the MLflow pipeline run (flows/pipeline_run.py) and records the overrides: MLflow params, a
   Prefect artifact with a link to the MLflow run, and reports/runs/<time>-<run>.json;
4. runs each stage through DVC (flows/dvc_repro.py) with RLHF_PARENT_RUN_ID set, so stage runs nest under
   the pipeline run and unchanged stages are skipped exactly as `dvc repro` skips them;
5. forwards a running stage's progress to its task's log and a progress artifact, and the run's to the flow run's
   progress artifact `rlhf-run-progress` (flows/progress.py);
6. publishes what each stage left as it ends: validation summary, reward-model inspection, evaluation table.

A failed stage fails the run with a message naming the stage and the tail of its log. SIGINT or SIGTERM stops
the running stage and ends the run Cancelled through the same path (flows/interrupt.py). Only failures a
retry can fix are retried, told by their type (tasks/execution/transient.py: a server down or timing out, HTTP 5xx,
DVC's lock held by a manual `dvc repro`, a stage killed by a signal such as the OOM killer's), never by the log.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import nullcontext
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.runtime import task_run as this_task_run
from prefect.states import Cancelled, Completed, Failed, State

from flows import interrupt, reports
from flows.dvc_repro import log_tail, repro_stage, stage_env
from flows.lock import LockWaitStopped, WorkspaceBusy, workspace_lock
from flows.overrides import (
    ExperimentNotSaved,
    describe,
    experiment_name,
    local_edits,
    overrides_applied,
    restore_after_killed_run,
    save_experiment,
    write_run_record,
)
from flows.pipeline_run import end_pipeline_run, run_name, run_url, start_pipeline_run
from flows.progress import forwarded_progress, run_progress
from tasks.dag.dvc_yaml import DVC_YAML, load_stages, stage_names
from tasks.execution.stage_server import SERVER_ENV, serving_stages
from tasks.execution.transient import transient_cause
from tasks.parameters.params import ParamsError, load_params
from tasks.tracking.mlflow_store import PARENT_RUN_ENV, TrackingError, tracking_uri

LOGS_DIR = "reports/logs"
UI_ONLY_LOGGER = "prefect.extra"  # Prefect sends its records to the API only (no console handler)


class _UiRelay:
    """A stage's output lines to its task's log in the Prefect UI, a record each; but the result `rlhf stage` prints
    at its end (its metrics as an indented JSON object) as one record, a key per line (`reports.stage_result`), not a
    record per line: forty records of `{`, `"episode": 64,` ... `}` closed every stage's log."""

    def __init__(self, stage: str, log: logging.LoggerAdapter):
        self.stage, self.log, self.block = stage, log, None

    def __call__(self, line: str) -> None:
        if self.block is not None:
            self.block.append(line)
            if line == "}":  # the object's end: its inner objects' ends are indented
                self.close()
        elif line == "{":
            self.block = [line]
        else:
            self.log.info("%s", line)

    def close(self) -> None:
        """Send what is held (a result cut short goes as its lines came)."""
        if self.block is None:
            return
        text, self.block = "\n".join(self.block), None
        try:
            result = json.loads(text)
        except ValueError:
            result = None
        self.log.info("%s", reports.stage_result(self.stage, result) if isinstance(result, dict) else text)


RETRYABLE: dict[str, str] = {}  # task run id -> why a retry may fix its failure (ReproResult.retry_reason)


def _retry_if_transient(task, task_run, state: State) -> bool:
    return RETRYABLE.pop(str(task_run.id), None) is not None


# DVC is the cache (it skips unchanged stages): Prefect caches nothing and persists no result. One retry delay, not
# a list: the UI's task-run page shows a list of delays as "NaN".
@task(name="dvc-stage", task_run_name="{name}", retries=2, retry_delay_seconds=30,
      retry_condition_fn=_retry_if_transient, cache_policy=NO_CACHE, persist_result=False)
def run_dvc_stage(name: str, root: str, parent_run_id: str = "", stage_server: str = "",
                  progress_file: str = "") -> dict | State:
    """`dvc repro --single-item NAME`: runs the stage if its params, deps or outs changed, else skips it; in the
    run's warm stage server when it names one (tasks/execution/stage_server.py). Its bars write to `progress_file`
    when the flow names one (the flow's progress artifact reads it too)."""
    logger = get_run_logger()
    log = Path(root) / LOGS_DIR / f"{name}.log"
    logger.info("stage %s: log %s", name, log)
    terminal = sys.stdout.isatty()
    # the stage's lines (progress bars as they end) in the Prefect UI; the terminal has them from the relay
    ui_only = logging.LoggerAdapter(logging.getLogger(UI_ONLY_LOGGER), logger.extra)
    # and while it runs, its bars' moves every few steps, with a progress artifact (flows/progress.py)
    with forwarded_progress(name, ui_only, progress_file) as progress_env:
        env = stage_env({**progress_env, **({PARENT_RUN_ENV: parent_run_id} if parent_run_id else {}),
                         **({SERVER_ENV: stage_server} if stage_server else {})}, terminal)
        relay = _UiRelay(name, ui_only)
        result = repro_stage(root, name, log, env, echo=getattr(sys.stdout, "buffer", None), on_line=relay)
        relay.close()
    if interrupt.received():
        return Cancelled(message=f"stage {name!r} stopped by {interrupt.received()} after {result.seconds:.0f} s")
    if result.returncode != 0:
        # A returned Failed state (not an exception): the message is the story, no engine traceback; in the
        # UI's log too, as plain lines (it shows a state's message as a quoted Python string)
        retry = (f"; a retry may fix it: {result.retry_reason}" if result.retry_reason
                 else "; not retried: it would fail the same way")
        message = (f"stage {name!r} failed (exit status {result.returncode}) after {result.seconds:.0f} s{retry}; "
                   f"last lines of {log}:\n{log_tail(log)}")
        ui_only.error("%s", message)
        if result.retry_reason:
            RETRYABLE[str(this_task_run.id)] = result.retry_reason
        return Failed(message=message)
    outcome = {"stage": name, "ran": result.ran, "restored": result.restored, "seconds": round(result.seconds, 1)}
    if result.restored:  # an earlier run had these params and inputs: its outputs are back, nothing recomputed
        logger.info("stage %s: restored from DVC's run cache (an earlier run had the same inputs)", name)
        return Completed(data=outcome, name="Cached", message="restored from DVC's run cache: not run again")
    if not result.ran:  # shown as "Cached" in the UI, not as a Completed run of the stage
        logger.info("stage %s: unchanged since dvc.lock, skipped", name)
        return Completed(data=outcome, name="Cached", message="unchanged since dvc.lock: DVC skipped it")
    logger.info("stage %s: ran in %.1f s", name, result.seconds)
    return outcome


def _to_prefect(what: str, fn, *args, **kwargs) -> None:
    """An artifact for the Prefect UI: a Prefect server that stopped answering costs the UI this, not the run
    its results (the stages' work goes on; the run record and MLflow have it all)."""
    try:
        fn(*args, **kwargs)
    except Exception as err:
        cause = transient_cause(err)
        if cause is None:
            raise
        get_run_logger().warning("the Prefect server did not take %s (%s); the run goes on", what, cause)


def _publish_stage_report(root: Path, name: str) -> None:
    """The artifact of what stage `name` has just left in the workspace (validation, inspection, evaluation), made
    as it ends, so a long run shows each summary when it is there, not when the run ends."""
    for key, (stage, _) in reports.STAGE_REPORTS.items():
        text = reports.stage_report(root, key) if stage == name else None
        if text:
            create_markdown_artifact(text, key=key, description=f"{stage} stage: {reports.STAGE_REPORTS[key][1]}")
    text = reports.evaluation(root) if name == "evaluate" else None
    if text:
        create_markdown_artifact(text, key="rlhf-evaluation", description="metrics/eval.json + first completions")


def _publish_mlflow_link(root: Path, mlflow_run_id: str) -> None:
    """The run's MLflow run, linked from its start (its stages' runs appear under it as they go)."""
    if mlflow_run_id:
        url = run_url(mlflow_run_id, root)
        what = "the MLflow run: params, per-update metrics, the stage runs under it"  # a card's one line
        if url:
            create_link_artifact(url, link_text=f"MLflow run {mlflow_run_id}", key="rlhf-mlflow-run", description=what)
        else:
            create_markdown_artifact(reports.mlflow_run(mlflow_run_id, tracking_uri(root), None),
                                     key="rlhf-mlflow-run", description=what)


def _runs_rlhf_stages(root: Path) -> bool:
    """Whether a stage of the workspace's dvc.yaml runs `rlhf stage` (each cmd a string or a list of them)."""
    commands = [entry.get("cmd", "") for entry in load_stages(root / DVC_YAML).values()]
    return any(str(c).startswith("rlhf stage") for cmd in commands for c in (cmd if isinstance(cmd, list) else [cmd]))


def _run_stages(root: Path, names: list[str], parent_run_id: str) -> tuple[list[dict], State | None]:
    """Each stage in order until one fails, each's report published as it ends: (results, the failed state or
    None)."""
    results = []
    # torch, transformers and MLflow imported once for the run's stages, not once per stage (a pipeline of other
    # commands gains nothing from it)
    warm = serving_stages(root / LOGS_DIR / "stage_server.log") if _runs_rlhf_stages(root) else nullcontext("")
    # where the run is, on the flow run's page (its Artifacts tab) from the first stage to the end
    with warm as server, run_progress(names) as progress:
        for index, name in enumerate(names):
            if interrupt.received():
                progress.stopped("cancelled before", index)
                return results, Cancelled(message=f"stopped by {interrupt.received()} before stage {name!r}")
            with progress.stage(index) as progress_file:
                state = run_dvc_stage(name, str(root), parent_run_id, server, progress_file, return_state=True)
            _to_prefect(f"stage {name}'s report", _publish_stage_report, root, name)
            if not state.is_completed():  # failed, or cancelled by a signal
                progress.stopped("cancelled at" if state.is_cancelled() else "failed at")
                return results, state
            results.append(state.result())
        progress.done(results)
    return results, None


def _run_locked(root: Path, profile: str, overrides: list[str], mlflow_parent: str = "",
                experiment: str = "") -> dict | State:
    logger = get_run_logger()
    names = stage_names(root)  # dvc.yaml's order; FileNotFoundError outside the repo root
    restored = restore_after_killed_run(root)
    if restored:
        logger.warning("%s", restored)
    edits = local_edits(root)
    if edits:
        # in the UI's log; `rlhf run` has said so on the terminal before Prefect started
        ui_only = logging.LoggerAdapter(logging.getLogger(UI_ONLY_LOGGER), logger.extra)
        ui_only.warning("params.yaml differs from the committed one (git HEAD), and this run uses it: %s",
                        describe(edits))
    with overrides_applied(root, profile, overrides) as changes:  # ParamsError before anything is written
        if changes:
            logger.info("params.yaml for this run only (restored after it): %s", describe(changes))
        return _run_with_params(root, names, profile, overrides, changes, edits, mlflow_parent, experiment)


def _run_with_params(root: Path, names: list[str], profile: str, overrides: list[str], changes: list,
                     edits: list, mlflow_parent: str = "", experiment: str = "") -> dict | State:
    # '' when tracking is off
    parent = start_pipeline_run(root, profile, overrides, name=flow_run.get_name(), parent=mlflow_parent,
                                experiment=experiment)
    record = {"flow_run_id": flow_run.get_id() or "local", "flow_run_name": flow_run.get_name(),
              "profile": profile, "overrides": overrides, "params_changed": [list(c) for c in changes],
              "params_local_edits": [list(e) for e in edits], "mlflow_run_id": parent, "status": "RUNNING"}
    record_path = write_run_record(root, record)
    _to_prefect("the run's parameters", create_markdown_artifact,
                reports.run_parameters(profile, overrides, changes, record_path.relative_to(root)),
                key="rlhf-run-parameters", description="profile, overrides, params.yaml changes")
    _to_prefect("the MLflow run's link", _publish_mlflow_link, root, parent)
    results, failed, status = [], None, "FAILED"  # FAILED unless the stages get through
    try:
        results, failed = _run_stages(root, names, parent)
        status = "FINISHED" if failed is None else "KILLED" if failed.is_cancelled() else "FAILED"
        # before params.yaml is restored: the run's params beside its results (a sweep's point always: its
        # grid may equal params.yaml)
        if failed is None and (changes or experiment):
            record["dvc_experiment"] = _save_experiment(root, record, experiment)
    finally:
        try:
            end_pipeline_run(parent, status, root)
        except TrackingError as lost:  # MLflow never took the run's writes: a failed run, naming them
            if failed is not None or status != "FINISHED":  # a stage's failure is the story; this is said beside it
                get_run_logger().error("%s", lost)
            else:
                status, failed = "FAILED", Failed(message=str(lost))
        record.update(status=status, stages=results, failure=failed.message if failed is not None else None)
        write_run_record(root, record)
    if failed is not None:
        return Cancelled(message=failed.message) if failed.is_cancelled() else Failed(message=failed.message)
    return {**record, "record": str(record_path)}


def _save_experiment(root: Path, record: dict, name: str = "") -> str | None:
    """This override run as its own DVC experiment (`dvc exp show`, `rlhf exps`), named `name` or after the
    run; None with a warning when DVC refuses, which fails nothing: the results are in the workspace, MLflow
    and the run record."""
    logger = get_run_logger()
    name = name or experiment_name(record["flow_run_name"] or "run", record["started"])
    try:
        save_experiment(root, name)
    except ExperimentNotSaved as err:
        logger.warning("%s", err)
        return None
    logger.info("saved as DVC experiment %s (`rlhf exps` lists it with its params and metrics)", name)
    return name


def _flow_run_name() -> str:
    """The Prefect run's name, which the MLflow run takes too: profile, algorithm, overrides and start time
    (demo-ppo-kl_coef=0.07-1126-150207), not a random pair of words."""
    parameters = flow_run.parameters
    overrides = list(parameters.get("overrides") or [])
    try:
        params = load_params(Path.cwd(), parameters.get("profile"), overrides)
    except (ParamsError, OSError):  # a bad override fails the run with its message; the name needs none
        return f"{parameters.get('profile', 'demo')}-invalid-params"
    return run_name(params, overrides)


@flow(name="rlhf-pipeline", flow_run_name=_flow_run_name, log_prints=False)
def rlhf_pipeline(profile: str = "demo", overrides: list[str] = [],  # noqa: B006 (Prefect validates a copy)
                  wait_for_lock_s: float = 600.0, mlflow_parent: str = "", experiment: str = "") -> dict | State:
    """The RLHF pipeline: every stage of dvc.yaml, in order, through DVC.

    Args:
        profile: demo (built-in world, tiny models, CPU) or a profiles/NAME.yaml.
        overrides: section.key=value items, e.g. train.kl_coef=0.1; in params.yaml for this run only.
        wait_for_lock_s: how long to wait while another run holds this workspace, then fail.
        mlflow_parent: an MLflow run to nest this run's under (set by rlhf-sweep: its sweep run).
        experiment: the DVC experiment name to save an override run as (set by rlhf-sweep); default: the
            run's name.
    """
    root = Path.cwd()
    run = f"flow run {flow_run.get_name() or ''} ({flow_run.get_id() or 'local'})"
    logger = get_run_logger()
    try:
        with interrupt.cancellation_reads_as_cancellation(), interrupt.stop_on_signals(), \
                workspace_lock(root, wait_for_lock_s, run=run, on_wait=logger.info, stop=interrupt.received):
            state = _run_locked(root, profile, list(overrides), mlflow_parent, experiment)
    except LockWaitStopped as err:
        logger.warning("%s", err)
        return Cancelled(message=str(err))
    except (WorkspaceBusy, ParamsError, FileNotFoundError, TrackingError) as err:
        logger.error("%s", err)
        return Failed(message=str(err))
    if isinstance(state, State) and state.is_cancelled():  # by a signal: Ctrl-C, a worker, Cancel in the UI
        logger.warning("%s", interrupt.cancelled_message(state.message))
    return state

