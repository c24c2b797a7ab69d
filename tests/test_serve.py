"""`rlhf serve` as a person starts and stops it: its help lists what it serves; a SIGTERM (what a service manager or a
worker's supervisor sends) stops it cleanly and pauses the schedules; with the server already gone it still exits
at once. Against a real `prefect server start` on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_flow import BIN, REPO, SERVERS, STARTUP_S, base_env, prefect_server
from typer.testing import CliRunner

from cli.main import app
from flows.deployments import deployment_specs

STOP_S = 20  # a bound on how long stopping may take (it took over 40 s, until SIGKILL, with the server gone)


def test_serve_help_lists_every_deployment_it_serves():
    """It said "manual, and nightly" at 2a5c0fd; prefect.yaml lists four."""
    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"}).output
    for spec in deployment_specs(REPO):
        flow = spec["entrypoint"].rpartition(":")[2].replace("_", "-")
        assert f"{flow}/{spec['name']}" in out, (spec["name"], out)
    assert "rlhf-pipeline/nightly (cron 0 2 * * * UTC)" in out, out
    assert "manual, and nightly" not in out


@contextmanager
def served(workspace: Path, api: str, log: Path) -> Iterator[subprocess.Popen]:
    """`rlhf serve` in `workspace`, once its runner has polled the server (not an earlier one's poll)."""
    from datetime import datetime, timezone

    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = base_env(PREFECT_API_URL=api, PREFECT_HOME=str(workspace / ".prefect"), PYTHONPATH=str(REPO))
    started = datetime.now(timezone.utc)
    with log.open("w") as out:
        proc = subprocess.Popen([BIN / "rlhf", "serve"], cwd=workspace, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            while True:
                try:
                    polled = client.read_deployment_by_name("rlhf-sweep/frontier").last_polled
                    if polled is not None and polled > started:
                        break
                except ObjectNotFound:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stopped_by_sigterm(proc: subprocess.Popen, log: Path) -> str:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`rlhf serve` still running {STOP_S} s after SIGTERM:\n{log.read_text()[-3000:]}")
    out = log.read_text()
    assert code == 0, out[-3000:]
    assert "never awaited" not in out and "Traceback" not in out, out[-3000:]
    return f"{time.monotonic() - started:.1f} s"


@pytest.mark.slow
def test_sigterm_stops_serve_cleanly_with_or_without_the_server(tmp_path):
    """A SIGTERM printed "RuntimeWarning: coroutine 'Runner.astop' was never awaited" at 2a5c0fd; with the Prefect
    server already stopped, `rlhf serve` then hung at "Pausing all deployments..." for over 40 s."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "prefect.yaml").write_text((REPO / "prefect.yaml").read_text())
    home = tmp_path / "server"
    home.mkdir()
    with prefect_server(home, "--no-scheduler") as api:
        with served(workspace, api, tmp_path / "serve1.log") as proc:
            stopped_by_sigterm(proc, tmp_path / "serve1.log")
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            nightly = client.read_deployment_by_name("rlhf-pipeline/nightly")
        assert nightly.paused, "stopping pauses the schedules, as Prefect's serve does"

        with served(workspace, api, tmp_path / "serve2.log") as proc:
            server = SERVERS[api]
            os.kill(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
            stopped_by_sigterm(proc, tmp_path / "serve2.log")
        assert "deployments' schedules are not paused" in (tmp_path / "serve2.log").read_text()
