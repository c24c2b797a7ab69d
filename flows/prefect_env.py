"""Prefect settings for running here, set before prefect is imported (it reads them at import), and the
temporary local server of a run from the command line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.execution.launcher import raise_interrupt

STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def use_local_prefect(root: str | Path) -> None:
    """No PREFECT_API_URL: a temporary local server whose state (runs, logs, artifacts) lives under the
    repo in .prefect/, where a later `prefect server start` finds it. Offline: no analytics."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_HOME", str(Path(root).resolve() / ".prefect"))
        # the temporary server starts in ~10 s; on a busy 2-core machine it can take longer than the default 20 s
        os.environ.setdefault(STARTUP_TIMEOUT_ENV, "120")


@contextmanager
def temporary_server_if_needed(meanwhile: Callable[[], object] = lambda: None) -> Iterator[str | None]:
    """With no PREFECT_API_URL, Prefect's temporary local server, started here in its own session; yields its
    API URL (None when PREFECT_API_URL names a server). Prefect starts the same server itself, in the
    terminal's process group: a Ctrl-C then killed it mid-run and the flow hung, unable to report its end.
    In its own session only `rlhf run` gets the Ctrl-C; it stops the stage, reports the run cancelled, and
    stops this server last.

    `meanwhile` runs while the server starts (~15 s on 2 cores, most of it the server's imports and database
    migrations, in its own process): work the run needs anyway, e.g. its imports, then costs no extra time."""
    if os.environ.get("PREFECT_API_URL"):
        meanwhile()
        yield None
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # outside the flow's own handlers, a SIGTERM must still unwind to the `finally` that stops the server
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_interrupt) if main else None
    url, server = None, None
    try:
        url, server = _start_server(meanwhile)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        if server is not None:
            _drain_prefect_workers()
            _stop(server)


def _drain_prefect_workers(timeout_s: float = 5.0) -> None:
    """Send Prefect's queued logs and events while the server still answers; its exit hook would otherwise
    wait forever on a server that is gone (what prefect.testing's harness does before it stops its server)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


# uvicorn, stopped as by a terminate() once the process that started it is gone: in its own session, a kill -9
# of `rlhf run` would otherwise leave it running for good. Polling the parent works on Linux and macOS alike.
_UVICORN_WHILE_PARENT_LIVES = """
import os, runpy, signal, sys, threading, time
parent = os.getppid()
def stop_when_orphaned():
    while os.getppid() == parent:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(15)
    os._exit(1)
threading.Thread(target=stop_when_orphaned, daemon=True).start()
sys.argv = ["uvicorn", *sys.argv[1:]]
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""


def create_app_with_ui():
    """Prefect's temporary server with its UI: the app of an ephemeral server (only the services a run needs: no
    scheduler, no late-run marking), where Prefect mounts an empty UI, given the UI that `prefect server start`
    serves, so that the "View at http://127.0.0.1:<port>/runs/flow-run/<id>" link Prefect prints answers while
    the run runs. Its uvicorn factory (`_start_server`); PREFECT_UI_API_URL tells the UI this server's port."""
    from prefect.server.api.server import create_app, create_ui_app
    from starlette.routing import Mount

    app = create_app(ephemeral=True, final=True)
    (ui,) = [i for i, route in enumerate(app.router.routes) if getattr(route, "name", None) == "ui"]
    app.router.routes[ui] = Mount("/", app=create_ui_app(ephemeral=False), name="ui")
    return app


def _start_server(meanwhile: Callable[[], object] = lambda: None) -> tuple[str, subprocess.Popen]:
    """The uvicorn command of Prefect's temporary server (prefect/server/api/server.py, SubprocessASGIServer
    in Prefect 3.8), in a new session, exiting when this process does; runs `meanwhile`, then returns its API
    URL once it answers."""
    import httpx
    import prefect

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_UI_ENABLED": "1", "PREFECT_UI_API_URL": url, "PREFECT__SERVER_EPHEMERAL": "1",
           "PREFECT__SERVER_FINAL": "1"}
    server = subprocess.Popen(
        [sys.executable, "-c", _UVICORN_WHILE_PARENT_LIVES, "--app-dir", str(Path(prefect.__file__).parent.parent), "--factory",
         f"{__name__}:{create_app_with_ui.__name__}", "--host", "127.0.0.1", "--port", str(port), "--log-level",
         "error", "--lifespan", "on"], env=env, start_new_session=True)
    deadline = time.monotonic() + float(os.environ.get(STARTUP_TIMEOUT_ENV, "120"))
    try:
        meanwhile()
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url, server
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    except BaseException:  # a Ctrl-C (or `meanwhile` failing) while it starts: no server left behind
        _stop(server)
        raise
    _stop(server)
    raise RuntimeError(f"the temporary Prefect server did not answer on {url} (exit status {server.poll()}); "
                       f"start one with `prefect server start` and set PREFECT_API_URL")
