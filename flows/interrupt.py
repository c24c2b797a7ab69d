"""Ctrl-C (SIGINT) and SIGTERM (a worker cancelling the run) during a pipeline run.

The handler raises nothing: an exception thrown into whatever the main thread is doing (a Prefect state
change, an MLflow write) would leave them half done. It records the signal and stops the running stage
(flows/dvc_repro.stop_stages); the stage then fails, and the flow, seeing `received()`, ends the run as
cancelled through its usual path: MLflow run KILLED, run record with the failure, lock released.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flows.dvc_repro import stop_stages

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[str] = []  # names of the signals received while handlers are installed


def received() -> str | None:
    """The first signal received during this run ('SIGINT', 'SIGTERM'), or None."""
    return _received[0] if _received else None


def _handle(signum: int, frame) -> None:
    _received.append(signal.Signals(signum).name)
    stop_stages()


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM stop the running stage and mark the run interrupted (main thread only: Python
    delivers signals there; elsewhere the process's own handlers stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_status(name: str) -> int:
    """The shell's exit status for a run stopped by signal `name`: 128 + its number (130 for SIGINT)."""
    return 128 + signal.Signals[name].value
