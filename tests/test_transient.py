"""Which failures count as transient (tasks/execution/transient.py), on real failures of real clients: requests and
MLflow's client against a closed port and against a loopback HTTP server answering with error statuses."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tasks.execution.transient import transient_cause


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Answer(BaseHTTPRequestHandler):
    status, body = 200, b"{}"

    def do_GET(self):
        self._answer()

    def do_POST(self):
        self._answer()

    def _answer(self):
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


@pytest.fixture
def mlflow_fails_fast(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries would take minutes


def failure(fn, *args) -> Exception:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def test_a_server_that_is_down_is_transient_and_named_without_credentials(mlflow_fails_fast):
    from mlflow import MlflowClient

    port = closed_port()
    cause = transient_cause(failure(requests.get, f"http://127.0.0.1:{port}/x"))
    assert (cause.condition, cause.server) == ("connection refused", f"http://127.0.0.1:{port}")
    err = failure(MlflowClient(f"http://alice:s3cret@127.0.0.1:{port}").get_run, "0" * 32)
    cause = transient_cause(err)
    assert type(err).__name__ == "MlflowException" and cause.condition == "connection refused"
    assert cause.server == f"http://127.0.0.1:{port}" and "s3cret" not in str(cause)


@pytest.mark.parametrize("status, body, transient", [
    (503, b"busy", True),  # MLflow's client retries 5xx itself, then gives up: still the server's condition
    (500, json.dumps({"error_code": "INTERNAL_ERROR", "message": "database down"}).encode(), True),
    (400, json.dumps({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad key"}).encode(), False),
    (404, b"no such endpoint", False),
])
def test_an_http_error_is_transient_only_when_the_server_cannot_serve_now(server, mlflow_fails_fast, status, body,
                                                                          transient):
    from mlflow import MlflowClient

    Answer.status, Answer.body = status, body
    cause = transient_cause(failure(MlflowClient(f"http://127.0.0.1:{server.server_port}").get_run, "0" * 32))
    assert (cause is not None) is transient, cause
    direct = failure(lambda: requests.get(f"http://127.0.0.1:{server.server_port}/x").raise_for_status())
    assert (transient_cause(direct) is not None) is (status >= 500), transient_cause(direct)


def test_the_words_of_a_message_are_not_a_cause():
    err = ValueError("ConnectionError: Connection reset; 503 Server Error; Read timed out; Unable to acquire lock")
    assert transient_cause(err) is None
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as inner:
            raise RuntimeError("could not log params") from inner
    except RuntimeError as outer:
        assert str(transient_cause(outer)) == "connection refused"  # found behind the wrapper
