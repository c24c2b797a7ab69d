"""Great Expectations suites for the three dataset kinds in each layout `prepare` reads, and their results as plain
report entries.

A suite is a list of GX expectations built from the layout (tasks/data/layouts.py: our columns or their aliases,
TRL's `messages`, TRL's implicit-prompt pairs), the columns the frame has and the token budgets; it names the
file's own columns.

Token lengths are not something GX can measure, so the frame gets a `<column>_tokens` column (counts of the
policy tokenizer, of the text the chat template renders for a conversation) that a plain
`ExpectColumnValuesToBeBetween` bounds. Conversations (TRL's message lists) get the same treatment: their structure
becomes plain columns (`<column>_roles`, `<column>_blank_messages`, `formats`; for a prompt inside the
conversation, the parts `prepare` splits it into: `messages_prompt_tokens`, `shared_prompt_roles`,
`chosen_answer_roles`, ...) that regex, range and set expectations check. Rows are numbered from 1 (the frame's
index), so every unexpected row GX reports is the row number a user finds in the file. Values that are not
strings reach GX as their JSON text (tasks/stages/validate.py reports them with a plain check): GX fingerprints and
hashes every value, and a raw JSON list would crash it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd

from tasks.data.layouts import EXPLICIT, IMPLICIT, MESSAGES, SCHEMA, Layout

KINDS = ("prompts", "sft", "preferences")
LAYOUT_KIND = {"prompts": "prompts", "sft": "sft", "preferences": "prefs"}  # validate's kind -> prepare's
MAX_EXAMPLES = 5  # example rows per failed expectation in the report
MAX_ROWS = 50  # row numbers listed per failed expectation
MAX_CHARS = 160  # long texts are cut in examples


@dataclass(frozen=True)
class TokenBudget:
    """Length bounds in tokens of the policy tokenizer (prepare's `max_prompt_tokens` / `max_completion_tokens`)."""

    tokenizer: object | None  # None: lengths are not checked (the report says so)
    max_prompt_tokens: int
    max_completion_tokens: int
    template_kwargs: Mapping = field(default_factory=dict)  # prepare.chat_template_kwargs

    def limit(self, name: str) -> int:
        """The budget of our field `name` (prompt, completion, chosen, ...)."""
        return self.max_prompt_tokens if name == "prompt" else self.max_completion_tokens


# A prompt: an optional system message, then user and assistant turns alternating, the last from the user. With
# tools (TRL's tool calling; rlhf_core/chat.py `roles` writes a call as assistant[tool_calls]) an assistant turn may
# first make tool calls, each answered by tool messages, and a prompt may end with tool results to answer.
EXCHANGE = r"assistant\[tool_calls\](?:,tool)+"  # a tool call and its results
TURN = rf"(?:{EXCHANGE},)*assistant"
ANSWER = rf"(?:{EXCHANGE},)*(?:assistant(?:,assistant)*|assistant\[tool_calls\])"  # an answer, or a call to make
PROMPT_ROLES = rf"^(?:system,)?user(?:,{TURN},user)*(?:,{EXCHANGE})*$"
ANSWER_ROLES = rf"^{ANSWER}$"  # the conversation before an answer belongs in `prompt`
CONVERSATION_ROLES = rf"^(?:system,)?user(?:,{TURN},user)*,{ANSWER}$"  # a prompt, then the answer
PROMPT_WHAT = ("an optional system message, then user and assistant turns alternating, the last from the user (an "
               "assistant's tool calls each followed by their tool messages)")
TOOL_SCHEMAS_WHAT = ("`tools` is a list of function schemas, [{type: function, function: {name, description, "
                     "parameters}}] (or that list as JSON text), as TRL's tool-calling datasets hold it")
SAME_FORMAT = {"text", "messages"}  # every text column of a row: all text or all messages


def with_token_counts(frame: pd.DataFrame, texts: Mapping[str, Sequence[str | None]], tokenizer) -> pd.DataFrame:
    """The frame plus `<column>_tokens`: token counts of each column's texts (aligned with the frame's rows;
    null where a value has no text)."""
    frame = frame.copy()
    for column, values in texts.items():
        present = [i for i, v in enumerate(values) if isinstance(v, str)]
        batch = [values[i] for i in present]
        counts = [len(ids) for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]] if batch else []
        frame[f"{column}_tokens"] = pd.Series(counts, index=frame.index[present], dtype="Int64")
    return frame


def build_suite(layout: Layout, frame: pd.DataFrame, budget: TokenBudget) -> list:
    """The expectations for a frame of this layout (tasks/data/layouts.py); each carries a readable description
    naming the file's own columns."""
    assert layout.kind in LAYOUT_KIND.values(), f"unknown kind {layout.kind!r}"
    build = {EXPLICIT: _explicit_suite, MESSAGES: _messages_suite, IMPLICIT: _implicit_suite}[layout.name]
    return build(layout, set(frame.columns), budget) + _tool_suite(set(frame.columns))


def _tool_suite(present: set[str]) -> list:
    """Tool calling (validate.py's `tool_columns`): the `tools` schemas, and every call well formed, naming one of
    them."""
    import great_expectations.expectations as gxe

    suite = []
    if "tools_invalid" in present:
        suite.append(gxe.ExpectColumnValuesToBeNull(column="tools_invalid", description=TOOL_SCHEMAS_WHAT))
    for column in sorted(c.removesuffix("_bad_tool_calls") for c in present if c.endswith("_bad_tool_calls")):
        suite.append(gxe.ExpectColumnValuesToBeBetween(
            column=f"{column}_bad_tool_calls", min_value=0, max_value=0,
            description=f"every tool call of `{column}` is {{type: function, function: {{name, arguments}}}}, "
                        "arguments an object, naming a function of the row's `tools`"))
    return suite


def _explicit_suite(layout: Layout, present: set[str], budget: TokenBudget) -> list:
    """{prompt, ...} as text or messages, under our names or their aliases."""
    import great_expectations.expectations as gxe

    col = dict(layout.columns)
    hint = {"sft": " (or `query`, `post`; or TRL's `messages` alone)",
            "prefs": " (or `query`, `post`; or TRL's implicit prompt: conversations in `chosen` and `rejected`)",
            "prompts": " (or `query`, `post`)"}[layout.kind]
    suite = [gxe.ExpectColumnToExist(column=col[f], description=f"column `{col[f]}` exists"
                                     + (hint if f == "prompt" and col[f] == "prompt" else ""))
             for f in SCHEMA[layout.kind]]
    fields = [(f, c) for f, c in col.items() if c in present]
    for f, c in fields:
        if f in SCHEMA[layout.kind]:  # an optional column may be missing from some rows, never blank
            suite.append(gxe.ExpectColumnValuesToNotBeNull(column=c, description=f"`{c}` is present (not null or missing)"))
        suite.append(gxe.ExpectColumnValuesToMatchRegex(column=c, regex=r"\S", description=f"`{c}` is not blank"))
        if budget.tokenizer is not None:
            suite.append(_at_most(f"{c}_tokens", budget.limit(f), f"`{c}`"))
    for f, c in fields:
        if f"{c}_roles" in present:
            regex, what = (PROMPT_ROLES, PROMPT_WHAT) if f == "prompt" else \
                (ANSWER_ROLES, f"assistant messages only (the conversation before it belongs in `{col['prompt']}`)")
            suite += [gxe.ExpectColumnValuesToMatchRegex(column=f"{c}_roles", regex=regex,
                                                         description=f"`{c}` as messages: {what}"),
                      _no_blank_messages(c)]
    if "formats" in present:
        answers = [c for f, c in fields if f != "prompt"]
        suite.append(gxe.ExpectColumnValuesToBeInSet(
            column="formats", value_set=sorted(SAME_FORMAT),
            description=f"{', '.join(f'`{c}`' for c in answers)} answer the row's own `{col['prompt']}` in its "
                        "format (all text, or all messages)"))
    prompt = col["prompt"]
    if layout.kind == "prompts" and prompt in present:
        # RL and evaluation prompts are drawn once each: a repeat skews both
        suite.append(gxe.ExpectColumnValuesToBeUnique(column=prompt, description=f"each `{prompt}` appears once"))
    if layout.kind == "sft" and {prompt, col["completion"]} <= present:
        suite.append(_unique_rows([prompt, col["completion"]]))
    if layout.kind == "prefs" and {prompt, "chosen", "rejected"} <= present:
        suite += [_chosen_differs(), _unique_rows([prompt, "chosen", "rejected"])]
    return suite


def _messages_suite(layout: Layout, present: set[str], budget: TokenBudget) -> list:
    """TRL's language modeling `messages`: the conversation is checked as it is; its prompt (all but the closing
    assistant messages) and completion (those) against the token budgets, as `prepare` splits them."""
    import great_expectations.expectations as gxe

    suite = [gxe.ExpectColumnToExist(column="messages", description="column `messages` exists")]
    if "messages" not in present:
        return suite
    suite += [
        gxe.ExpectColumnValuesToNotBeNull(column="messages", description="`messages` is present (not null or missing)"),
        gxe.ExpectColumnValuesToMatchRegex(
            column="messages_roles", regex=CONVERSATION_ROLES,
            description="`messages`: an optional system message, then user and assistant turns alternating, ending "
                        "with the assistant's answer (an assistant's tool calls each followed by their tool "
                        "messages)"),
        _no_blank_messages("messages"),
    ]
    if budget.tokenizer is not None:
        suite += [_at_most("messages_prompt_tokens", budget.max_prompt_tokens,
                           "the prompt of `messages` (all before its closing assistant messages)"),
                  _at_most("messages_completion_tokens", budget.max_completion_tokens,
                           "the completion of `messages` (its closing assistant messages)")]
    suite.append(gxe.ExpectColumnValuesToBeUnique(column="messages", description="no duplicate `messages` rows"))
    return suite


def _implicit_suite(layout: Layout, present: set[str], budget: TokenBudget) -> list:
    """TRL's implicit-prompt preferences: `chosen` and `rejected` each the whole conversation, opening with the same
    prompt (their shared leading messages, as `prepare` extracts it) and ending with different answers."""
    import great_expectations.expectations as gxe

    suite = [gxe.ExpectColumnToExist(column=c, description=f"column `{c}` exists") for c in ("chosen", "rejected")]
    answers = [c for c in ("chosen", "rejected") if c in present]
    for c in answers:
        suite += [gxe.ExpectColumnValuesToNotBeNull(column=c, description=f"`{c}` is present (not null or missing)"),
                  _no_blank_messages(c)]
    if "shared_prompt_roles" in present:
        suite.append(gxe.ExpectColumnValuesToMatchRegex(
            column="shared_prompt_roles", regex=PROMPT_ROLES,
            description=f"`chosen` and `rejected` open with the same prompt: {PROMPT_WHAT}"))
    for c in answers:
        suite.append(gxe.ExpectColumnValuesToMatchRegex(
            column=f"{c}_answer_roles", regex=ANSWER_ROLES,
            description=f"`{c}` after the shared prompt: assistant messages only"))
    if budget.tokenizer is not None and answers:
        suite.append(_at_most("shared_prompt_tokens", budget.max_prompt_tokens,
                              "the prompt `chosen` and `rejected` share"))
        suite += [_at_most(f"{c}_answer_tokens", budget.max_completion_tokens, f"`{c}` after the shared prompt")
                  for c in answers]
    if len(answers) == 2:
        suite += [_chosen_differs(), _unique_rows(["chosen", "rejected"])]
    return suite


def _at_most(column: str, limit: int, what: str):
    import great_expectations.expectations as gxe

    return gxe.ExpectColumnValuesToBeBetween(column=column, min_value=0, max_value=limit,
                                             description=f"{what} has at most {limit} tokens (policy tokenizer)")


def _no_blank_messages(column: str):
    import great_expectations.expectations as gxe

    return gxe.ExpectColumnValuesToBeBetween(column=f"{column}_blank_messages", min_value=0, max_value=0,
                                             description=f"every message of `{column}` has non-blank text content")


def _chosen_differs():
    import great_expectations.expectations as gxe

    return gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(column_list=["chosen", "rejected"],
                                                              description="`chosen` differs from `rejected`")


def _unique_rows(columns: list[str]):
    import great_expectations.expectations as gxe

    return gxe.ExpectCompoundColumnsToBeUnique(
        column_list=columns, description=f"no duplicate ({', '.join(f'`{c}`' for c in columns)}) rows")


def run_suites(batches: Mapping[str, tuple[pd.DataFrame, list]]) -> dict[str, list[dict]]:
    """Validate each named (frame, expectations) in one ephemeral GX context; report entries in suite order."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)  # one bar per metric otherwise
    batch = context.data_sources.add_pandas("datasets").add_dataframe_asset("frame") \
        .add_batch_definition_whole_dataframe("whole")
    out = {}
    for name, (frame, expectations) in batches.items():
        suite = context.suites.add(gx.ExpectationSuite(name=name, expectations=expectations))
        validation = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
        result = validation.run(batch_parameters={"dataframe": frame},
                                result_format={"result_format": "COMPLETE", "partial_unexpected_count": MAX_EXAMPLES})
        order = {e.id: i for i, e in enumerate(suite.expectations)}
        entries = sorted(result.results, key=lambda r: order.get(r.expectation_config.id, len(order)))
        out[name] = [report_entry(r) for r in entries]
    return out


def report_entry(result) -> dict:
    """One GX expectation result as a report entry."""
    config = result.expectation_config
    details = result.result or {}
    rows = [int(i) for i in details.get("unexpected_index_list") or [] if not isinstance(i, Mapping)]
    error = _exception_message(result.exception_info)
    return entry(config.type, config.description,
                 config.kwargs.get("column") or ", ".join(config.kwargs.get("column_list") or []),
                 list(zip(rows, details.get("unexpected_list") or [], strict=False)),
                 success=bool(result.success) and not error,
                 unexpected_count=int(details.get("unexpected_count") or 0),
                 error=f"could not be evaluated: {error}" if error else None)


def entry(expectation: str, description: str, column: str, unexpected: Sequence[tuple[int, object]], *,
          success: bool | None = None, unexpected_count: int | None = None, error: str | None = None) -> dict:
    """A report entry, the same for GX expectations and plain checks: what was expected, where, and the rows
    (numbered from 1) that broke it, with a few example values."""
    out = {
        "expectation": expectation,
        "description": description,
        "column": column,
        "success": not unexpected and not error if success is None else success,
        "unexpected_count": len(unexpected) if unexpected_count is None else unexpected_count,
        "rows": [row for row, _ in unexpected[:MAX_ROWS]],
        "examples": [{"row": row, "value": shorten(value)} for row, value in unexpected[:MAX_EXAMPLES]],
    }
    if error:
        out["error"] = error
    return out


def _exception_message(info) -> str | None:
    """GX reports an expectation that crashed in exception_info (flat, or keyed by metric) instead of raising."""
    if not info:
        return None
    candidates = [info] if "raised_exception" in info else list(info.values())
    for item in candidates:
        if isinstance(item, Mapping) and item.get("raised_exception"):
            return str(item.get("exception_message") or "unknown error").splitlines()[0][:300]
    return None


def shorten(value):
    """Example values as JSON-friendly, readable scalars: NaN as null, long texts cut."""
    if isinstance(value, Mapping):
        return {k: shorten(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [shorten(v) for v in value]
    if value is None or (isinstance(value, float) and value != value):
        return None
    if hasattr(value, "item"):  # numpy / pandas scalars
        value = value.item()
    if isinstance(value, str) and len(value) > MAX_CHARS:
        return value[:MAX_CHARS] + "…"
    return value if isinstance(value, str | int | float | bool) else repr(value)
