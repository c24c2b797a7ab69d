"""The dataset layouts `prepare` reads, defined once for `prepare` (which converts them) and `validate` (which checks
each file as it is, in its own columns).

Every kind has our columns (SCHEMA); a file may also name them as public TL;DR-style datasets do (ALIASES), and
two of TRL's conversational layouts carry the prompt inside the conversation:

    sft          explicit prompt   {prompt, completion}: text, or TRL's conversational prompt-completion (messages)
                 messages          {messages}: TRL's conversational language modeling; the completion is the
                                   trailing run of assistant messages, the prompt everything before it
    preferences  explicit prompt   {prompt, chosen, rejected}: text, or conversational
                 implicit prompt   {chosen, rejected}: TRL's conversational implicit prompt, the conversation
                                   repeated at the start of both; the prompt is their shared opening
    prompts      explicit prompt   {prompt} (+ reference), text or conversational

with `query` / `post` for prompt, `summary` / `response` for completion and `reference_response` for reference.
Any layout may carry TRL's `tools` column beside its conversations (tool calling); it is kept as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlhf_core import chat

SCHEMA = {"sft": ("prompt", "completion"), "prefs": ("prompt", "chosen", "rejected"), "prompts": ("prompt",)}
OPTIONAL = {"sft": (), "prefs": (), "prompts": ("reference",)}  # kept when present
TOOLS = "tools"  # TRL's column of the functions a row's conversation may call (JSON schemas): kept when present
# Column names used by public TL;DR-style datasets, mapped to ours.
ALIASES = {"query": "prompt", "post": "prompt", "summary": "completion", "response": "completion",
           "reference_response": "reference", "reference": "reference"}

EXPLICIT, MESSAGES, IMPLICIT = "explicit prompt", "messages", "implicit prompt"


@dataclass(frozen=True)
class Layout:
    """How one file holds its kind's fields."""

    name: str
    """EXPLICIT, MESSAGES or IMPLICIT."""
    kind: str
    """prepare's kind: sft, prefs or prompts."""
    columns: Mapping[str, str]
    """Our field -> the file's column holding it (EXPLICIT: {"prompt": "query", ...}); for MESSAGES and IMPLICIT,
    the file's conversation columns by their own names."""

    @property
    def conversation_only(self) -> bool:
        """Whether the prompt lives inside conversations (then every value must be a list of messages)."""
        return self.name != EXPLICIT

    @property
    def required(self) -> tuple[str, ...]:
        """The fields (EXPLICIT) or conversation columns every row needs."""
        return SCHEMA[self.kind] if self.name == EXPLICIT else tuple(self.columns)


def detect_layout(rows: Sequence[Mapping], kind: str) -> Layout:
    """The layout `prepare` reads these rows in: a prompt column (ours or an alias) makes it EXPLICIT; without one,
    SFT rows with `messages` are MESSAGES and preference rows with `chosen` and `rejected` are IMPLICIT."""
    present = {key for row in rows for key in row}

    def column(field: str) -> str | None:
        if field in present:
            return field
        return next((c for c in sorted(present) if ALIASES.get(c) == field), None)

    if column("prompt") is None and kind == "sft" and "messages" in present:
        return Layout(MESSAGES, kind, {"messages": "messages"})
    if column("prompt") is None and kind == "prefs" and {"chosen", "rejected"} <= present:
        return Layout(IMPLICIT, kind, {"chosen": "chosen", "rejected": "rejected"})
    fields = SCHEMA[kind] + OPTIONAL[kind]
    return Layout(EXPLICIT, kind, {f: column(f) or f for f in fields if column(f) or f in SCHEMA[kind]})


def explicit_prompt(row: Mapping, kind: str) -> dict:
    """The row in our columns with the prompt in its own column: aliases renamed, TRL's language-modeling rows
    (`messages`) and implicit-prompt pairs (the conversation repeated in `chosen` and `rejected`) split."""
    row = {ALIASES.get(k, k): v for k, v in row.items()}
    if "prompt" in row:
        return row
    if kind == "sft" and chat.is_conversation(row.get("messages")):
        prompt, completion = chat.split_conversation(row["messages"])
        return {**row, "prompt": prompt, "completion": completion}
    if kind == "prefs" and chat.is_conversation(row.get("chosen")) and chat.is_conversation(row.get("rejected")):
        prompt, chosen, rejected = chat.extract_shared_prompt(row["chosen"], row["rejected"])
        return {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}
    return row


def normalize(rows: Sequence[Mapping], kind: str) -> list[dict]:
    """Rows in our schema, as `prepare` writes them: our columns only (plus `reference` for prompts)."""
    keep = SCHEMA[kind] + OPTIONAL[kind] + (TOOLS,)
    return [{k: row[k] for k in keep if k in row} for row in (explicit_prompt(r, kind) for r in rows)]
