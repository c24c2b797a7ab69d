"""Where datasets come from: local JSONL / Parquet files, `save_to_disk` directories, or hub ids.

The same rows come out whatever the source, as a list of plain dicts, so the built-in demo world and
real datasets (e.g. `trl-lib/tldr`) go through the same code.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlhf_core.jsonio import JsonFileError, read_jsonl

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class SourceError(ValueError):
    """A dataset source that cannot be read; the message names the source and what was expected."""


def load_rows(source: str | os.PathLike, split: str = "train") -> list[dict]:
    """Rows of a dataset: a local file, a local dataset directory, or a Hugging Face Hub id."""
    path = Path(source)
    if path.is_file():
        return _read_file(path)
    if path.is_dir():
        return _read_dir(path, split)
    if str(source).startswith((".", "/")) or path.suffix in LOCAL_SUFFIXES:
        raise SourceError(f"{source}: no such file or directory")
    return _read_hub(str(source), split)


def _read_file(path: Path) -> list[dict]:
    kind = LOCAL_SUFFIXES.get(path.suffix)
    if kind is None:
        raise SourceError(f"{path}: unsupported file type {path.suffix!r}; expected .jsonl, .json or .parquet")
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for corrupt files
            raise SourceError(f"{path}: not a readable Parquet file ({err})") from err
    return _read_json_lines(path)


def _read_json_lines(path: Path) -> list[dict]:
    try:
        rows = read_jsonl(path)
    except JsonFileError as err:
        raise SourceError(str(err)) from None
    if not rows and not path.read_bytes().strip():
        raise SourceError(f"{path}: the file is empty; expected one JSON object per line")
    return rows


def _read_dir(path: Path, split: str) -> list[dict]:
    """A `Dataset.save_to_disk` / `DatasetDict.save_to_disk` directory, or a hub-layout snapshot."""
    import datasets

    if (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file():
        loaded = datasets.load_from_disk(str(path))
    else:
        loaded = datasets.load_dataset(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SourceError(f"{path}: no split {split!r}; available: {sorted(loaded)}")
        loaded = loaded[split]
    return loaded.to_list()


def _read_hub(repo_id: str, split: str) -> list[dict]:
    import datasets

    try:
        return datasets.load_dataset(repo_id, split=split).to_list()
    except Exception as err:  # connection, offline mode, missing repo: all end the same way for the user
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = "HF_HUB_OFFLINE=1 is set" if offline else "is the Hugging Face Hub reachable?"
        raise SourceError(f"{repo_id}: could not load split {split!r} from the Hugging Face Hub ({hint}); "
                          f"pass a local .jsonl/.parquet file or a saved dataset directory instead. "
                          f"Cause: {type(err).__name__}: {err}") from err
