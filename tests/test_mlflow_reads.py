"""The flow's and the sweep's MLflow reads, and the check `rlhf run` / `rlhf sweep` make first, against a tracking
server that cannot answer for a while: MLflow's server app (tests/test_server_client.py's `tracking_server`) behind
a real HTTP gateway that answers 503 as a proxy does while its server restarts (tests/mlflow_gateway.py), or
stopped and started again on its port (connection refused meanwhile).

- `check_mlflow` waits for a server that is restarting, saying so, up to RLHF_MLFLOW_RETRY_S; one that is wrong
  (answers but not as MLflow does, refuses the credentials) fails at once, in one line;
- a sweep reading back a point run elsewhere (its figures, its per-prompt scores), the flow's link to its run and
  its registry line: each read retried through the 503s instead of failing or coming back empty.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from mlflow_gateway import Gateway
from test_server_client import fast_client, tracking_server  # noqa: F401 (fixtures)

from flows.servers import ServerUnreachable, check_mlflow


@pytest.fixture
def gateway(tracking_server, fast_client, monkeypatch):  # noqa: F811
    """The client talks to MLflow through the gateway; MLflow's own retries off (fast_client): what is proven
    is ours, as for an outage longer than MLflow's retries."""
    gateway = Gateway(tracking_server.url)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", gateway.url)
    yield gateway
    gateway.close()


def test_a_restarting_tracking_server_is_waited_for(tracking_server, gateway, monkeypatch, capsys):  # noqa: F811
    gateway.unavailable = 2  # a proxy in front answers 503 while the server behind it restarts
    check_mlflow()
    assert gateway.unavailable == 0 and gateway.forwarded, "the check went on until the server answered"
    waited = capsys.readouterr().err
    assert waited.count("waiting: ") == 1 and f"MLflow at {gateway.url}" in waited and "503" in waited, waited
    assert "RLHF_MLFLOW_RETRY_S" in waited, waited

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server.url)  # the server itself, stopped: connection refused
    begin, comeback = tracking_server.outage(2.0)
    begin()
    check_mlflow()
    comeback.join()
    assert "Connection refused" in capsys.readouterr().err


def test_a_server_that_stays_unavailable_fails_after_the_limit_naming_it(gateway, monkeypatch):
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "2")
    gateway.unavailable = 10 ** 6
    with pytest.raises(ServerUnreachable) as down:
        check_mlflow()
    assert f"MLFLOW_TRACKING_URI={gateway.url} is not reachable: no answer within 2 s (RLHF_MLFLOW_RETRY_S; " \
           "last: HTTP 503" in str(down.value), down.value


class _NotMlflow(BaseHTTPRequestHandler):
    """A web server that is not MLflow: what it answers to the API is set per test."""

    status, body = 200, b"<html>a dashboard</html>"

    def do_GET(self):  # noqa: N802
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


WRONG = {200: "answered HTTP 200 but not MLflow's JSON to a search of experiments: not an MLflow tracking server",
         404: "answered HTTP 404 to a search of experiments: not an MLflow tracking server",
         401: "needs credentials and MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD are unset (HTTP 401)",
         403: "needs credentials and MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD are unset (HTTP 403)"}


@pytest.mark.timeout(120)  # a wrong server must not be waited for (RLHF_MLFLOW_RETRY_S is 600 here)
def test_a_wrong_server_fails_at_once_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RLHF_MLFLOW_RETRY_S", "600")
    for status, said in WRONG.items():
        other = HTTPServer(("127.0.0.1", 0), type("Handler", (_NotMlflow,), {"status": status}))
        threading.Thread(target=other.serve_forever, daemon=True).start()
        try:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{other.server_port}")
            with pytest.raises(ServerUnreachable) as wrong:
                check_mlflow()
        finally:
            other.shutdown()
            other.server_close()
        message = str(wrong.value)
        assert said in message and "\n" not in message, message
        assert "waiting" not in capsys.readouterr().err, f"HTTP {status} was waited for"


def _point_run_elsewhere(url: str, root) -> tuple[str, str, dict, dict]:
    """What a worker leaves in MLflow for one sweep point: the sweep run, the point's pipeline run (eval/* metrics)
    under it, and its evaluate stage run with reports/eval/scores.json. (sweep id, pipeline id, figures, scores)"""
    from mlflow import MlflowClient

    from flows.pipeline_run import EXPERIMENT_TAG
    from tasks.reports.frontier_uncertainty import EVAL_SCORES

    client = MlflowClient(url)
    exp = client.create_experiment(f"sweep-reads-{id(root)}-{root.name}")
    sweep = client.create_run(exp).info.run_id
    pipeline = client.create_run(exp, tags={"mlflow.parentRunId": sweep, EXPERIMENT_TAG: "sweep-k-a"}).info.run_id
    figures = {"win_rate_gold": 0.75, "mean_kl": 1.5}
    for name, value in figures.items():
        client.log_metric(pipeline, f"eval/{name}", value)
    evaluate = client.create_run(exp, tags={"mlflow.parentRunId": pipeline, "rlhf.stage": "evaluate"}).info.run_id
    scores = {"gold": [0.5, 1.0], "ref_gold": [0.25, 0.5]}
    (root / EVAL_SCORES).parent.mkdir(parents=True)
    (root / EVAL_SCORES).write_text(json.dumps(scores))
    client.log_artifacts(evaluate, str((root / EVAL_SCORES).parent), "reports/eval")
    for run in (evaluate, pipeline):
        client.set_terminated(run, "FINISHED")
    return sweep, pipeline, figures, scores


def test_a_sweep_reads_a_point_back_through_a_restarting_server(tracking_server, gateway, tmp_path):  # noqa: F811
    from flows.pipeline_run import run_url
    from flows.sweep import _figures_from_mlflow
    from tasks.reports.frontier_uncertainty import PER_PROMPT

    sweep, pipeline, figures, scores = _point_run_elsewhere(tracking_server.url, tmp_path)
    gateway.flaky = True  # every other request meets a 503: each read of the point does, once
    read = _figures_from_mlflow(tmp_path, sweep, "sweep-k-a")
    assert read == {**figures, PER_PROMPT: scores}
    reads = len(gateway.forwarded)
    assert reads >= 3 and gateway.answered_503 >= reads, (reads, gateway.answered_503)
    assert run_url(pipeline, tmp_path).endswith(f"/runs/{pipeline}?workflowType=machine_learning"), \
        "the flow's link to its run, read through the 503"


@pytest.fixture
def registry_served(tracking_server, monkeypatch):  # noqa: F811
    """The server app's registry on its sqlite store (what `mlflow server --backend-store-uri` sets up; left
    alone, the app makes it lazily from whatever MLFLOW_TRACKING_URI the test has set)."""
    from mlflow.server import handlers

    store = handlers._model_registry_store_registry.get_store(f"sqlite:///{tracking_server.db}")
    monkeypatch.setattr(handlers, "_model_registry_store", store)


def test_the_flows_registry_line_is_read_through_a_restarting_server(tracking_server, registry_served, gateway,  # noqa: F811
                                                                     tmp_path):
    from mlflow import MlflowClient

    from tasks.tracking.registry import registry_verdict

    client = MlflowClient(tracking_server.url)
    name = f"reads-{tmp_path.name}"
    run = client.create_run(client.create_experiment(name)).info.run_id
    client.create_registered_model(name)
    client.create_model_version(name, f"runs:/{run}/policy", run_id=run,
                                tags={"gate.decision": "champion", "gate.reason": "first"})
    client.set_registered_model_alias(name, "champion", "1")
    gateway.unavailable = 2
    line = registry_verdict(tmp_path, {"registered": True, "model_name": name, "version": 1})
    assert line == f"{name} v1: now the champion (gate at registration: champion, first)", line
