"""How a stage process ended, written for the flow that ran it through DVC: the flow retries a failed stage only
when this says a retry can fix it (tasks/execution/transient.py), never by reading the stage's log.

The flow names a file in RLHF_STAGE_OUTCOME. `rlhf stage` writes {"state": "running"} there as it starts, and
{"state": "done"} or {"state": "failed", "error": ..., "transient": ...} as it ends. A file still "running" after
the process is gone means the process died without a word: a signal, most often the OOM killer's SIGKILL,
which a retry may well survive. A rank of a launched stage writes only its failure; the launcher process keeps
a rank's cause rather than its own "the launch failed".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from rlhf_core.jsonio import read_json_object, write_json
from tasks.execution.launcher import LAUNCHED_ENV
from tasks.execution.transient import transient_cause

OUTCOME_ENV = "RLHF_STAGE_OUTCOME"
DIED = "the stage process died without a word (a signal: the OOM killer's SIGKILL, or kill -9)"


@contextmanager
def recorded_outcome() -> Iterator[None]:
    """Record how the code inside ends into RLHF_STAGE_OUTCOME's file (nothing when the variable is unset)."""
    path = os.environ.get(OUTCOME_ENV)
    rank = bool(os.environ.get(LAUNCHED_ENV))
    if path and not rank:
        write_json(path, {"state": "running", "pid": os.getpid()})
    try:
        yield
    except SystemExit as err:  # typer.Exit is not a SystemExit; a plain sys.exit(0) is a success
        if path and err.code not in (0, None):
            _failed(path, err, rank)
        elif path and not rank:
            write_json(path, {"state": "done"})
        raise
    except BaseException as err:
        if path and not _is_clean_exit(err):
            _failed(path, err, rank)
        elif path and not rank:
            write_json(path, {"state": "done"})
        raise
    else:
        if path and not rank:
            write_json(path, {"state": "done"})


def _is_clean_exit(err: BaseException) -> bool:
    """click's Exit(0) (typer.Exit), the way a command ends early with success."""
    return type(err).__name__ == "Exit" and getattr(err, "exit_code", 1) == 0


def _failed(path: str, err: BaseException, rank: bool) -> None:
    earlier = read_json_object(path) or {}
    if not rank and earlier.get("state") == "failed" and earlier.get("rank"):
        return  # a rank said why; the launcher's own "the launch failed" says less
    cause = transient_cause(err)
    write_json(path, {"state": "failed", "error": type(err).__name__, "rank": rank,
                      "transient": str(cause) if cause else None})


def retry_reason(path: str | os.PathLike) -> str | None:
    """Why a retry may fix the stage that wrote `path`, or None: it failed for a reason that would recur, or it
    never started (DVC failed before running it)."""
    outcome = read_json_object(path) or {}
    if outcome.get("state") == "running":
        return DIED
    return outcome.get("transient") if outcome.get("state") == "failed" else None
