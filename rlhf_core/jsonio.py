"""Atomic outputs: a stage writes into a temp sibling and renames it into place on success, so a crash
never leaves a half-written file or directory that DVC would cache or a later stage would read."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(target: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temp path beside `target`; on success it replaces `target`, on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    work = tmp if directory else tmp / target.name
    try:
        yield work
        if directory and target.is_dir():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)  # a directory cannot be replaced in one step; keep the window tiny
            os.replace(work, target)
            shutil.rmtree(old)
        else:
            os.replace(work, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | Path, data) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
