"""The Prefect flow over DVC, on a real local Prefect server on loopback.

The deployment is served by `rlhf serve` in a subprocess and a run is triggered through the API as the UI
does (`run_deployment` with parameters); the shrunken pipeline runs in a temp git + DVC repo. Also: the
workspace lock, overrides validated before anything runs and recorded, a failing stage named with its log.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from test_dvc import sh
from test_pipeline import TINY
from typer.testing import CliRunner

from cli.main import app
from cli.preflight import say_local_edits
from flows.dvc_repro import clean_lines, log_tail, repro_stage, stage_env
from flows.lock import LockWaitStopped, WorkspaceBusy, workspace_lock
from flows.overrides import (
    RESTORE_NOTE,
    edited_yaml,
    local_edits,
    overrides_applied,
    planned_changes,
    restore_after_killed_run,
)
from tasks.dag.dvc_yaml import stage_names
from tasks.execution.launcher import free_port
from tasks.execution.stage_server import SERVER_ENV
from tasks.parameters.params import ParamsError, deep_merge, load_params, parse_override

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STARTUP_S = 180  # a bound on waiting for a server to answer, not a timing assertion


def git_dvc_repo(path: Path) -> Path:
    sh("git", "init", "-q", cwd=path)
    sh("dvc", "init", "-q", cwd=path)
    sh("git", "add", "-A", cwd=path)
    sh("git", "commit", "-qm", "init", cwd=path)
    return path


def base_env(**extra: str) -> dict[str, str]:
    """This environment without its Prefect, pipeline and MLflow settings, but with the worker's warm stage server
    (tests/conftest.py): an `rlhf stage` these processes start runs in it, unless the test takes `plain_stages`."""
    env = {k: v for k, v in os.environ.items()
           if k == SERVER_ENV or not k.startswith(("PREFECT_", "RLHF_", "MLFLOW_TRACKING"))}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env['PATH']}", "DVC_NO_ANALYTICS": "1", "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


@functools.cache
def migrated_prefect_db() -> Path:
    """An empty Prefect database, migrated once per test process. A server started on a fresh PREFECT_HOME first
    runs Prefect's ~100 migrations (~12 s of CPU on 2 cores, two thirds of its start; the suite starts dozens of
    servers, most of them the temporary server of a test repo's first `rlhf run`); a copy takes none."""
    home = Path(tempfile.mkdtemp(prefix="rlhf-tests-prefect-db-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    subprocess.run([BIN / "prefect", "server", "database", "upgrade", "-y"], env=base_env(PREFECT_HOME=str(home)),
                   check=True, capture_output=True, timeout=STARTUP_S)
    return home / "prefect.db"


def with_migrated_prefect_db(home: Path) -> Path:
    """`home` (a PREFECT_HOME, e.g. a repo's .prefect/) holding a migrated empty database, unless it has one."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "prefect.db").exists():
        shutil.copy(migrated_prefect_db(), home / "prefect.db")
    return home


@contextmanager
def prefect_server(home: Path, *options: str, ui: bool = False, **settings: str) -> Iterator[str]:
    """`prefect server start` on a free loopback port with its own PREFECT_HOME; yields the API URL. With `ui`,
    the UI too, told where its API is: `--port` alone leaves it calling the default port (4200)."""
    url = f"http://127.0.0.1:{free_port()}/api"
    port = url.rsplit(":", 1)[1].split("/")[0]
    log = (with_migrated_prefect_db(home) / "server.log").open("w")
    settings = {"PREFECT_UI_API_URL": url, **settings} if ui else settings
    server = subprocess.Popen([BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", port,
                               *([] if ui else ["--no-ui"]), *options],
                              env=base_env(PREFECT_HOME=str(home), **settings), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (home / "server.log").read_text()[-3000:]
            time.sleep(1)
        SERVERS[url] = server
        yield url
    finally:
        SERVERS.pop(url, None)
        # this process's queued logs and events, sent while the server answers (left queued, they were retried at
        # the interpreter's exit against a server long gone, logging errors after the suite's last line)
        if "prefect.events.worker" in sys.modules:
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            for worker in (APILogWorker, EventsWorker):
                worker.drain_all(timeout=5)
        server.terminate()
        try:  # uvicorn's graceful stop waits on open connections and the server's services (measured: 40 s and
            server.wait(timeout=10)  # more under load); a test's server keeps nothing worth that wait
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=60)


SERVERS: dict[str, subprocess.Popen] = {}  # prefect_server's processes by API URL, for a test that kills one


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    with prefect_server(tmp_path_factory.mktemp("prefect-home"), "--no-scheduler") as url:
        yield url


@pytest.fixture
def in_process_api(prefect_api):
    """Run flows in this process against the test server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        yield prefect_api


@pytest.fixture
def pipeline_repo(tmp_path, mlflow_db_template):
    """The repo's pipeline on the TINY world in a fresh git + DVC repo, with an MLflow store ready."""
    return build_pipeline_repo(tmp_path, mlflow_db_template)


def build_pipeline_repo(path: Path, mlflow_db_template: Path) -> Path:
    for item in ("dvc.yaml", ".gitignore", "prefect.yaml"):
        shutil.copy(REPO / item, path / item)
    for package in ("rlhf_core", "tasks", "flows"):
        shutil.copytree(REPO / package, path / package, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for item in TINY:
        params = deep_merge(params, parse_override(item))
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copy(mlflow_db_template, path / "mlflow.db")  # git-ignored; saves the ~10 s migrations
    with_migrated_prefect_db(path / ".prefect")  # the temporary server's home (git-ignored): the same for Prefect
    return git_dvc_repo(path)


@pytest.fixture
def failing_repo(tmp_path):
    """A two-stage pipeline whose second stage fails, for the failure path without any model."""
    seed = "python -c \"import yaml; print(yaml.safe_load(open('params.yaml'))['base']['seed'])\""
    stages = {"ok": {"cmd": [f"{seed} > ok.txt", "python bar.py"], "params": ["base.seed"], "outs": ["ok.txt"]},
              "broken": {"cmd": "python -c \"import sys; print('the reward model is on fire'); sys.exit(3)\"",
                         "deps": ["ok.txt"], "outs": ["never.txt"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (tmp_path / "params.yaml").write_text("base:\n  profile: demo  # kept\n  seed: 0\n")
    (tmp_path / "bar.py").write_text(BAR)
    return git_dvc_repo(tmp_path)


BAR = """from tasks.tracking.progress import progress_bar

with progress_bar("ok", total=5) as update:  # a stage's bar, as train's moves on each update
    for i in range(1, 6):
        update(i, f"update {i}/5  reward {i / 10}")
"""


def wait_for_deployment(name: str, serve: subprocess.Popen, log: Path):
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + STARTUP_S
    with get_client(sync_client=True) as client:
        while True:
            try:
                return client.read_deployment_by_name(name)
            except ObjectNotFound:
                assert serve.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)


@pytest.mark.slow
def test_served_deployment_runs_the_pipeline_through_dvc(pipeline_repo, in_process_api, tmp_path_factory):
    from mlflow import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = base_env(PREFECT_API_URL=in_process_api, PREFECT_HOME=str(log.parent))
    params = yaml.safe_load((pipeline_repo / "params.yaml").read_text())
    params["train"]["gradient_accumulation_steps"] = 1  # 4 updates of 16 episodes: a progress to follow
    (pipeline_repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh("git", "commit", "-qam", "four updates", cwd=pipeline_repo)
    params_before = (pipeline_repo / "params.yaml").read_text()
    with log.open("w") as out:
        serve = subprocess.Popen([BIN / "rlhf", "serve"], cwd=pipeline_repo, env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
    try:
        wait_for_deployment("rlhf-pipeline/manual", serve, log)
        nightly = wait_for_deployment("rlhf-pipeline/nightly", serve, log)
        assert [s.schedule.cron for s in nightly.schedules] == ["0 2 * * *"]
        # whoever may trigger a run gets no more than the committed pipeline (trust): refused before any stage
        refused = run_deployment("rlhf-pipeline/manual", timeout=600, poll_interval=2, parameters={"overrides": [
            'train.reward_funcs=[{"function": "os:system"}]', "runtime.accelerate_config=/etc/passwd"]})
        run = run_deployment("rlhf-pipeline/manual", parameters={"overrides": ["train.kl_coef=0.07"]},
                             timeout=1200, poll_interval=3)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    assert refused.state.is_failed(), refused.state
    assert "train.reward_funcs[0].function: module 'os' is not in trust.reward_modules" in refused.state.message
    with get_client(sync_client=True) as client:
        assert not client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[refused.id])))
    assert run.state.is_completed(), f"{run.state}\n{log.read_text()[-4000:]}"

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        stages = {t.name: t for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
            any_=[run.id])))}
    by_key = {a.key: a for a in artifacts}
    # each summary is there when its stage ends, before the next one starts (not all at the run's end); the MLflow
    # link from the first stage on
    for key, made_by, before in (("rlhf-validation", "validate", "sft"), ("rlhf-inspection", "inspect", "train"),
                                 ("rlhf-evaluation", "evaluate", "register"), ("rlhf-mlflow-run", None, "prepare")):
        created = by_key[key].created
        assert made_by is None or created >= stages[made_by].end_time, (key, created, stages[made_by].end_time)
        assert created <= stages[before].start_time, f"{key} made at {created}, after stage {before} started"
    # one retry delay, which the UI's task-run page shows in seconds (a list of them it showed as "NaN")
    assert stages["train"].empirical_policy.retries == 2 and stages["train"].empirical_policy.retry_delay == 30
    assert {"rlhf-run-parameters", "rlhf-validation", "rlhf-inspection", "rlhf-evaluation",
            "rlhf-mlflow-run"} <= set(by_key), sorted(by_key)
    assert "train.kl_coef=0.07" in by_key["rlhf-run-parameters"].data
    assert "win_rate_rm" in by_key["rlhf-evaluation"].data and "| prompt |" in by_key["rlhf-evaluation"].data
    parent_id = json.loads(next((pipeline_repo / "reports" / "runs").glob("*.json")).read_text())["mlflow_run_id"]
    assert f"/runs/{parent_id}" in by_key["rlhf-mlflow-run"].data  # a link into the MLflow UI
    # train's progress in its task's log while it ran (update k/N, reward, KL, episodes/s, ETA), and an artifact
    assert by_key["rlhf-progress-train"].type == "progress" and by_key["rlhf-progress-train"].data == 100
    moves = [line for line in ui_log_lines(run.id) if line.startswith("train: update ")]
    assert [m.split()[2] for m in moves] == ["1/4", "2/4", "3/4", "4/4"], moves
    assert all(re.search(r"reward -?[\d.]+.*kl -?[\d.e-]+.*episodes/s [\d.]+", m) for m in moves), moves
    assert re.search(r"\(25%, eta 0:\d\d:\d\d\)$", moves[0]) and moves[-1].endswith("(100%, eta 0:00:00)"), moves

    # overrides: for this run only (params.yaml as before), recorded in reports/runs/ and in MLflow
    assert (pipeline_repo / "params.yaml").read_text() == params_before
    [record_file] = (pipeline_repo / "reports" / "runs").glob("*.json")
    record = json.loads(record_file.read_text())
    assert record["status"] == "FINISHED" and record["overrides"] == ["train.kl_coef=0.07"]
    assert [s["stage"] for s in record["stages"]] == stage_names(pipeline_repo)
    assert all(s["ran"] for s in record["stages"])
    parent = MlflowClient(f"sqlite:///{pipeline_repo / 'mlflow.db'}").get_run(record["mlflow_run_id"])
    assert "train.kl_coef=0.07" in parent.data.params["overrides"]
    assert parent.data.params["train.kl_coef"] == "0.07"

    # `rlhf run` as in a fresh clone (no PREFECT_API_URL: a temporary server): every stage is unchanged
    proc = subprocess.run([BIN / "rlhf", "run", "--set", "train.kl_coef=0.07"], cwd=pipeline_repo,
                          env=base_env(COLUMNS="200"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    second = json.loads(max((pipeline_repo / "reports" / "runs").glob("*.json")).read_text())
    assert second["flow_run_id"] != record["flow_run_id"] and not any(s["ran"] for s in second["stages"])
    assert "unchanged, skipped" in proc.stdout, proc.stdout
    assert "mlflow ui --backend-store-uri sqlite:///" in proc.stdout and "win rate vs SFT" in proc.stdout
    assert "rlhf-policy v1: now" in proc.stdout, proc.stdout  # read from the registry
    assert (pipeline_repo / "params.yaml").read_text() == params_before
    with sqlite3.connect(pipeline_repo / ".prefect" / "prefect.db") as db:  # the temporary server's state is the repo's
        assert db.execute("select count(*) from flow_run where id = ?", (second["flow_run_id"],)).fetchone() == (1,)
    assert parent.data.tags["rlhf.git_dirty"] == "false", "the run's own overrides do not make the code dirty"

    # each override run is a DVC experiment: its params beside its results, though params.yaml is restored
    [baseline] = [e for e in json.loads(sh("dvc", "exp", "show", "--json", cwd=pipeline_repo)) if e["rev"] != "workspace"]
    saved = {run["name"]: run["revs"][0]["data"] for run in baseline["experiments"]}
    assert {record["dvc_experiment"], second["dvc_experiment"]} <= set(saved), saved.keys()
    for data in saved.values():
        assert data["params"]["params.yaml"]["data"]["train"]["kl_coef"] == 0.07
        assert "win_rate_rm" in data["metrics"]["metrics/eval.json"]["data"]
    view = subprocess.run([BIN / "rlhf", "exps"], cwd=pipeline_repo, env=base_env(), capture_output=True,
                          text=True, timeout=300).stdout
    header, workspace_row = (line.split() for line in view.splitlines()[:2])
    assert workspace_row[0] == "workspace" and "kl_coef" in header, view
    assert workspace_row[header.index("kl_coef")] == "0.07", view  # the params its results were made with
    assert "params.yaml now differs in train.kl_coef" in view, view

    # override -> plain -> override: the third run has the first one's parameters, so DVC's run cache gives
    # back train's outputs (and evaluate's): no training update, the first run's policy and metrics
    first = {path: (pipeline_repo / path).read_bytes() for path in (
        "metrics/train.json", "metrics/train_history.json", "metrics/eval.json", "models/policy/model.safetensors")}
    traces = sorted(p.name for p in (pipeline_repo / "reports" / "trace").iterdir())
    for overrides in ([], ["--set", "train.kl_coef=0.07"]):
        proc = subprocess.run([BIN / "rlhf", "run", *overrides], cwd=pipeline_repo, env=base_env(COLUMNS="200"),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plain, third = sorted((pipeline_repo / "reports" / "runs").glob("*.json"))[-2:]
    plain, third = (json.loads(path.read_text())["stages"] for path in (plain, third))
    assert next(s for s in plain if s["stage"] == "train")["ran"], "the plain run's kl_coef differs: it trains"
    by_stage = {s["stage"]: s for s in third}
    assert by_stage["train"]["restored"] and not by_stage["train"]["ran"], third
    assert by_stage["evaluate"]["restored"] and not by_stage["evaluate"]["ran"], third
    assert re.search(r"train\s*│\s*restored from DVC's run cache", proc.stdout), proc.stdout[-3000:]
    third_parent = json.loads(max((pipeline_repo / "reports" / "runs").glob("*.json")).read_text())["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{pipeline_repo / 'mlflow.db'}")
    trained = client.search_runs([parent.info.experiment_id],
                                 f"tags.mlflow.parentRunId = '{third_parent}' and tags.`rlhf.stage` = 'train'")
    assert trained == [], "no train stage run, so no training update, in the third run"
    assert {path: (pipeline_repo / path).read_bytes() for path in first} == first
    assert sorted(p.name for p in (pipeline_repo / "reports" / "trace").iterdir()) == traces


def test_bad_override_fails_before_anything_runs(failing_repo, in_process_api, monkeypatch):
    from flows.pipeline import rlhf_pipeline

    monkeypatch.chdir(failing_repo)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    before = (failing_repo / "params.yaml").read_text()
    state = rlhf_pipeline(overrides=["train.kl_coeff=0.1"], return_state=True)
    assert state.is_failed() and "train.kl_coeff: unknown key (did you mean 'train.kl_coef'?)" in state.message
    assert (failing_repo / "params.yaml").read_text() == before
    assert not (failing_repo / "reports").exists(), "no stage ran"


def ui_log_lines(flow_run_id) -> list[str]:
    """The lines of a flow run's logs as the Prefect UI shows them."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [line for log in logs for line in log.message.splitlines()]


def test_failed_stage_is_named_with_its_log_tail(failing_repo, in_process_api, monkeypatch):
    from flows.pipeline import rlhf_pipeline

    monkeypatch.chdir(failing_repo)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    before = (failing_repo / "params.yaml").read_text()
    state = rlhf_pipeline(overrides=["base.seed=3"], return_state=True)
    assert state.is_failed()
    assert "stage 'broken' failed" in state.message and "the reward model is on fire" in state.message
    assert (failing_repo / "ok.txt").is_file(), "the stage before it ran"
    [record] = [json.loads(p.read_text()) for p in (failing_repo / "reports" / "runs").glob("*.json")]
    assert record["status"] == "FAILED" and record["overrides"] == ["base.seed=3"]
    assert [s["stage"] for s in record["stages"]] == ["ok"] and "on fire" in record["failure"]
    assert (failing_repo / "ok.txt").read_text().strip() == "3", "the stage ran with the override"
    lines = ui_log_lines(state.state_details.flow_run_id)  # the stages' own lines, in the Prefect UI
    assert "Running stage 'ok':" in lines and "the reward model is on fire" in lines, lines
    # the stage's bar, forwarded while it runs: a line per move here (each is a tenth or more), and an artifact
    moves = [line for line in lines if re.match(r"ok: update \d/5  reward 0\.\d  \(\d+%", line)]
    assert len(moves) == 5 and moves[-1].startswith("ok: update 5/5  reward 0.5  (100%"), lines
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rlhf-progress-ok"])))
    assert artifact.type == "progress" and artifact.data == 100 and artifact.task_run_id is not None
    assert any(line.startswith("stage 'broken' failed (exit status") for line in lines), lines
    assert (failing_repo / "params.yaml").read_text() == before, "the override was for this run only"
    assert record["params_changed"] == [["base.seed", 0, 3]]


def test_a_skipped_stage_shows_as_cached(failing_repo, in_process_api, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import rlhf_pipeline

    monkeypatch.chdir(failing_repo)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    rlhf_pipeline(return_state=True)
    again = rlhf_pipeline(return_state=True)  # "ok" is unchanged; "broken" fails again
    with get_client(sync_client=True) as client:
        flow_run_id = client.read_flow_run(again.state_details.flow_run_id).id
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    states = {t.name: t.state.name for t in tasks}
    assert states == {"ok": "Cached", "broken": "Failed"}, states
    record = json.loads(max((failing_repo / "reports" / "runs").glob("*.json")).read_text())
    assert record["stages"] == [{"stage": "ok", "ran": False, "restored": False,
                                 "seconds": record["stages"][0]["seconds"]}]


def test_second_run_refuses_naming_the_holder(failing_repo, in_process_api, monkeypatch):
    from flows.pipeline import rlhf_pipeline

    monkeypatch.chdir(failing_repo)
    with workspace_lock(failing_repo, wait_s=0, run="the first run"):
        state = rlhf_pipeline(wait_for_lock_s=0.5, return_state=True)
    assert state.is_failed()
    assert f"pid {os.getpid()}" in state.message and "the first run" in state.message
    assert "waited 0.5 s" in state.message
    assert not (failing_repo / "reports").exists(), "the refused run touched nothing"


def test_lock_waits_for_the_holder_to_finish(tmp_path):
    held = threading.Event()

    def first_run():
        with workspace_lock(tmp_path, wait_s=0):
            held.set()
            time.sleep(1)

    thread = threading.Thread(target=first_run)
    thread.start()
    held.wait()
    with pytest.raises(WorkspaceBusy, match="busy"):
        with workspace_lock(tmp_path, wait_s=0):
            pass
    messages = []
    with workspace_lock(tmp_path, wait_s=60, on_wait=messages.append):  # waits for the first run, then proceeds
        assert not thread.is_alive()
    thread.join()
    assert len(messages) == 1 and "waiting up to 60 s for the workspace lock, held by pid" in messages[0], messages


@pytest.mark.timeout(120)  # the signal ended the 600 s wait: a wait that ignored it fails here
def test_a_signal_ends_the_wait_for_the_lock(tmp_path):
    with workspace_lock(tmp_path, wait_s=0):
        with pytest.raises(LockWaitStopped, match="stopped by SIGINT while waiting"):
            with workspace_lock(tmp_path, wait_s=600, stop=lambda: "SIGINT"):
                pass


def test_repro_stage_skips_unchanged_and_keeps_the_log(failing_repo):
    env = stage_env({}, terminal=False)
    first = repro_stage(failing_repo, "ok", failing_repo / "logs" / "ok.log", env)
    again = repro_stage(failing_repo, "ok", failing_repo / "logs" / "ok.log", env)
    assert (first.returncode, first.ran, again.returncode, again.ran) == (0, True, 0, False)
    broken = repro_stage(failing_repo, "broken", failing_repo / "logs" / "broken.log", env)
    assert broken.returncode != 0 and "on fire" in log_tail(broken.log)


def test_planned_changes_validate_and_list_the_changes(failing_repo):
    with pytest.raises(ParamsError, match="train.kl_coeff"):
        planned_changes(failing_repo, "demo", ["train.kl_coeff=1"])
    assert planned_changes(failing_repo, "demo", ["train.kl_coef=0.2", "base.seed=0"]) == [
        ("train.kl_coef", None, 0.2)]


def test_a_runs_override_outranks_its_profile_in_every_stage(workspace):
    """`rlhf run --profile P --set k=v` writes k=v into params.yaml for the run, and a stage applies P over
    params.yaml: for a key P sets too, the run's value must still be what the stage reads."""
    import shutil

    shutil.copytree(REPO / "profiles", workspace / "profiles")
    overrides = ["prepare.world.sft_train=96", "runtime.num_processes=1", "train.kl_coef=0.3"]
    intended = load_params(workspace, "cpu-zero3", overrides)
    with overrides_applied(workspace, "cpu-zero3", overrides) as changes:
        seen = load_params(workspace)  # what `rlhf stage NAME` reads during the run
        assert ("base.run_overrides", None, ["prepare.world.sft_train", "runtime.num_processes"]) in changes
    assert seen.prepare.world.sft_train == 96 and seen.runtime.num_processes == 1 and seen.train.kl_coef == 0.3
    assert seen.model_dump(exclude={"base"}) == intended.model_dump(exclude={"base"})
    assert load_params(workspace).base.run_overrides == [], "restored after the run"


def test_overrides_are_restored_even_when_the_run_fails(failing_repo):
    path = failing_repo / "params.yaml"
    before = path.read_text()
    with pytest.raises(RuntimeError, match="stage failed"):
        with overrides_applied(failing_repo, "demo", ["base.seed=7"]) as changes:
            assert changes == [("base.seed", 0, 7)] and "seed: 7" in path.read_text()
            raise RuntimeError("stage failed")
    assert path.read_text() == before
    assert not (failing_repo / RESTORE_NOTE).exists()


def test_a_killed_run_leaves_a_note_the_next_run_restores_from(failing_repo):
    path = failing_repo / "params.yaml"
    before = path.read_text()
    killed = overrides_applied(failing_repo, "demo", ["base.seed=7"])
    killed.__enter__()  # and never __exit__: the process died (kill -9)
    assert "seed: 7" in path.read_text()
    assert "restored" in restore_after_killed_run(failing_repo)
    assert path.read_text() == before and restore_after_killed_run(failing_repo) is None


def test_git_dirty_ignores_the_runs_own_params_edit(failing_repo):
    """rlhf.git_dirty is about the code and inputs: an override run's own edit of params.yaml does not count,
    a user's edit (of params.yaml or anything else tracked) does, during the run too."""
    from tasks.tracking.lineage import lineage_tags

    def dirty() -> str:
        return lineage_tags(failing_repo, "demo")["rlhf.git_dirty"]

    assert dirty() == "false"
    with overrides_applied(failing_repo, "demo", ["base.seed=7"]) as changes:
        assert changes and dirty() == "false", "the run's own overrides"
        (failing_repo / "dvc.yaml").write_text((failing_repo / "dvc.yaml").read_text() + "# edited\n")
        assert dirty() == "true", "another tracked file changed"
    sh("git", "checkout", "dvc.yaml", cwd=failing_repo)
    path = failing_repo / "params.yaml"
    path.write_text(path.read_text().replace("seed: 0", "seed: 5"))  # the user's own edit, kept by the run
    with overrides_applied(failing_repo, "demo", ["base.seed=7"]):
        assert dirty() == "true", "params.yaml held more than the run's overrides"
    assert dirty() == "true"


def test_overrides_edit_only_their_own_lines(tmp_path):
    """The repo's params.yaml: comments, quotes, nulls and long flow mappings stay as written (DVC's writer
    rewrapped `sft.tiny` and unquoted "no", which PyYAML then reads as False)."""
    text = (REPO / "params.yaml").read_text()
    edited = edited_yaml(text, {"train.kl_coef": 0.07, "runtime.attn_implementation": "eager",
                                "runtime.frozen_dtype": "no", "train.rloo.rloo_k": 4})
    changed = [(a, b) for a, b in zip(text.splitlines(), edited.splitlines(), strict=True) if a != b]
    assert [b.split("#")[0].strip() for _, b in changed] == [
        "frozen_dtype: \"no\"", "attn_implementation: eager", "kl_coef: 0.07", "rloo_k: 4"], changed
    assert all("#" in b for a, b in changed if "#" in a), "comments kept"
    data = yaml.safe_load(edited)
    assert data["runtime"]["mixed_precision"] == "no" and data["runtime"]["frozen_dtype"] == "no"
    assert data["runtime"]["accelerate_config"] is None and data["train"]["kl_coef"] == 0.07


def test_an_override_in_exponent_notation_is_written_as_a_number():
    """`--set train.learning_rate=1e-4`: PyYAML reads 1e-4 as a string; written as one, DVC's params and
    `dvc exp show` would hold the string '1e-4'."""
    from ruamel.yaml import YAML

    value = parse_override("train.learning_rate=1e-4")["train"]["learning_rate"]
    assert value == 1e-4 and isinstance(value, float)
    assert parse_override("train.learning_rate='1e-4'")["train"]["learning_rate"] == "1e-4", "quoted stays text"
    edited = edited_yaml((REPO / "params.yaml").read_text(), {"train.learning_rate": value})
    assert YAML(typ="safe", pure=True).load(edited)["train"]["learning_rate"] == 1e-4  # as DVC reads it
    assert yaml.safe_load(edited)["train"]["learning_rate"] == 1e-4


def test_local_edits_name_what_differs_from_the_committed_params(failing_repo):
    assert local_edits(failing_repo) == []
    path = failing_repo / "params.yaml"
    path.write_text(path.read_text().replace("seed: 0", "seed: 5"))
    assert local_edits(failing_repo) == [("base.seed", 0, 5)]


def test_missing_source_files_and_ignored_overrides_fail_before_anything_runs(failing_repo, in_process_api,
                                                                                   monkeypatch):
    from flows.pipeline import rlhf_pipeline

    monkeypatch.chdir(failing_repo)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    before = (failing_repo / "params.yaml").read_text()
    missing = rlhf_pipeline(overrides=["prepare.source=files", "prepare.sft=data/mine.jsonl",
                                       "prepare.preferences=nowhere/prefs.parquet"], return_state=True)
    assert missing.is_failed(), missing
    assert "prepare.sft: data/mine.jsonl: no such file or directory" in missing.message
    assert "prepare.preferences: nowhere/prefs.parquet: no such file" in missing.message
    ignored = rlhf_pipeline(overrides=["prepare.sft=trl-lib/tldr"], return_state=True)
    assert ignored.is_failed() and "prepare.sft: read only when prepare.source is not 'world'" in ignored.message
    ignored_world = rlhf_pipeline(overrides=["prepare.source=hub", "prepare.sft=a/b", "prepare.preferences=c/d",
                                             "prepare.world.sft_train=10"], return_state=True)
    assert ignored_world.is_failed() and "prepare.world.sft_train: read only when" in ignored_world.message
    assert (failing_repo / "params.yaml").read_text() == before
    assert not (failing_repo / "reports").exists() and not (failing_repo / "ok.txt").exists(), "no stage ran"

    result = CliRunner().invoke(app, ["run", "--set", "prepare.source=files", "--set", "prepare.sft=x.jsonl",
                                      "--set", "prepare.preferences=y.jsonl"])
    assert result.exit_code == 2 and "prepare.sft: x.jsonl: no such file" in result.output, result.output


def test_terminal_logs_keep_each_lines_last_redraw():
    assert clean_lines("a\r\x1b[2Kb 50%\r\x1b[2Kb 100%\n\nc\n") == ["b 100%", "c"]


# Stages that fail on their first attempt (`attempts` counts them), each in its own way. Under
# recorded_outcome, as `rlhf stage` runs, they report how they ended; `words` fails the same way every time
# while printing what the old retry matched in logs (the tracker's own connection warnings).
_ATTEMPT = "from pathlib import Path; a = Path('attempts-{name}'); a.write_text(a.read_text() + 'x' if a.exists() else 'x')"
_FIRST_TIME = {
    "refused": "import requests; requests.get('http://127.0.0.1:{port}/api', timeout=30)",
    "killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "words": ("print('MLflow: sending 12 metrics failed (ConnectionError: Connection reset; 503 Server Error; Read "
              "timed out); buffered'); raise ValueError('train.kl_coeff: unknown key')"),
}


@pytest.fixture
def flaky_repo(tmp_path):
    port = free_port()  # nothing listens there
    stages = {}
    for name, fail in _FIRST_TIME.items():
        script = (f"{_ATTEMPT.format(name=name)}\nfrom tasks.execution.outcome import recorded_outcome\n"
                  f"with recorded_outcome():\n    if len(a.read_text()) == 1 or {name == 'words'}:\n"
                  f"        {fail.format(port=port)}\n    Path('{name}.out').write_text('ok')\n")
        (tmp_path / f"{name}.py").write_text(script)
        stages[name] = {"cmd": f"python {name}.py", "deps": [f"{name}.py"], "outs": [f"{name}.out"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return git_dvc_repo(tmp_path)


@pytest.mark.parametrize("name, retried", [("refused", True), ("killed", True), ("words", False)])
def test_a_stage_is_retried_only_for_a_cause_a_retry_can_fix(flaky_repo, in_process_api, name, retried):
    """Retries follow the failure's type (connection refused, killed by a signal), never its log's words."""
    from prefect import flow

    from flows.pipeline import run_dvc_stage

    @flow
    def one_stage() -> tuple[str, str]:
        state = run_dvc_stage.with_options(retry_delay_seconds=0)(name, str(flaky_repo), return_state=True)
        return state.type.value, state.message or ""  # the flow's result, whichever way the stage ended

    kind, message = one_stage()
    attempts = len((flaky_repo / f"attempts-{name}").read_text())
    if retried:
        assert kind == "COMPLETED" and attempts == 2, (attempts, message)
        assert (flaky_repo / f"{name}.out").read_text() == "ok"
    else:
        assert kind == "FAILED" and attempts == 1, (attempts, message)
        assert "not retried: it would fail the same way" in message


def test_a_dvc_failure_records_why_a_retry_may_fix_it(flaky_repo):
    """The stage's own outcome (connection refused, naming the server) reaches the flow's ReproResult."""
    result = repro_stage(flaky_repo, "refused", flaky_repo / "logs" / "refused.log", stage_env({}, terminal=False))
    assert result.returncode != 0 and result.retry_reason.startswith("connection refused (http://127.0.0.1:")
    died = repro_stage(flaky_repo, "killed", flaky_repo / "logs" / "killed.log", stage_env({}, terminal=False))
    assert died.returncode != 0 and "died without a word" in died.retry_reason
    words = repro_stage(flaky_repo, "words", flaky_repo / "logs" / "words.log", stage_env({}, terminal=False))
    assert words.returncode != 0 and words.retry_reason is None and "503 Server Error" in log_tail(words.log)


def test_the_server_scheduler_creates_runs_of_a_scheduled_deployment(tmp_path):
    """The scheduler service itself (not a manual trigger) creates the scheduled runs of prefect.yaml's
    deployments. With SQLAlchemy 2.1 the Prefect 3.8 scheduler failed on every loop ("Can't evaluate bulk
    DML statement") and a nightly deployment never got a run."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import runner_deployments

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    [nightly] = [d for d in spec["deployments"] if d.get("schedules")]
    nightly["schedules"][0]["cron"] = "* * * * *"  # every minute: the scheduler fills its next runs at once
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(spec))
    home = tmp_path / "home"
    home.mkdir()
    fast = {"PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "1"}
    with prefect_server(home, **fast) as url, temporary_settings(updates={PREFECT_API_URL: url}):
        ids = [d.apply() for d in runner_deployments(tmp_path) if d.schedules]
        deadline = time.monotonic() + 45
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids)))
                if runs:
                    break
                time.sleep(1)
        server_log = (home / "server.log").read_text()
    assert runs, f"the scheduler created no run in 45 s; server log:\n{server_log[-3000:]}"
    assert all(r.auto_scheduled and r.state.is_scheduled() for r in runs)
    assert "Can't evaluate bulk DML" not in server_log


SLEEP_MARK = "time.sleep(600.25)"  # a stage that runs until stopped, findable among the processes


@pytest.fixture
def sleeping_repo(tmp_path, mlflow_db_template):
    """A pipeline whose second stage runs until it is stopped, tracking into its own MLflow store."""
    stages = {"ok": {"cmd": "echo fine > ok.txt", "outs": ["ok.txt"]},
              # stopped, it says so in a line and exits, as `rlhf stage` does (no KeyboardInterrupt traceback)
              "slow": {"cmd": "python -c \"import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: "
                              "sys.exit('stage slow: interrupted')); print('slow stage started', flush=True); "
                              f"{SLEEP_MARK}\"",
                       "deps": ["ok.txt"], "outs": ["never.txt"]},
              "after": {"cmd": "echo never > after.txt", "deps": ["never.txt"], "outs": ["after.txt"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (tmp_path / "params.yaml").write_text("base:\n  profile: demo\n  seed: 0\n")
    (tmp_path / ".gitignore").write_text("mlflow.db\nmlartifacts/\n.prefect/\nreports/\n")
    shutil.copy(mlflow_db_template, tmp_path / "mlflow.db")
    with_migrated_prefect_db(tmp_path / ".prefect")
    shutil.copy(REPO / "prefect.yaml", tmp_path / "prefect.yaml")  # what `rlhf serve` serves
    return git_dvc_repo(tmp_path)


def processes_in(directory: Path, kill: bool = False) -> list[str]:
    """Command lines of the processes whose working directory is `directory`; with `kill`, each is SIGKILLed."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")) == directory:
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                if kill:
                    os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue
    return found


def _run_until_slow_stage(cwd: Path, command: list, env: dict, out) -> tuple[subprocess.Popen, list[str]]:
    """`command` in its own session, its output read into the returned list (and `out`, when given)."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if out is not None:
                out.write(line)
    proc.reader = threading.Thread(target=read, daemon=True)  # ends at the output's end
    proc.reader.start()
    return proc, lines


def _wait_for(condition, proc: subprocess.Popen, lines: list[str]) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-5000:]
        time.sleep(0.2)


def _cancel_from_the_prefect_ui(sleeping_repo: Path, api: str, tmp_path_factory) -> tuple[object, list, list, str]:
    """`rlhf serve`, a run of its manual deployment, then Cancel as the UI's button does (the flow run set to
    Cancelling; the runner delivers it as SIGTERM). Returns the flow run, its logs, its task runs, and what
    `rlhf serve` printed."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    home = tmp_path_factory.mktemp("serve-cancel")
    with temporary_settings(updates={PREFECT_API_URL: api}), (home / "serve.log").open("w", buffering=1) as log:
        serve, lines = _run_until_slow_stage(sleeping_repo, [BIN / "rlhf", "serve"],
                                             base_env(PREFECT_API_URL=api, PREFECT_HOME=str(home)), log)
        try:
            wait_for_deployment("rlhf-pipeline/manual", serve, home / "serve.log")
            run = run_deployment("rlhf-pipeline/manual", parameters={"overrides": ["base.seed=4"]}, timeout=0)
            _wait_for(lambda: any("slow stage started" in line for line in lines), serve, lines)
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(run.id, Cancelling(message="cancelled from the UI"))
                _wait_for(lambda: client.read_flow_run(run.id).state.is_final(), serve, lines)
                # the flow run's process has ended (its last log records sent): only `rlhf serve` is left
                _wait_for(lambda: all(p.rstrip().endswith("rlhf serve") for p in processes_in(sleeping_repo)),
                          serve, lines)
                run = client.read_flow_run(run.id)
                logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
                tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        finally:
            serve.terminate()
            serve.wait(timeout=60)
    return run, logs, tasks, "".join(lines)


@pytest.mark.parametrize("how", ["ctrl-c", *(pytest.param(h, marks=pytest.mark.slow) for h in ("sigterm", "prefect-ui"))])
def test_a_signal_stops_the_run_cleanly(sleeping_repo, how, request, tmp_path_factory):
    """Ctrl-C (SIGINT to the terminal's whole process group), a worker's SIGTERM (to `rlhf run` alone), or
    Cancel in the Prefect UI (a served run; the runner sends SIGTERM) in the middle of a stage: the stage
    stops, the Prefect run ends Cancelled and reads as a cancellation (a warning naming the stage, no ERROR, no
    traceback), the MLflow run KILLED, the run record names the failure, the lock is free, no process is left."""

    from mlflow import MlflowClient

    params_before = (sleeping_repo / "params.yaml").read_text()
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    if how == "prefect-ui":
        run, logs, tasks, output = _cancel_from_the_prefect_ui(sleeping_repo, request.getfixturevalue("prefect_api"),
                                                               tmp_path_factory)
        flow_runs = [(run.state.type.value, run.name)]
        task_runs = {t.name: t.state.type.value for t in tasks}
        assert not [log.message for log in logs if log.level >= 40], "an ERROR in the flow run's log"
        assert not [log.message for log in logs if "Traceback" in log.message or "CancelledRun" in log.message]
        assert any(log.level in (20, 30) and "stage 'slow' stopped by SIGTERM" in log.message for log in logs), \
            [log.message for log in logs]
        assert "Traceback" not in output and "CancelledRun" not in output and " ERROR " not in output, output
    else:
        proc, lines = _run_until_slow_stage(sleeping_repo, [BIN / "rlhf", "run", "--set", "base.seed=4"],
                                            base_env(), None)
        _wait_for(lambda: any("slow stage started" in line for line in lines), proc, lines)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what a terminal does on Ctrl-C
        else:
            proc.send_signal(sig)  # what a Prefect worker does to the flow's process
        # it stops in seconds (the stage's grace is 5 s); one that hung in the 600 s stage fails the deadline
        proc.wait(timeout=60)
        proc.reader.join(timeout=60)  # its last lines read
        output = "".join(lines)
        assert proc.returncode == 128 + sig, output
        assert output.count("interrupted:") == 1 and f"stopped by {sig.name}" in output, output
        assert "Traceback" not in output, output
        with sqlite3.connect(sleeping_repo / ".prefect" / "prefect.db") as db:
            flow_runs = db.execute("select state_type, name from flow_run").fetchall()
            task_runs = dict(db.execute("select name, state_type from task_run").fetchall())

    [record] = [json.loads(p.read_text()) for p in (sleeping_repo / "reports" / "runs").glob("*.json")]
    assert record["status"] == "KILLED" and f"stage 'slow' stopped by {sig.name}" in record["failure"]
    assert [s["stage"] for s in record["stages"]] == ["ok"]
    mlflow_run = MlflowClient(f"sqlite:///{sleeping_repo / 'mlflow.db'}").get_run(record["mlflow_run_id"])
    assert mlflow_run.info.status == "KILLED"
    assert [state for state, _ in flow_runs] == ["CANCELLED"], flow_runs
    # named by profile, algorithm, overrides and start time, as the MLflow run, not at random
    assert re.fullmatch(r"demo-ppo-seed=4-\d{4}-\d{6}", flow_runs[0][1]) and mlflow_run.info.run_name == flow_runs[0][1]
    assert task_runs.get("slow") == "CANCELLED", task_runs
    with workspace_lock(sleeping_repo, wait_s=0):  # released
        pass
    assert not [p for p in processes_in(sleeping_repo) if SLEEP_MARK in p or "uvicorn" in p], "processes left"
    assert not (sleeping_repo / "after.txt").exists()
    assert (sleeping_repo / "params.yaml").read_text() == params_before, "the override was for this run only"


def test_the_evaluation_artifact_shows_gold_scores_where_the_world_has_them(tmp_path):
    from flows.reports import evaluation

    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps({"win_rate_gold": 0.75, "win_rate_rm": 0.9}))
    row = {"prompt": "p", "completion": "c", "ref_completion": "r", "score_rm": 1.5, "ref_score_rm": 0.5,
           "score_gold": 0.8, "ref_score_gold": 0.2}
    (tmp_path / "reports" / "eval").mkdir(parents=True)
    (tmp_path / "reports" / "eval" / "completions.jsonl").write_text(json.dumps(row) + "\n")
    text = evaluation(tmp_path)
    assert "| prompt | policy | reference | rm | ref_rm | gold | ref_gold |" in text and "| 0.8 | 0.2 |" in text, text


def test_params_diff_and_reset(failing_repo, monkeypatch, capsys):
    monkeypatch.chdir(failing_repo)
    runner = CliRunner()
    assert "params.yaml is as committed" in runner.invoke(app, ["params", "diff"]).output
    path = failing_repo / "params.yaml"
    committed = path.read_text()
    path.write_text(committed.replace("seed: 0", "seed: 5"))
    assert "base.seed: 0 -> 5" in runner.invoke(app, ["params", "diff"]).output
    say_local_edits(failing_repo)  # what `rlhf run` says before Prefect starts
    assert "note: params.yaml differs from the committed one and this run uses it: base.seed 0 -> 5" in \
        capsys.readouterr().err
    reset = runner.invoke(app, ["params", "reset"])
    assert reset.exit_code == 0 and "dropped:" in reset.output and "base.seed: 0 -> 5" in reset.output
    assert path.read_text() == committed


def test_the_temporary_server_starts_beside_the_runs_own_preparation(tmp_path, monkeypatch):
    """`rlhf run` imports its flow and opens the MLflow store while Prefect's temporary server starts
    (`meanwhile`); with a server named by PREFECT_API_URL it just does it. A failure (or a Ctrl-C) during that
    preparation stops the half-started server: no process is left."""
    from flows.prefect_env import temporary_server_if_needed

    calls = []
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    with temporary_server_if_needed(meanwhile=lambda: calls.append("ready")) as url:
        assert url is None and calls == ["ready"]

    monkeypatch.delenv("PREFECT_API_URL")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / ".prefect"))
    monkeypatch.chdir(tmp_path)

    def servers() -> list[str]:
        """Our own uvicorn children (by parent pid: a cwd can change under a busy test worker)."""
        found = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == os.getpid() and "uvicorn" in cmdline:
                found.append(cmdline)
        return found

    def failing():
        deadline = time.monotonic() + 30  # its /proc entry can lag on a loaded machine: a bound, not a timing check
        while not servers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert servers(), "the server starts before `meanwhile` runs"
        raise RuntimeError("preparation failed")

    with pytest.raises(RuntimeError, match="preparation failed"), temporary_server_if_needed(meanwhile=failing):
        pytest.fail("no run without its preparation")
    assert not servers(), "server left behind"
    assert not [p for p in processes_in(tmp_path) if "uvicorn" in p], "server left behind"


@pytest.mark.slow
def test_the_temporary_server_exits_when_its_run_is_killed(tmp_path):
    """The temporary server runs in its own session, out of reach of a Ctrl-C meant for the run; a kill -9 of
    the run (the OOM killer, a CI timeout) must not leave it serving for good: it stops once its parent is gone."""
    script = ("import sys, time\n"
              "from flows.prefect_env import temporary_server_if_needed\n"
              "with temporary_server_if_needed() as url:\n"
              "    print(url, flush=True)\n"
              "    time.sleep(600)\n")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    run = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = run.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert [p for p in processes_in(tmp_path) if "uvicorn" in p], "the server runs beside the run"
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + 60
    while [p for p in processes_in(tmp_path) if "uvicorn" in p] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in processes_in(tmp_path, kill=True) if "uvicorn" in p], "server orphaned by a kill -9"


@pytest.fixture
def gated_repo(tmp_path, mlflow_db_template):
    """A pipeline whose middle stage waits for a file `go` (the test's cue), then finishes."""
    (tmp_path / "gate.py").write_text("import pathlib, time\nprint('gated stage started', flush=True)\n"
                                      "while not pathlib.Path('go').exists():\n    time.sleep(0.2)\n"
                                      "pathlib.Path('gated.txt').write_text('done')\n")
    stages = {"ok": {"cmd": "echo fine > ok.txt", "outs": ["ok.txt"]},
              "gated": {"cmd": "python gate.py", "deps": ["ok.txt", "gate.py"], "outs": ["gated.txt"]},
              "after": {"cmd": "cp gated.txt after.txt", "deps": ["gated.txt"], "outs": ["after.txt"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (tmp_path / "params.yaml").write_text("base:\n  profile: demo\n  seed: 0\n")
    (tmp_path / ".gitignore").write_text("mlflow.db\nmlartifacts/\n.prefect/\nreports/\ngo\n")
    shutil.copy(mlflow_db_template, tmp_path / "mlflow.db")
    with_migrated_prefect_db(tmp_path / ".prefect")
    return git_dvc_repo(tmp_path)


@pytest.mark.slow
def test_the_prefect_server_dying_mid_run_loses_no_work(gated_repo, tmp_path_factory):
    """A Prefect server killed while a stage runs: the run goes on without it, every stage completes, the run record
    and MLflow say FINISHED, params.yaml is restored, the lock released, and `rlhf run` exits 0 saying what
    happened, without a traceback; the next run, on a server again, finds every stage unchanged."""
    import psutil
    from mlflow import MlflowClient

    params_before = (gated_repo / "params.yaml").read_text()
    with prefect_server(tmp_path_factory.mktemp("dying-prefect")) as api:
        # Prefect's client retries a dead server 5 times with backoff (minutes here); once is the same story
        proc, lines = _run_until_slow_stage(gated_repo, [BIN / "rlhf", "run", "--set", "base.seed=4"],
                                            base_env(PREFECT_API_URL=api, PREFECT_CLIENT_MAX_RETRIES="1"), None)
        _wait_for(lambda: any("gated stage started" in line for line in lines), proc, lines)
        server = psutil.Process(SERVERS[api].pid)
        for each in [*server.children(recursive=True), server]:  # kill -9 of the server and its workers
            each.kill()
        (gated_repo / "go").write_text("")  # the stage may finish now
        proc.wait(timeout=600)
        proc.reader.join(timeout=60)
    output = "".join(lines)
    assert proc.returncode == 0, output[-5000:]
    assert f"{api} stopped answering during the run" in output and "ended FINISHED" in output, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    [record] = [json.loads(p.read_text()) for p in (gated_repo / "reports" / "runs").glob("*.json")]
    assert record["status"] == "FINISHED" and [s["stage"] for s in record["stages"]] == ["ok", "gated", "after"]
    assert (gated_repo / "after.txt").read_text() == "done"
    assert MlflowClient(f"sqlite:///{gated_repo / 'mlflow.db'}").get_run(record["mlflow_run_id"]).info.status == \
        "FINISHED"
    assert (gated_repo / "params.yaml").read_text() == params_before
    with workspace_lock(gated_repo, wait_s=0):  # released
        pass
    assert not processes_in(gated_repo), "no process left"

    with prefect_server(tmp_path_factory.mktemp("back-prefect")) as api:  # the server is back (here, a new one)
        again = subprocess.run([BIN / "rlhf", "run", "--set", "base.seed=4"], cwd=gated_repo, timeout=600,
                               env=base_env(PREFECT_API_URL=api), capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    second = json.loads(max((gated_repo / "reports" / "runs").glob("*.json")).read_text())
    assert second["status"] == "FINISHED" and not any(s["ran"] for s in second["stages"])
