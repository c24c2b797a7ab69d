"""Ctrl-C (SIGINT) and SIGTERM (a worker cancelling the run) during a pipeline run.

The handler raises nothing: an exception thrown into whatever the main thread is doing (a Prefect state
change, an MLflow write) would leave them half done. It records the signal and stops the running stage
(flows/dvc_repro.stop_stages); the stage then fails, and the flow, seeing `received()`, ends the run as
cancelled through its usual path: MLflow run KILLED, run record with the failure, lock released.

A cancel from the Prefect UI arrives the same way: the runner of `rlhf serve` (or a worker) sends SIGTERM.
The run then reads as a cancellation: one WARNING naming what was stopped (`cancelled`), no ERROR and no
traceback from Prefect's engine (`CancellationReadsAsCancellation`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.exceptions import CancelledRun

from flows.dvc_repro import stop_stages
from tasks.execution.transient import transient_cause

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


class CancellationReadsAsCancellation(logging.Filter):
    """Prefect 3.8 logs a run that ends Cancelled by its own decision as an error, twice:

    - the task engine logs every final state but Completed at ERROR: "Finished in state Cancelled(...)"
      (prefect/task_engine.py, log_finished_message);
    - the flow engine turns a flow's returned Cancelled state into a raised CancelledRun (engine.result()),
      which run_flow logs at ERROR with its traceback, "Engine execution exited with unexpected exception"
      (prefect/flow_engine.py, run_flow), and handle_engine_signals again unless the runner acknowledged the
      outcome (prefect/engine.py).

    Prefect's own cancellation (its SIGTERM bridge raising TerminationSignal) is not taken here: it would raise
    into whatever the main thread is doing. So this filter, on those loggers for the flow's duration, turns the
    first into a WARNING and drops the traceback of the second: the flow has said what was stopped."""

    LOGGERS = ("prefect.task_runs", "prefect.flow_runs", "prefect.engine")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], CancelledRun):
            return False
        if record.levelno >= logging.ERROR and str(record.msg).startswith("Finished in state Cancelled("):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class ServerGoneReadsAsServerGone(logging.Filter):
    """A Prefect server that died mid-run: the flow engine cannot report the run's final state and logs
    "Encountered exception during execution" at ERROR with an httpx traceback, though the run itself went on and
    recorded its outcome (reports/runs/, MLflow). This filter makes it one WARNING saying so, without the
    traceback; other exceptions are left as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        cause = transient_cause(error) if error is not None else None
        if cause is not None and record.levelno >= logging.ERROR:
            record.msg, record.args, record.exc_info, record.exc_text = (
                "the Prefect server stopped answering (%s): the run's state could not be reported; its outcome is "
                "in its record (reports/runs/) and MLflow", (str(cause),), None, None)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


@contextmanager
def cancellation_reads_as_cancellation() -> Iterator[None]:
    """CancellationReadsAsCancellation and ServerGoneReadsAsServerGone on Prefect's run loggers while the block
    runs and after it (the engine logs once the flow function has returned); added once per process."""
    for name in CancellationReadsAsCancellation.LOGGERS:
        logger = logging.getLogger(name)
        for kind in (CancellationReadsAsCancellation, ServerGoneReadsAsServerGone):
            if not any(isinstance(f, kind) for f in logger.filters):
                logger.addFilter(kind())
    yield


def cancelled_message(message: str) -> str:
    """The line that says a run was cancelled: what was stopped, and what was put back."""
    return (f"run cancelled: {message}; the stage's and the run's MLflow runs are KILLED, params.yaml is as "
            "before the run and the workspace lock is released")
