"""Where a model or tokenizer comes from (a local save_pretrained directory, else a Hugging Face Hub id), and the
tokenizer loader. Light on purpose: stages that only tokenize (prepare, validate) load no model code."""

from __future__ import annotations

import os
from pathlib import Path


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
