"""The tool-call format of multi-turn rollouts, as the tokenizer decides it (TRL 1.16 under transformers >= 5.13):
its chat template renders the tools, an assistant's `tool_calls` and `tool` messages; its `response_template` lets
`tokenizer.parse_response` find the tool calls in what the model wrote.

Token ids are never re-encoded: an episode is prompt ids + each turn's sampled ids + the ids of each tool suffix
(`tool_suffix_ids`: the tool messages and the next assistant header, cut from two renderings of a small conversation,
as TRL's `_get_tool_suffix_ids`). That cut is only right for a template that renders a conversation's earlier turns
the same whatever follows them (prefix-preserving), which `check_tool_template` verifies once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

# TRL's probes (trl/chat_template_utils.py supports_tool_calling): each part of a tool exchange must show in the render
_SENTINELS = {"name": "tool_name_a8f3e2b1", "key": "tool_arg_key_b9d4f5c2", "value": "tool_arg_val_d6e7a9f3",
              "content": "tool_content_c4f9a8e2"}


def _dummy_call(name: str, arguments=None) -> list[dict]:
    return [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments or {}}}]}]


def check_tool_template(tokenizer, template_kwargs: Mapping | None = None) -> None:
    """ValueError unless `tokenizer` can carry multi-turn rollouts: a response template for `parse_response`, a chat
    template that renders a whole tool exchange (TRL's `supports_tool_calling`) and keeps a conversation's prefix
    (TRL's `is_chat_template_prefix_preserving`; TRL swaps in a training template of its own where it knows one)."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if getattr(tokenizer, "response_template", None) is None:
        raise ValueError(f"tools: the tokenizer {name!r} has no response_template, so tool calls cannot be parsed from "
                         "what the model writes (transformers' parse_response); the demo world's tokenizer has one "
                         "when trained with tools (rlhf_core/world/tokenizer.py)")
    check_tool_rendering(tokenizer, template_kwargs)
    head = render_ids(tokenizer, _dummy_call("dummy"), template_kwargs=template_kwargs)
    whole = render_ids(tokenizer, [*_dummy_call("dummy"), {"role": "tool", "name": "dummy", "content": "dummy"}],
                       generation_prompt=True, template_kwargs=template_kwargs)
    if whole[:len(head)] != head:
        raise ValueError(f"tools: the chat template of {name!r} renders a conversation's earlier turns differently "
                         "once a tool message follows them (not prefix-preserving): tool results cannot be appended "
                         "as tokens after what the model wrote")


def check_tool_rendering(tokenizer, template_kwargs: Mapping | None = None) -> None:
    """ValueError unless the chat template renders a whole tool exchange, user -> assistant with tool_calls -> tool,
    every part of it showing (TRL's `supports_tool_calling`): what training on tool-call data needs."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tools: the tokenizer {name!r} has no chat template to render tools and tool messages with")
    s = _SENTINELS
    exchange = _dummy_call(s["name"], {s["key"]: s["value"]})
    exchange.append({"role": "tool", "name": s["name"], "content": s["content"]})
    try:
        rendered = tokenizer.apply_chat_template(exchange, tokenize=False, **dict(template_kwargs or {}))
    except Exception as error:  # noqa: BLE001 - a Jinja error, a template refusing the roles: all mean "cannot"
        raise ValueError(f"tools: the chat template of {name!r} cannot render a tool exchange "
                         f"({type(error).__name__}: {error})") from None
    if not all(sentinel in rendered for sentinel in s.values()):
        raise ValueError(f"tools: the chat template of {name!r} drops part of a tool exchange (the call's name or "
                         "arguments, or the tool message); it must render user -> assistant with tool_calls -> tool")


def render_ids(tokenizer, messages: Sequence[Mapping], *, tools: Sequence[Callable] = (),
               generation_prompt: bool = False, template_kwargs: Mapping | None = None) -> list[int]:
    """The token ids of `messages` through the chat template, with `tools` rendered (None when there are none, as
    TRL: some templates render tool boilerplate for an empty list)."""
    return list(tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, tokenize=True,
                                              return_dict=False, add_generation_prompt=generation_prompt,
                                              **dict(template_kwargs or {})))


def parse_turn(tokenizer, ids: Sequence[int], prefix: Sequence[int], tools: Sequence[Callable] = ()) -> dict:
    """One assistant turn's ids as a message {"role", "content", maybe "tool_calls"}: TRL's `parse_response` wrapper.
    `prefix` is everything before the turn (the parser reads the template's part of the message from it); `tools`
    type the arguments by their schemas. A turn that does not parse (a malformed call) is plain text, as TRL."""
    try:
        parsed = tokenizer.parse_response(list(ids), prefix=list(prefix), tools=list(tools) or None)
        if parsed is None:  # a turn truncated so hard that even its content is lost
            raise ValueError("parse_response returned None")
        if isinstance(parsed.get("content"), str):  # transformers#42249: the EOS left in the content
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            _check_tool_calls(parsed["tool_calls"])
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)}
    return parsed


def _check_tool_calls(tool_calls) -> None:
    """ValueError for a partially parsed call (TRL's `_validate_tool_calls`); a missing `arguments` becomes {}."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list or None.")
    for index, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{index}] must be a dict.")
        function = call.get("function", call)
        if not isinstance(function, dict):
            raise ValueError(f"tool_calls[{index}]['function'] must be a dict.")
        if not isinstance(function.get("name"), str):
            raise ValueError(f"tool_calls[{index}] needs a string name.")
        if function.get("arguments") is None:
            function["arguments"] = {}


def tool_suffix_ids(tokenizer, tool_messages: Sequence[Mapping], template_kwargs: Mapping | None = None) -> list[int]:
    """The ids that follow an assistant turn ending in tool calls: the tool messages and the next assistant header
    (TRL's `_get_tool_suffix_ids`). A dummy call (under the first tool's name: some templates derive the tool header
    from it) rendered without, then with the messages; the first cut after its last EOS (a template may write a
    newline after EOS that belongs to the next turn)."""
    head = render_ids(tokenizer, _dummy_call(tool_messages[0]["name"]), template_kwargs=template_kwargs)
    whole = render_ids(tokenizer, [*_dummy_call(tool_messages[0]["name"]), *tool_messages], generation_prompt=True,
                       template_kwargs=template_kwargs)
    eos = [i for i, token in enumerate(head) if token == tokenizer.eos_token_id]
    if eos:
        head = head[:eos[-1] + 1]
    if whole[:len(head)] != head:
        raise ValueError("tool_suffix_ids: the chat template does not render the call as a prefix of the call and its "
                         "results (not prefix-preserving)")
    return whole[len(head):]
