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
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

from rlhf_core.jsonio import read_json_object

LOCK_FILE = ".dvc/tmp/rlhf-pipeline.lock"  # .dvc/tmp is git-ignored by DVC and local to the workspace


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


@contextmanager
def workspace_lock(root: str | Path, wait_s: float, run: str = "") -> Iterator[Path]:
    """Hold the workspace lock; wait at most `wait_s` seconds for it, else raise WorkspaceBusy."""
    path = lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, thread_local=False)  # released by the thread that took it, whatever it is
    try:
        lock.acquire(timeout=wait_s)
    except Timeout:
        raise WorkspaceBusy(f"workspace {Path(root).resolve()} is busy: another pipeline run holds {path} "
                            f"({describe_holder(root)}); waited {wait_s:g} s. Wait for it to finish, or "
                            "run in a separate clone.") from None
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "run": run,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    _holder_file(path).write_text(json.dumps(holder))
    try:
        yield path
    finally:
        _holder_file(path).unlink(missing_ok=True)
        lock.release()
