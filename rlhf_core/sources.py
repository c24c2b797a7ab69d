"""Where datasets come from: local JSONL / Parquet files, `save_to_disk` directories, or hub ids.

The same rows come out whatever the source, as a list of plain dicts, so the built-in demo world and
real datasets (e.g. `trl-lib/tldr`) go through the same code.

A dataset folder or hub repository is confined to itself: its card (README.md's `configs: data_files`, which
`datasets` honours, absolute paths, `..` and URLs included) and its saved state (`state.json`'s file names,
`dataset_dict.json`'s splits) may name only files inside it, symlinks followed. The files are those `datasets`
itself resolves, checked before any is read; otherwise a source that passed the path check would read any file
the stage's user can (docs/security.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
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

    if _is_saved(path):
        _confine(path, _saved_files(path), [path])
        loaded = datasets.load_from_disk(str(path))
    else:
        builder = _dataset_builder(path)
        builder.download_and_prepare()
        loaded = builder.as_dataset()
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SourceError(f"{path}: no split {split!r}; available: {sorted(loaded)}")
        loaded = loaded[split]
    return loaded.to_list()


def check_dataset_folder(path: str | os.PathLike) -> None:
    """SourceError unless every file the dataset folder `path` would be read from lies inside it (see the module's
    docstring); cheap: nothing is loaded."""
    path = Path(path)
    if _is_saved(path):
        _confine(path, _saved_files(path), [path])
    else:
        _dataset_builder(path)


def _is_saved(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file()


def _dataset_builder(path: Path):
    """`datasets`' builder for a folder of data files (its card's `configs` honoured), its files checked."""
    import datasets

    # first what the card says, as written: `datasets` resolves its patterns when it makes the builder (a URL's
    # request included); then what they resolved to (globs, symlinks)
    _confine(path, [os.path.normpath(os.path.join(path, pattern)) if "://" not in pattern else pattern
                    for pattern in _card_patterns(path)], [path])
    builder = datasets.load_dataset_builder(str(path))
    _confine(path, _builder_files(builder), [path])
    return builder


def _card_patterns(path: Path) -> list[str]:
    """The data_files patterns and data_dir of each config in the folder's README.md card."""
    from huggingface_hub import DatasetCard

    if not (path / "README.md").is_file():
        return []
    configs = DatasetCard.load(path / "README.md").data.to_dict().get("configs") or []
    patterns = []
    for config in configs if isinstance(configs, list) else [configs]:
        if not isinstance(config, dict):
            continue
        data_files = config.get("data_files") or []
        if isinstance(data_files, dict):  # {split: pattern(s)}
            data_files = [{"path": files} for files in data_files.values()]
        for entry in data_files if isinstance(data_files, list) else [data_files]:
            found = entry.get("path", []) if isinstance(entry, dict) else entry
            patterns += [str(p) for p in (found if isinstance(found, list) else [found])]
        if config.get("data_dir"):
            patterns.append(str(config["data_dir"]))
    return patterns


def _builder_files(builder) -> list[str]:
    """Every file a builder will read: its config's data files as `datasets` resolved them (paths or URLs)."""
    return [str(file) for files in (builder.config.data_files or {}).values() for file in files]


def _saved_files(path: Path) -> list[str]:
    """The files `load_from_disk` opens under a saved dataset (dict): each split's folder, state.json's Arrow files
    (joined to the folder as `datasets` joins them: an absolute name replaces it)."""
    folders = [path]
    if (path / "dataset_dict.json").is_file():
        splits = _json_file(path / "dataset_dict.json").get("splits") or []
        folders = [Path(os.path.join(path, str(name))) for name in splits]
    files = []
    for folder in folders:
        files += [str(folder), str(folder / "dataset_info.json")]
        state = _json_file(folder / "state.json") if (folder / "state.json").is_file() else {}
        files += [os.path.join(folder, str(entry.get("filename", ""))) for entry in state.get("_data_files") or []
                  if isinstance(entry, dict)]
    return files


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SourceError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise SourceError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _confine(source: str | os.PathLike, files: Iterable[str], allowed: list[str | os.PathLike]) -> None:
    """SourceError naming the first of `files` outside every `allowed` place: a folder (symlinks followed on both
    sides) or a URL prefix (`hf://datasets/<id>@`)."""
    folders = [os.path.realpath(a) for a in allowed if "://" not in str(a)]
    prefixes = [str(a) for a in allowed if "://" in str(a)]
    for file in files:
        if "://" in file:
            inside = file.startswith(tuple(prefixes)) and ".." not in file.split("/")
        else:
            real = os.path.realpath(file)
            inside = any(os.path.commonpath([real, folder]) == folder for folder in folders)
        if not inside:
            raise SourceError(f"{source}: its dataset card or saved state names {file}, outside the dataset "
                              f"({', '.join(map(str, allowed))}); a dataset may name files inside it only")


def _read_hub(repo_id: str, split: str) -> list[dict]:
    """A hub dataset, confined to its own repository (and, offline, to its snapshot in the local hub cache)."""
    import datasets
    from huggingface_hub import constants

    try:
        builder = datasets.load_dataset_builder(repo_id)
    except Exception as err:  # connection, offline mode, missing repo: all end the same way for the user
        raise _hub_error(repo_id, split, err) from err
    snapshot = Path(constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}"
    _confine(repo_id, _builder_files(builder), [f"hf://datasets/{repo_id}@", snapshot])
    try:
        builder.download_and_prepare()
        return builder.as_dataset(split=split).to_list()
    except Exception as err:
        raise _hub_error(repo_id, split, err) from err


def _hub_error(repo_id: str, split: str, err: Exception) -> SourceError:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    hint = "HF_HUB_OFFLINE=1 is set" if offline else "is the Hugging Face Hub reachable?"
    return SourceError(f"{repo_id}: could not load split {split!r} from the Hugging Face Hub ({hint}); pass a local "
                       f".jsonl/.parquet file or a saved dataset directory instead. Cause: {type(err).__name__}: {err}")
