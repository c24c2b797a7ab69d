"""Conversational rows: TRL's format, lists of {"role", "content"} messages, rendered by the chat template.

Every model stage trains and scores on text. A conversational dataset (`prompt` and `completion` / `chosen` /
`rejected` / `reference` as message lists) stays in messages on disk, where validation checks its structure,
and becomes text where a stage reads it (TRL's `maybe_apply_chat_template`):

- a prompt is rendered with the generation prompt, so it ends where the assistant's turn begins;
- an answer is what the template adds after that prompt for the answer's assistant messages, minus its closing
  EOS: the pipeline appends EOS to every completion itself and generation stops on it.

So SFT's completion-only loss is a loss on the assistant turns, the reward model scores templated pairs, and
the policy generates after the template's assistant header. Plain-text values pass through unchanged.

Tool calling (TRL's format): an assistant message may carry `tool_calls` ([{"type": "function", "function": {"name",
"arguments"}}], its `content` then optional), a `tool` message holds a call's result, and a row's `tools` column the
JSON schemas of the functions (a list, or that list as a JSON string as datasets store it), which the chat template
renders with the row.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

ROLES = ("system", "user", "assistant")
ANSWER_COLUMNS = ("completion", "chosen", "rejected", "reference")
Message = Mapping[str, str]


class ChatTemplateError(ValueError):
    """Conversational data that cannot be rendered: no chat template, or one whose prompt is not a prefix."""


def is_conversation(value) -> bool:
    """A non-empty list of {"role", "content"} mappings (an assistant's tool call may have `tool_calls` instead of
    content)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, Mapping) and "role" in m and ("content" in m or "tool_calls" in m) for m in value))


def row_tools(row: Mapping) -> list | None:
    """The row's `tools` column as a list of schemas (TRL's SFT reads a JSON string the same way); None when it has
    none. A value that is neither is returned as it is, for validation to report."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            return tools
    return tools or None


def is_conversational(rows: Iterable[Mapping]) -> bool:
    """Whether any row holds a conversation (then the tokenizer needs a chat template)."""
    return any(is_conversation(v) for row in rows for v in row.values())


def render_prompt(tokenizer, prompt, template_kwargs: Mapping | None = None, tools: list | None = None) -> str:
    """The prompt as the policy sees it: text unchanged, messages through the chat template (with the row's
    `tools`) up to the assistant's turn."""
    if not is_conversation(prompt):
        return prompt
    _require_template(tokenizer)
    return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True, tools=tools,
                                         **dict(template_kwargs or {}))


def render_answer(tokenizer, prompt, answer, template_kwargs: Mapping | None = None,
                  tools: list | None = None) -> str:
    """An answer (completion, chosen, rejected, reference) as the text that follows the rendered prompt."""
    if not is_conversation(answer):
        return answer
    if not is_conversation(prompt):
        raise ChatTemplateError("an answer given as messages needs its prompt as messages too")
    head = render_prompt(tokenizer, prompt, template_kwargs, tools)
    whole = tokenizer.apply_chat_template(list(prompt) + list(answer), tokenize=False, tools=tools,
                                          **dict(template_kwargs or {}))
    if not whole.startswith(head):
        raise ChatTemplateError(f"the chat template of {tokenizer.name_or_path!r} does not render the prompt as a "
                                "prefix of the whole conversation, so the answer cannot be cut from it")
    return strip_closing_eos(whole[len(head):], tokenizer.eos_token)


def strip_closing_eos(text: str, eos_token: str | None) -> str:
    """`text` without the EOS (and the whitespace after it) that a template closes an assistant turn with."""
    trimmed = text.rstrip()
    if eos_token and trimmed.endswith(eos_token):
        return trimmed[:-len(eos_token)]
    return text


def render_row(row: Mapping, tokenizer, template_kwargs: Mapping | None = None) -> dict:
    """The row with its prompt and answers as text; other columns unchanged."""
    out, tools = dict(row), row_tools(row)
    if "prompt" in row:
        out["prompt"] = render_prompt(tokenizer, row["prompt"], template_kwargs, tools)
    for column in ANSWER_COLUMNS:
        if column in row:
            out[column] = render_answer(tokenizer, row.get("prompt"), row[column], template_kwargs, tools)
    return out


def render_rows(rows: Sequence[Mapping], tokenizer, template_kwargs: Mapping | None = None) -> list[dict]:
    if is_conversational(rows):
        _require_template(tokenizer)
    return [render_row(row, tokenizer, template_kwargs) for row in rows]


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"the data is conversational but the tokenizer {tokenizer.name_or_path!r} has no "
                                "chat template; set prepare.chat_template to a Jinja file or use a chat model's "
                                "tokenizer")


# -- structure, for validation and for prepare's format conversions ---------------------------------------------

TOOL_CALL_ROLE = "assistant[tool_calls]"  # how `roles` shows an assistant message that calls tools


def roles(value) -> str | None:
    """The roles of a conversation joined by commas ("system,user"; an assistant's tool call as TOOL_CALL_ROLE);
    None for anything else."""
    if not is_conversation(value):
        return None
    return ",".join(TOOL_CALL_ROLE if m["role"] == "assistant" and m.get("tool_calls") else str(m["role"])
                    for m in value)


def blank_messages(value) -> int | None:
    """How many messages have no text content (a tool call needs none); None when `value` is not a conversation."""
    if not is_conversation(value):
        return None
    return sum(not m.get("tool_calls") and not (isinstance(m.get("content"), str) and m["content"].strip())
               for m in value)


def first_tool_use(rows: Sequence[Mapping]) -> tuple[int, str] | None:
    """(index, column) of the first row using tools: a `tools` column, or a conversation with a tool call or a tool
    message; None when none does."""
    for index, row in enumerate(rows):
        for column, value in row.items():
            if column == "tools" and value:
                return index, column
            if is_conversation(value) and any(m.get("tool_calls") or m["role"] == "tool" for m in value):
                return index, column
    return None


def bad_tool_calls(value, tools) -> int | None:
    """How many tool calls of a conversation are not TRL's {"type": "function", "function": {"name", "arguments"}}
    (arguments a mapping or its JSON text) or name a function the row's `tools` (schemas) lacks; None when `value`
    is not a conversation."""
    if not is_conversation(value):
        return None
    known = tool_names(tools)
    calls = [call for m in value if m.get("tool_calls") is not None
             for call in (m["tool_calls"] if isinstance(m["tool_calls"], list) else [None])]
    return sum(not _well_formed_call(call, known) for call in calls)


def tool_names(tools) -> set[str] | None:
    """The function names of a `tools` value (schemas as TRL's and transformers' get_json_schema write them:
    {"type": "function", "function": {"name", ...}} or the bare function); None when there are none or it is not a
    list of schemas."""
    if not isinstance(tools, list) or not tools:
        return None
    names = [(t.get("function", t) if isinstance(t, Mapping) else {}).get("name") for t in tools]
    return set(names) if all(isinstance(n, str) and n for n in names) else None


def _well_formed_call(call, known: set[str] | None) -> bool:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        return False
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return False
    name = function.get("name")
    return isinstance(name, str) and isinstance(arguments, Mapping) and (known is None or name in known)


def value_format(value) -> str:
    """"text", "messages" or "invalid": what a prompt / answer value is."""
    if isinstance(value, str):
        return "text"
    return "messages" if is_conversation(value) else "invalid"


def split_conversation(messages: Sequence[Message]) -> tuple[list[dict], list[dict]]:
    """TRL's language-modeling format (`messages`) as (prompt, completion): the completion is the trailing run
    of assistant messages."""
    end = len(messages)
    while end > 0 and messages[end - 1].get("role") == "assistant":
        end -= 1
    return [dict(m) for m in messages[:end]], [dict(m) for m in messages[end:]]


def extract_shared_prompt(chosen: Sequence[Message], rejected: Sequence[Message]) -> tuple[list, list, list]:
    """TRL's implicit-prompt preference format (the prompt repeated at the start of `chosen` and `rejected`) as
    (prompt, chosen answer, rejected answer): the prompt is their longest common run of leading messages that
    ends before an assistant message."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and dict(chosen[shared]) == dict(rejected[shared]):
        shared += 1
    while shared > 0 and chosen[shared - 1].get("role") == "assistant":
        shared -= 1
    return ([dict(m) for m in chosen[:shared]], [dict(m) for m in chosen[shared:]],
            [dict(m) for m in rejected[shared:]])


def last_user_text(prompt) -> str:
    """The text a prompt asks about: the prompt itself, or the content of its last user message."""
    if not is_conversation(prompt):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def message_text(message: Mapping) -> str:
    """A message's text: its content, then its tool calls as JSON (what a tokenizer must learn to read)."""
    content = message.get("content")
    text = content if isinstance(content, str) else "" if content is None else json.dumps(content)
    calls = message.get("tool_calls")
    return f"{text} {json.dumps(calls, ensure_ascii=False)}".strip() if calls else text


def as_text(value) -> str:
    """A value for tables and logs: text as is, messages as `role: content` lines."""
    if is_conversation(value):
        return "\n".join(f"{m['role']}: {message_text(m)}" for m in value)
    return value if isinstance(value, str) else json.dumps(value)


def key(value) -> str:
    """A hashable, canonical key of a prompt or answer (text or messages) for dedup and split membership."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
