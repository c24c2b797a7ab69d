"""Reading datasets in a model stage: rows as text, conversations rendered by the tokenizer's chat template
with `prepare.chat_template_kwargs` (rlhf_core/chat.py), so every stage sees the same strings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from rlhf_core import chat
from rlhf_core.jsonio import JsonFileError, read_jsonl, require_text
from tasks.parameters.params import Params
from tasks.parameters.paths import Paths


def read_rows(path: str | Path, tokenizer, template_kwargs: Mapping | None = None,
              text_columns: Iterable[str] = ()) -> list[dict]:
    """A JSONL file's rows with prompts and answers as text; each row must have text or messages in
    `text_columns`."""
    rows = read_jsonl(path)
    try:
        rendered = chat.render_rows(rows, tokenizer, template_kwargs)
    except (chat.ChatTemplateError, TypeError, KeyError) as err:  # Jinja raises on odd message values
        raise JsonFileError(f"{path}: cannot render its conversations with the chat template: {err}") from err
    return require_text(rendered, path, text_columns)


def read_split(paths: Paths, name: str, tokenizer, params: Params) -> list[dict]:
    """A split written by `prepare` (data/<name>.jsonl), as text."""
    return read_rows(paths.split(name), tokenizer, params.prepare.chat_template_kwargs)
