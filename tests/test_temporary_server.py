"""The temporary Prefect server of `rlhf run` and `rlhf sweep` (flows/prefect_env.py): the "View at" link Prefect
prints for a run on it opens that run's page while the run runs (the UI's rendering is in tests/test_ui.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
FLOW_NAME = "rlhf-link-probe"
# A flow run on the temporary server exactly as `rlhf run` starts one, held open until the file `go` exists.
HELD_RUN = f"""
import pathlib, time
from flows.prefect_env import temporary_server_if_needed, use_local_prefect
use_local_prefect(".")
with temporary_server_if_needed():
    from prefect import flow

    @flow(name="{FLOW_NAME}")
    def probe():
        while not pathlib.Path("go").exists():
            time.sleep(0.2)

    probe()
"""


# What Prefect says when this process's queued logs or events are sent at its exit, after the server stopped
# ("--- Error logging to API ---", "Service 'EventsWorker' failed to process item ..."), or any ERROR record.
AFTER_THE_SERVER = re.compile(r"\| ERROR |Error logging to API|failed to process item|Traceback")


@contextmanager
def held_flow_run(workdir: Path) -> Iterator[str]:
    """Yields the "View at" link of a flow run on the temporary server while the run waits; then lets it end."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for name in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_UI_URL"):
        env.pop(name, None)
    run = subprocess.Popen([sys.executable, "-c", HELD_RUN], cwd=workdir, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in run.stdout:
            seen.append(line)
            if match := re.search(r"View at (\S+)", line):
                break
        else:
            raise AssertionError(f"no 'View at' link printed:\n{''.join(seen)}")
        yield match.group(1)
        (workdir / "go").touch()
        rest = run.stdout.read()
        assert run.wait(timeout=120) == 0, "".join(seen) + rest
        # nothing left for a server that is gone: said after the run's last line, it read as the run's error
        assert not AFTER_THE_SERVER.search(rest), rest
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _html(url: str) -> httpx.Response:
    return httpx.get(url, headers={"Accept": "text/html"}, follow_redirects=True, timeout=30)


@pytest.mark.slow
def test_the_view_at_link_of_a_run_on_the_temporary_server_answers_with_the_ui(tmp_path):
    """It answered {"detail":"Not Found"} at 2a5c0fd (the server served the API only), and so did its root."""
    with held_flow_run(tmp_path) as link:
        match = re.fullmatch(r"(http://127\.0\.0\.1:\d+)/runs/flow-run/([0-9a-f-]{36})", link)
        assert match, link
        base, run_id = match.groups()
        for url in (link, f"{base}/"):
            page = _html(url)
            assert page.status_code == 200 and "<html" in page.text.lower(), (url, page.status_code, page.text[:200])
        # the UI calls this server's API (not the default port 4200), and the link names the run that is running
        assert httpx.get(f"{base}/ui-settings", timeout=30).json()["api_url"] == f"{base}/api"
        flow_run = httpx.get(f"{base}/api/flow_runs/{run_id}", timeout=30).json()
        assert flow_run["state_type"] == "RUNNING", flow_run
    # after the run, the server is gone: where to see the run again is in `rlhf run`'s summary
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/api/health", timeout=2)
        except httpx.HTTPError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the temporary server outlived its run")


def test_the_summary_says_how_to_see_a_run_of_the_temporary_server_again(monkeypatch):
    from tasks.tracking.progress import prefect_ui_hint

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", "/ws/.prefect")
    assert prefect_ui_hint("abc") == "PREFECT_HOME=/ws/.prefect prefect server start, then " \
                                     "http://127.0.0.1:4200/runs/flow-run/abc"
    monkeypatch.setenv("PREFECT_API_URL", "http://host:4200/api")
    assert prefect_ui_hint("abc") == "http://host:4200/runs/flow-run/abc"


# A flow run in this interpreter against a test's Prefect server (tests/test_flow.py's prefect_server, as the suite's
# in-process flows use it), then the interpreter's exit.
IN_PROCESS_RUN = f"""
import pathlib, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from test_flow import prefect_server
from prefect import flow, get_run_logger
from prefect.settings import PREFECT_API_URL, temporary_settings

@flow(name="{FLOW_NAME}")
def probe():
    get_run_logger().info("probing")

with prefect_server(pathlib.Path(sys.argv[1]), "--no-scheduler") as url, \\
        temporary_settings(updates={{PREFECT_API_URL: url}}):
    probe()
print("the server stopped", flush=True)
"""


def test_a_flow_run_against_a_tests_server_leaves_nothing_to_say_at_exit(tmp_path):
    """`make test` ended with a Prefect ERROR after its summary: a pytest worker's queued logs and events, sent at
    its exit to a test's server that had stopped. prefect_server sends them before it stops the server; without that
    this process's last words were "--- Error logging to API --- All connection attempts failed"."""
    from test_flow import base_env, with_migrated_prefect_db

    home = with_migrated_prefect_db(tmp_path / "home")  # this process's migrated database: no migration there
    run = subprocess.run([sys.executable, "-c", IN_PROCESS_RUN, str(home)], cwd=tmp_path, env=base_env(),
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "the server stopped" in run.stdout, out
    assert "probing" in out, out  # the run's own line reached the console: what is checked is after it
    assert not AFTER_THE_SERVER.search(out), out
