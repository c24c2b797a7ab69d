"""The pipeline as a client of servers, without the server stack (these run in `make test`):

- a `PREFECT_API_URL` or `MLFLOW_TRACKING_URI` that does not answer fails `rlhf run` (and the flow's MLflow run)
  before any stage, with one message naming the variable; a URL's password never shows;
- metrics logged to a tracking server that goes down and comes back are all there (buffered and retried in a
  background thread), and training never waits on the dead server;
- a stage that ends while the server is down loses nothing: params, result, artifacts, tables and its status
  arrive when it is back; one that never comes back fails the stage naming the server and what was not sent, and
  the rerun logs everything; calls that must happen now (registering a model) wait for a restarting server.

The tracking server is MLflow's own server app (`mlflow.server.app`, the REST handlers `mlflow server` runs) on a
sqlite store, served on a loopback port by werkzeug in a thread: stopping it closes the port (connection refused,
as when a server process dies), and a new one on the same port is the restart, in milliseconds instead of the
~10-20 s of a `mlflow server` process here. tests/test_server.py does the same to a real `mlflow server` process
mid-training (`infra/stack.sh stop mlflow` / `start mlflow`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flows.servers import ServerUnreachable, check_mlflow, check_prefect, check_servers, redact
from tasks.execution.launcher import free_port
from tasks.tracking.mlflow_tracker import MlflowTracker

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LATE_REPLY_S, CLIENT_TIMEOUT_S = 4, "2"  # a reply the server sends after the client stopped waiting


class TrackingServer:
    """MLflow's tracking server app on a sqlite store, on a fixed loopback port; stop() and start() again."""

    def __init__(self, db: Path, artifacts: Path):
        self.port, self.db, self.artifacts = free_port(), db, artifacts
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.late: dict[str, int] = {}  # API path -> how many more of its replies come after the client gave up

    def _app(self, environ, start_response):
        from mlflow.server import app

        reply = app(environ, start_response)  # the server does the work...
        path = environ["PATH_INFO"]
        if self.late.get(path, 0) > 0:
            self.late[path] -= 1
            time.sleep(LATE_REPLY_S)  # ...and its reply is lost: it comes after the client's timeout
        return reply

    def start(self) -> None:
        from werkzeug.serving import make_server

        self._server = make_server("127.0.0.1", self.port, self._app, threaded=True)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()  # the port is closed: clients get "connection refused"

    def outage(self, seconds: float) -> tuple[Callable[[], None], threading.Thread]:
        """(begin, comeback): begin() stops the server and has it start again `seconds` later; join comeback to
        wait for that. The restart counts from the stop, whenever the stop comes (a fixed timer started before
        would restart a server still running, on a busy machine, and leave it down)."""
        stopped = threading.Event()

        def begin() -> None:
            self.stop()
            stopped.set()

        def come_back() -> None:
            if stopped.wait(timeout=600):
                time.sleep(seconds)
                self.start()

        comeback = threading.Thread(target=come_back, daemon=True)
        comeback.start()
        return begin, comeback


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory, mlflow_db_template):
    from mlflow.server import handlers

    root = tmp_path_factory.mktemp("tracking-server")
    shutil.copy(mlflow_db_template, root / "mlflow.db")
    server = TrackingServer(root / "mlflow.db", root / "artifacts")
    # the store the server app's handlers use (what `mlflow server --backend-store-uri` sets up)
    saved = handlers._tracking_store
    handlers._tracking_store = handlers._tracking_store_registry.get_store(f"sqlite:///{server.db}", str(server.artifacts))
    server.start()
    yield server
    server.stop()
    handlers._tracking_store = saved


@pytest.fixture
def fast_client(monkeypatch):
    """No retries inside MLflow's HTTP client (it would retry a dead server for minutes in one call): what is
    proven here is the tracker's own buffering and retrying."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def _new_run(url: str) -> tuple:
    from mlflow import MlflowClient

    client = MlflowClient(url)
    exp = client.create_experiment(f"retry-{time.monotonic_ns()}")
    return client, client.create_run(exp).info.run_id


def wait_for(condition, what: str, deadline_s: float = 120):
    """Poll `condition()` until it holds; fail naming `what` after a generous deadline (not a timing check)."""
    give_up = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < give_up, f"not within {deadline_s} s: {what}"
        time.sleep(0.05)


def test_metrics_survive_a_tracking_server_that_drops_and_comes_back(tracking_server, fast_client, caplog):
    client, run_id = _new_run(tracking_server.url)
    tracker = MlflowTracker(client, run_id, flush_every=2, background=True, server=tracking_server.url)
    keys = ("objective/kl", "objective/scores", "loss/policy_avg")
    for step in range(1, 11):
        tracker.log_metrics({k: step / 10 for k in keys}, step)
    wait_for(lambda: len(client.get_metric_history(run_id, "objective/kl")) == 10, "sent while the server is up")

    tracking_server.stop()
    for step in range(11, 41):  # "training" goes on while the server is down
        tracker.log_metrics({k: step / 10 for k in keys}, step)
    # log_metrics returned with its batches still queued: it never waits on the server (no clock needed)
    assert tracker._sender._queue, "the batches logged while the server is down are waiting, not sent"
    wait_for(lambda: "buffered, retried until the server takes them" in caplog.text, "the outage's first failure")
    for step in range(41, 45):  # logged once the outage is known: each batch says it waits
        tracker.log_metrics({k: step / 10 for k in keys}, step)
    assert "server down: 6 more metrics of run" in caplog.text
    tracking_server.start()
    tracker.close()  # waits until the buffer has drained

    assert tracker.errors == 0
    for key in keys:
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(range(1, 45)), key
        assert {m.step: m.value for m in history}[37] == pytest.approx(3.7)
    # it said when the server came back and the backlog had drained
    assert re.search(r"takes metrics of run \w+ again after \d+ s and \d+ failed tries; backlog drained: "
                     r"\d+ batches \(\d+ metrics\) sent, none lost", caplog.text), caplog.text


def test_outage_lines_carry_no_credentials():
    from tasks.tracking.mlflow_tracker import _describe

    err = ConnectionError("API request to http://alice:s3cret@127.0.0.1:5000/api/2.0/mlflow/runs/log-batch failed\nmore")
    assert _describe(err) == ("ConnectionError: API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/log-batch "
                              "failed")


def test_a_server_that_never_comes_back_fails_the_close_naming_what_was_not_sent(tracking_server, fast_client,
                                                                                 monkeypatch):
    from tasks.tracking.mlflow_tracker import TrackingUnavailable

    client, run_id = _new_run(tracking_server.url)
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "2")
    tracker = MlflowTracker(client, run_id, flush_every=5, background=True, server=tracking_server.url)
    tracking_server.stop()
    try:
        for step in range(1, 11):
            tracker.log_metrics({"objective/kl": 0.1, "objective/scores": 1.0}, step)
        tracker.log_params({"train": {"kl_coef": 0.05}})
        tracker.write("the run's end (FINISHED)", client.set_terminated, run_id, "FINISHED")
        with pytest.raises(TrackingUnavailable) as lost:
            tracker.close()
    finally:
        tracking_server.start()
    message = str(lost.value)
    assert f"MLflow at {tracking_server.url} did not take run {run_id}'s writes within 2 s" in message
    assert "Not sent: 20 metrics, 1 params, the run's end (FINISHED)" in message and "connection refused" in message
    assert client.get_run(run_id).info.status == "RUNNING" and not client.get_run(run_id).data.params


@pytest.fixture
def served_workspace(workspace, tracking_server, fast_client, monkeypatch):
    """The pipeline workspace tracking into the tracking server (as a worker's stages do)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"outage-{time.monotonic_ns()}")
    return workspace


def _evaluate_stand_in(root: Path, outage=None):
    """The evaluate stage's outputs as dvc.yaml declares them; `outage()` runs as the stage ends."""
    from rlhf_core.jsonio import write_json, write_jsonl

    def evaluate() -> dict:
        write_jsonl(root / "reports" / "eval" / "completions.jsonl", [{"prompt": "p", "completion": "c"}])
        write_json(root / "metrics" / "eval.json", {"win_rate_rm": 0.75})
        if outage:
            outage()
        return {"win_rate_rm": 0.75}

    return evaluate


def _stage_runs(client, name: str) -> list:
    from tasks.tracking.mlflow_store import experiment_id

    return client.search_runs([experiment_id(client)], f"tags.`rlhf.stage` = '{name}'")


def test_a_stage_ending_while_the_server_is_down_loses_nothing(served_workspace, tracking_server, caplog):
    """The server goes down as the stage ends and comes back a few seconds later: its params, result, artifacts,
    table and FINISHED status all arrive (all queued, retried, and waited for before the stage returns)."""
    from tasks.parameters.params import load_params
    from tasks.tracking.mlflow_store import get_client
    from tasks.tracking.stage_tracking import track_stage

    root = served_workspace
    begin, comeback = tracking_server.outage(3.0)  # a restart 3 s after the stop, not a timing assertion
    metrics = track_stage("evaluate", root, load_params(root), _evaluate_stand_in(root, begin))
    comeback.join()
    assert metrics == {"win_rate_rm": 0.75}
    client = get_client(root)
    [run] = _stage_runs(client, "evaluate")
    assert run.info.status == "FINISHED" and run.data.metrics == {"win_rate_rm": 0.75}
    assert run.data.params["evaluate.num_prompts"] and run.data.params["base.profile"] == "demo"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "reports/eval")} == {
        "reports/eval/completions.jsonl"}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "metrics")} == {"metrics/eval.json"}
    assert client.list_artifacts(run.info.run_id, "tables/reports/eval"), "the completions table"
    assert "buffered, retried until the server takes them" in caplog.text  # the outage was met, not missed


def test_a_stage_whose_server_never_comes_back_fails_naming_it_and_reruns_without_loss(
        served_workspace, tracking_server, monkeypatch):
    from tasks.execution.transient import transient_cause
    from tasks.parameters.params import load_params
    from tasks.tracking.mlflow_store import get_client
    from tasks.tracking.mlflow_tracker import TrackingUnavailable
    from tasks.tracking.stage_tracking import track_stage

    root = served_workspace
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "3")
    try:
        with pytest.raises(TrackingUnavailable) as lost:
            track_stage("evaluate", root, load_params(root), _evaluate_stand_in(root, tracking_server.stop))
    finally:
        tracking_server.start()
    message = str(lost.value)
    assert f"MLflow at {tracking_server.url}" in message and "Not sent:" in message
    assert "artifacts reports/eval" in message and "the run's end (FINISHED)" in message
    assert str(transient_cause(lost.value)).startswith("connection refused"), "the flow retries it"
    assert (root / "metrics" / "eval.json").is_file(), "the stage's outputs are kept"

    track_stage("evaluate", root, load_params(root), _evaluate_stand_in(root))  # the flow's retry
    finished = [r for r in _stage_runs(get_client(root), "evaluate") if r.info.status == "FINISHED"]
    assert len(finished) == 1 and finished[0].data.metrics == {"win_rate_rm": 0.75}
    assert get_client(root).list_artifacts(finished[0].info.run_id, "reports/eval")


def test_calls_that_must_happen_now_wait_for_a_restarting_server(tracking_server, fast_client, monkeypatch):
    """Registering a model (the register stage's client calls) against a server that is restarting: retried until
    it answers; a server that never does fails naming itself and the call."""
    from mlflow import MlflowClient

    from tasks.tracking.mlflow_tracker import RetryingClient, TrackingUnavailable

    client = RetryingClient(MlflowClient(tracking_server.url), tracking_server.url)
    name = f"policy-{time.monotonic_ns()}"
    tracking_server.stop()
    back = threading.Timer(2.0, tracking_server.start)
    back.start()
    client.create_registered_model(name)  # retried through the restart
    back.join()
    assert MlflowClient(tracking_server.url).get_registered_model(name).name == name

    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "2")
    tracking_server.stop()
    try:
        with pytest.raises(TrackingUnavailable, match=f"MLflow at {tracking_server.url} did not answer within 2 s "
                                                      r".*connection refused.*: set_registered_model_alias not done"):
            client.set_registered_model_alias(name, "champion", "1")
    finally:
        tracking_server.start()
    with pytest.raises(Exception, match="RESOURCE_DOES_NOT_EXIST|not found|does not exist"):
        client.set_registered_model_alias(name, "champion", "7")  # a refusal is not retried: raised at once


def test_a_creation_whose_reply_is_lost_is_made_once(tracking_server, fast_client, monkeypatch, tmp_path,
                                                    make_policy, tokenizer):
    """The server makes the model, the run or the version, and its reply is lost (a timeout): the retry finds
    what the lost try made instead of failing on RESOURCE_ALREADY_EXISTS or making a second one."""
    from mlflow import MlflowClient

    from tasks.stages.register import log_policy
    from tasks.tracking.mlflow_tracker import RetryingClient
    from tasks.tracking.stage_tracking import MlflowStageRun

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", CLIENT_TIMEOUT_S)
    plain, url = MlflowClient(tracking_server.url), tracking_server.url
    client = RetryingClient(plain, url)
    name = f"policy-{time.monotonic_ns()}"
    tracking_server.late["/api/2.0/mlflow/registered-models/create"] = 1
    assert client.create_registered_model(name).name == name
    assert tracking_server.late["/api/2.0/mlflow/registered-models/create"] == 0, "the reply was lost"

    exp = plain.create_experiment(f"lost-{time.monotonic_ns()}")
    tracking_server.late["/api/2.0/mlflow/runs/create"] = 1
    run = client.create_run(exp, run_name="once", tags={"kept": "yes"})
    assert [r.info.run_id for r in plain.search_runs([exp])] == [run.info.run_id]
    assert run.data.tags["kept"] == "yes" and run.info.run_name == "once"

    make_policy().save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    stage_run = MlflowStageRun(plain, run.info.run_id, exp, url)
    tracking_server.late["/api/2.0/mlflow/model-versions/create"] = 1
    version = log_policy(stage_run, tmp_path / "policy", name, "a card")
    assert tracking_server.late["/api/2.0/mlflow/model-versions/create"] == 0, "the reply was lost"
    assert [v.version for v in plain.search_model_versions(f"name='{name}'")] == [version] == ["1"]


def test_a_local_store_is_written_in_line(mlflow_root):
    """The local sqlite path is unchanged: no thread, each flush written before log_metrics returns."""
    from tasks.tracking.mlflow_store import get_client
    from tasks.tracking.stage_tracking import MlflowStageRun

    client = get_client(mlflow_root)
    run_id = client.create_run(client.create_experiment("local")).info.run_id
    stage_run = MlflowStageRun(client, run_id, "0", f"sqlite:///{mlflow_root / 'mlflow.db'}")
    assert stage_run.tracker._sender is None
    threads = threading.active_count()
    stage_run.tracker.log_metrics({"a": 1.0}, 1)
    stage_run.tracker.flush()
    assert len(client.get_metric_history(run_id, "a")) == 1 and threading.active_count() == threads
    assert MlflowStageRun(client, run_id, "0", "http://127.0.0.1:5000").tracker._sender is not None


# ------------------------------------------------------------------------------------------------ fail fast
def _closed_port_url(path: str = "") -> str:
    return f"http://127.0.0.1:{free_port()}{path}"  # nothing listens on it


def test_run_fails_before_any_stage_on_an_unreachable_prefect_or_mlflow(workspace, monkeypatch):
    import os

    prefect_url, mlflow_url = _closed_port_url("/api"), _closed_port_url()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING", "RLHF_"))}
    for variables, names in (({"PREFECT_API_URL": prefect_url}, ["PREFECT_API_URL"]),
                             ({"MLFLOW_TRACKING_URI": mlflow_url}, ["MLFLOW_TRACKING_URI"]),
                             ({"PREFECT_API_URL": prefect_url, "MLFLOW_TRACKING_URI": mlflow_url},
                              ["PREFECT_API_URL", "MLFLOW_TRACKING_URI"])):
        # seconds, not MLflow's minutes of retries: a hang fails on the timeout
        # a server that is down for now is waited for (RLHF_MLFLOW_RETRY_S); 2 s here
        proc = subprocess.run([BIN / "rlhf", "run"], cwd=workspace, env={**env, **variables, "RLHF_MLFLOW_RETRY_S": "2"},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        for name in names:
            assert f"{name}={variables[name]} is not reachable" in proc.stderr, proc.stderr
        assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert not (workspace / "data").exists() and not (workspace / "reports").exists()  # no stage ran
        assert not (workspace / ".prefect").exists()  # nor a temporary Prefect server


@pytest.mark.timeout(120)  # quickly, not after MLflow's minutes of retries
def test_the_flow_fails_before_any_stage_when_its_tracking_server_is_down(workspace, monkeypatch):
    """Inside the flow (a worker's run, where `rlhf run` did not check): the MLflow pipeline run is opened before
    the first stage, and a dead server fails it there, quickly, as a TrackingError the flow reports."""
    from flows.pipeline_run import start_pipeline_run
    from tasks.tracking.mlflow_store import TrackingError

    url = _closed_port_url()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "2")  # waited for that long (a server restarting), then it fails
    with pytest.raises(TrackingError, match=f"MLFLOW_TRACKING_URI={url} is not reachable"):
        start_pipeline_run(workspace, None, [])


def test_credentials_and_non_servers(tracking_server, monkeypatch):
    from http.server import BaseHTTPRequestHandler, HTTPServer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server.url)
    check_mlflow()  # a real tracking server: fine
    monkeypatch.setenv("RLHF_TRACKING", "off")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _closed_port_url())
    check_mlflow()  # tracking off: the URI is not used, so not checked
    monkeypatch.delenv("RLHF_TRACKING")

    class Teapot(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(401 if self.path.startswith("/api/2.0") else 418)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = HTTPServer(("127.0.0.1", 0), Teapot)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        url = f"http://someone:hunter2@127.0.0.1:{other.server_port}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "rlhf")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-value")
        with pytest.raises(ServerUnreachable) as refused:
            check_mlflow()
        assert "refused MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (HTTP 401)" in str(refused.value)
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{other.server_port}/api")
        with pytest.raises(ServerUnreachable) as not_prefect:
            check_servers()
        message = str(not_prefect.value)
        assert "answered HTTP 418, not a Prefect API" in message and "MLFLOW_TRACKING_URI=" in message
        assert "hunter2" not in message and "s3cret-value" not in message and "someone" not in message
        monkeypatch.setenv("PREFECT_API_URL", "127.0.0.1:4200")
        with pytest.raises(ServerUnreachable, match="PREFECT_API_URL=127.0.0.1:4200: expected an http"):
            check_prefect()
    finally:
        other.shutdown()
    assert redact("http://u:p@host:5000/x") == "http://host:5000/x" and redact("http://host/x") == "http://host/x"
