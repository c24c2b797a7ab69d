"""A real `mlflow server` process that a test kills and restarts, and a real HTTP gateway in front of it that
says when to (tests/test_registry_outage.py, tests/test_mlflow_reads.py).

- `MlflowServerProcess`: `mlflow server` on a sqlite store (a copy of the migrated template: a start takes ~8 s
  here, not the ~15 s of a fresh store's migrations) in its own process group; `kill()` is SIGKILL to the group (a
  server that dies: its connections with it), `start()` again on the same port is the restart.
- `Gateway`: forwards every request to a backend, as a reverse proxy in front of MLflow does. It answers
  503 to the next `unavailable` requests (a server that is restarting behind it), or to every other request while
  `flaky`; it calls `after(method, path)`
  once a forwarded request has been done and before its reply is relayed (the test kills the server there:
  exactly between two writes); a backend that refuses the connection, or a gateway set `down` (the network to
  the server cut), closes the client's connection without a reply.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from tasks.execution.launcher import free_port

BIN = Path(sys.executable).parent
START_DEADLINE_S = 180  # a generous bound on one start on a loaded machine, not a timing check


class MlflowServerProcess:
    """`mlflow server` on `db` at a fixed loopback port; start(), kill() (SIGKILL), start() again."""

    def __init__(self, db: Path, artifacts: Path, log: Path):
        self.db, self.artifacts, self.log = db, artifacts, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
        env.pop("MLFLOW_TRACKING_URI", None)
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [BIN / "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{self.db}", "--default-artifact-root", str(self.artifacts)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        give_up = time.monotonic() + START_DEADLINE_S
        while not self._healthy():
            assert self.proc.poll() is None, f"mlflow server exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < give_up, f"mlflow server not up in {START_DEADLINE_S} s"
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL to the server's process group (the CLI, uvicorn and its job runner), waited for."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


class Gateway:
    """A reverse proxy to `backend` on its own loopback port; see the module's docstring."""

    def __init__(self, backend: str):
        self.backend = urlsplit(backend)
        self.unavailable = 0  # the next requests answered 503, as a proxy whose server is restarting answers
        self.down = False  # every connection closed without a reply, as a dead server's
        self.flaky = False  # every other request answered 503: each read of a sequence meets one
        self._requests = 0
        self.after: Callable[[str, str], None] | None = None
        self.answered_503 = 0
        self.forwarded: list[tuple[str, str]] = []  # (method, path) of each request the backend did
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: nothing outlives a kill

            def _relay(self):
                gateway.relay(self)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _relay  # noqa: N815

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def relay(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if self.down:
            handler.close_connection = True
            return
        self._requests += 1
        if self.unavailable > 0 or (self.flaky and self._requests % 2):
            self.unavailable = max(self.unavailable - 1, 0)
            self.answered_503 += 1
            self._answer(handler, 503, b"<html><body>503 Service Temporarily Unavailable</body></html>",
                         [("Content-Type", "text/html")])
            return
        backend = http.client.HTTPConnection(self.backend.hostname, self.backend.port, timeout=60)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")}
            backend.request(handler.command, handler.path, body=body, headers=headers)
            reply = backend.getresponse()
            content = reply.read()
        except ConnectionRefusedError:  # the server is dead: so is the connection, no reply
            handler.close_connection = True
            return
        finally:
            backend.close()
        self.forwarded.append((handler.command, urlsplit(handler.path).path))
        if self.after is not None:
            self.after(handler.command, urlsplit(handler.path).path)
        self._answer(handler, reply.status, content,
                     [(k, v) for k, v in reply.getheaders() if k.lower() not in ("connection", "transfer-encoding",
                                                                                 "content-length")])

    @staticmethod
    def _answer(handler: BaseHTTPRequestHandler, status: int, content: bytes, headers: list) -> None:
        handler.send_response(status)
        for key, value in headers:
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        handler.wfile.write(content)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
