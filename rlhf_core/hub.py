"""Where a model or tokenizer comes from (a local save_pretrained directory, else a Hugging Face Hub id), and the
tokenizer loader and saver. Light on purpose: stages that only tokenize (prepare, validate) load no model code."""

from __future__ import annotations

import json
import os
from pathlib import Path

# from_pretrained options transformers writes back into tokenizer_config.json: they say how it was loaded (offline
# or not, from a local path or the hub), not what it is, and would make the same tokenizer save different bytes
LOAD_TIME_KEYS = ("local_files_only", "is_local", "cache_dir", "force_download", "proxies", "token",
                  "revision", "subfolder", "trust_remote_code", "_commit_hash")


def resolve_source(name_or_path: str | os.PathLike) -> str:
    """A local directory (saved with save_pretrained) or, when no such path exists, a hub id."""
    path = Path(name_or_path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; expected a directory saved with save_pretrained() or a hub id")
    return str(name_or_path)


def load_tokenizer(name_or_path: str | os.PathLike):
    """The tokenizer at `name_or_path`, which must have a pad token (RL pads every batch)."""
    from transformers import AutoTokenizer

    source = resolve_source(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except OSError as err:
        raise OSError(f"could not load a tokenizer from {source!r}: {err}") from err
    if tokenizer.pad_token is None:
        raise ValueError(f"tokenizer {source!r} has no pad token; add a distinct one (e.g. '[PAD]') before RL")
    return tokenizer


def save_tokenizer(tokenizer, target: str | os.PathLike) -> None:
    """`tokenizer.save_pretrained(target)` without the load-time options in its config: a stage's output hashes the
    same in and outside `make` (HF_HUB_OFFLINE sets local_files_only) and whichever copy it was loaded from."""
    tokenizer.save_pretrained(target)
    path = Path(target) / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        kept = {k: v for k, v in config.items() if k not in LOAD_TIME_KEYS}
        path.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
