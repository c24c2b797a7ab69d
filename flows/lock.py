"""One pipeline run per workspace at a time.

Two runs in one workspace would rewrite the same params.yaml, outputs and dvc.lock under each other, and
DVC's own lock covers a single `dvc repro` only, not the gaps between stages. So a run holds this lock from
before it writes params.yaml until its last stage; a second run waits a bounded time, then refuses with a
message naming the holder. The lock is an OS file lock (released by the kernel if the holder dies); a JSON
file beside it says who holds it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

from rlhf_core.jsonio import read_json_object

LOCK_FILE = ".dvc/tmp/rlhf-pipeline.lock"  # .dvc/tmp is git-ignored by DVC and local to the workspace
POLL_S = 1.0  # how often a waiting run checks for a signal


class WorkspaceBusy(RuntimeError):
    """Another run holds the workspace lock; the message names it."""


def lock_path(root: str | Path) -> Path:
    return Path(root) / LOCK_FILE


def _holder_file(lock: Path) -> Path:
    return lock.with_name(lock.name + ".json")


def describe_holder(root: str | Path) -> str:
    """Who holds the lock, as its holder recorded it: pid, host, start time, run."""
    holder = read_json_object(_holder_file(lock_path(root)))
    if holder is None:
        return "an unknown process (no holder record)"
    run = f", {holder['run']}" if holder.get("run") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}{run}"


def held_by_another(root: str | Path) -> str | None:
    """Who holds the workspace lock (describe_holder) when another process does, i.e. a run is in progress
    here; None when nobody does or this process itself does. Takes the free lock for an instant to tell."""
    path = lock_path(root)
    if not path.is_file():
        return None
    holder = read_json_object(_holder_file(path)) or {}
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return None
    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return describe_holder(root)
    lock.release()
    return None


class LockWaitStopped(RuntimeError):
    """A signal stopped the run while it waited for the lock."""


def _acquire(lock: FileLock, root: str | Path, wait_s: float, on_wait: Callable[[str], object] | None,
             stop: Callable[[], object] | None) -> None:
    """Take `lock`, waiting at most `wait_s`: says at once whom it waits for, gives up when `stop()` is set."""
    deadline = time.monotonic() + wait_s
    try:
        lock.acquire(timeout=0)
        return
    except Timeout:
        pass
    if on_wait is not None and wait_s > 0:
        on_wait(f"waiting up to {wait_s:g} s for the workspace lock, held by {describe_holder(root)}")
    while True:
        if stop is not None and stop():
            raise LockWaitStopped(f"stopped by {stop()} while waiting for the workspace lock")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkspaceBusy(f"workspace {Path(root).resolve()} is busy: another pipeline run holds "
                                f"{lock_path(root)} ({describe_holder(root)}); waited {wait_s:g} s. Wait for it "
                                "to finish, or run in a separate clone.")
        try:
            lock.acquire(timeout=min(POLL_S, remaining))
            return
        except Timeout:
            continue


@contextmanager
def workspace_lock(root: str | Path, wait_s: float, run: str = "", on_wait: Callable[[str], object] | None = None,
                   stop: Callable[[], object] | None = None) -> Iterator[Path]:
    """Hold the workspace lock; wait at most `wait_s` seconds for it, else raise WorkspaceBusy.

    `on_wait(message)` is called once when the lock is held by another run; a true `stop()` (a signal
    received) ends the wait with LockWaitStopped."""
    path = lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, thread_local=False)  # released by the thread that took it, whatever it is
    _acquire(lock, root, wait_s, on_wait, stop)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "run": run,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    _holder_file(path).write_text(json.dumps(holder))
    try:
        yield path
    finally:
        _holder_file(path).unlink(missing_ok=True)
        lock.release()
