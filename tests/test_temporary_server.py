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
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _html(url: str) -> httpx.Response:
    return httpx.get(url, headers={"Accept": "text/html"}, follow_redirects=True, timeout=30)


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
