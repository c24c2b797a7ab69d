"""JSON and JSON-lines files: the one reader and writer of the project.

Writes are atomic: into a temp sibling first, renamed into place on success, so a crash never leaves a
half-written file or directory that DVC would cache or a later stage would read. Reads fail with a
JsonFileError that names the file, the line and what was expected.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class JsonFileError(ValueError):
    """A JSON / JSONL file that cannot be read as expected; the message names the file and line."""


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


def write_json(path: str | Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise JsonFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise JsonFileError(f"{path}: a directory, not a file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise JsonFileError(f"{path}: line {line} is not UTF-8 text (byte {err.start} is "
                            f"{data[err.start:err.start + 1]!r}); expected UTF-8 JSON") from None


def _parse(text: str, path: Path, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise JsonFileError(f"{path}: {where} is not valid JSON ({err.msg} at column {err.colno})") from None


def read_json(path: str | Path) -> Any:
    """The file's JSON value."""
    path = Path(path)
    return _parse(_text(path), path, "the file")


def read_json_object(path: str | Path) -> dict | None:
    """A JSON object, or None when the file is missing or not an object (reports show what exists)."""
    try:
        data = read_json(path)
    except JsonFileError:
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: str | Path, text_columns: Iterable[str] = ()) -> list[dict]:
    """One JSON object per line (blank lines skipped); a `.json` file may hold one array of objects instead.
    Every row must have a string in each of `text_columns`."""
    path = Path(path)
    text = _text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        rows = _parse(text, path, "the file")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise JsonFileError(f"{path}: expected a JSON array of objects")
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            row = _parse(line, path, f"line {number}")
            if not isinstance(row, dict):
                raise JsonFileError(f"{path}: line {number} is {type(row).__name__}, expected a JSON object")
            rows.append(row)
    return require_text(rows, path, text_columns)


def require_text(rows: list[dict], path: str | Path, text_columns: Iterable[str]) -> list[dict]:
    """`rows`, once every row has a string in each of `text_columns` (else a JsonFileError naming the row)."""
    columns = list(text_columns)
    for number, row in enumerate(rows, 1):
        missing = [c for c in columns if not isinstance(row.get(c), str)]
        if missing:
            raise JsonFileError(f"{path}: row {number} has no text in {missing}; expected columns {columns}")
    return rows
