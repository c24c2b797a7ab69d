"""`rlhf serve`: the deployments prefect.yaml lists (the pipeline on demand and nightly, the sweep), served from this
process against the Prefect server at PREFECT_API_URL. One file describes them for both `rlhf serve` and
`prefect deploy`."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

PREFECT_YAML = "prefect.yaml"
REPO = Path(__file__).resolve().parents[1]


def deployment_specs(root: str | Path) -> list[dict]:
    path = Path(root) / PREFECT_YAML
    specs = (yaml.safe_load(path.read_text()) or {}).get("deployments") or []
    if not specs:
        raise ValueError(f"{path}: no deployments listed")
    return specs


def flow_of(entrypoint: str):
    """The flow an entrypoint names, e.g. flows/sweep.py:rlhf_sweep."""
    import importlib

    path, _, name = entrypoint.partition(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def runner_deployments(root: str | Path) -> list:
    from prefect.schedules import Cron

    return [flow_of(spec["entrypoint"]).to_deployment(
        name=spec["name"], description=spec.get("description"), tags=spec.get("tags"),
        parameters=spec.get("parameters") or {}, concurrency_limit=spec.get("concurrency_limit"),
        schedules=[Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True))
                   for s in spec.get("schedules") or []])
        for spec in deployment_specs(root)]


def deployment_names(root: str | Path = REPO) -> list[str]:
    """`rlhf-pipeline/nightly (cron 0 2 * * * UTC)`: each deployment as `rlhf serve` registers it, with its
    schedules, read without importing Prefect (for the command's help). The flow of an entrypoint
    `flows/pipeline.py:rlhf_pipeline` is named `rlhf-pipeline`."""
    names = []
    for spec in deployment_specs(root):
        flow = spec["entrypoint"].rpartition(":")[2].replace("_", "-")
        crons = [f"cron {s['cron']}{' ' + s['timezone'] if s.get('timezone') else ''}"
                 for s in spec.get("schedules") or [] if "cron" in s]
        names.append(f"{flow}/{spec['name']}" + (f" ({', '.join(crons)})" if crons else ""))
    return names


PAUSE_CHECK_S = 3.0  # at shutdown, how long the server may take to answer before the pause is skipped
STOP_GRACE_S = 15.0  # after a SIGTERM, how long the unwinding (the schedules' pause included) may take


def serve_deployments(root: str | Path) -> None:
    """Blocks, running each triggered or scheduled flow run in a subprocess, one at a time, until a Ctrl-C or a
    SIGTERM; then pauses the deployments' schedules (what Prefect's `serve` does), unless the server is gone."""
    import asyncio

    from prefect.exceptions import TerminationSignal

    runner = _runner()(limit=1)
    for deployment in runner_deployments(root):
        runner.add_deployment(deployment)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal):
        pass


def _runner():
    """Prefect's Runner (what `prefect.serve` runs), stopping on a SIGTERM as on a Ctrl-C, and skipping the
    pause of its deployments when the server does not answer. Prefect's own SIGTERM handler calls the runner's
    stop() inside the event loop, where it returns a coroutine nobody awaits ("RuntimeWarning: coroutine
    'Runner.astop' was never awaited"), then exits mid-loop; and its pause retried a stopped server for 40 s+."""
    import signal

    from prefect.runner import Runner

    class ServeRunner(Runner):
        def handle_sigterm(self, *args, **kwargs) -> None:
            self._logger.info("SIGTERM received, shutting down...")
            _exit_unless_stopped_within(STOP_GRACE_S, self._logger)
            # a Ctrl-C's KeyboardInterrupt, raised here: it leaves the loop, whose tasks are then cancelled and
            # unwind (raising SIGINT instead did nothing where SIGINT is ignored, as under nohup or `cmd &`)
            signal.default_int_handler(signal.SIGINT, None)

        async def __aexit__(self, *exc_info) -> None:
            if self.pause_on_shutdown and not _server_answers():
                self._logger.warning("the Prefect server does not answer: the deployments' schedules are not "
                                     "paused (pause them in the UI, or run `rlhf serve` again and stop it)")
                self.pause_on_shutdown = False
            await super().__aexit__(*exc_info)

    return ServeRunner


def _exit_unless_stopped_within(seconds: float, logger) -> None:
    """A SIGTERM must end the process: should the unwinding hang (a `make test` run once saw serve alive 60 s after
    its SIGTERM, not reproduced since), exit anyway after `seconds`, as a process killed by SIGTERM does (143)."""
    import os
    import threading
    import time

    def watchdog() -> None:
        time.sleep(seconds)
        logger.warning("not stopped %.0f s after SIGTERM: exiting now (schedules may not be paused)", seconds)
        logging.shutdown()
        os._exit(128 + 15)

    threading.Thread(target=watchdog, name="sigterm-watchdog", daemon=True).start()


def _server_answers() -> bool:
    import httpx
    from prefect.settings import PREFECT_API_URL

    try:
        return httpx.get(f"{PREFECT_API_URL.value().rstrip('/')}/health", timeout=PAUSE_CHECK_S).status_code == 200
    except httpx.HTTPError:
        return False
