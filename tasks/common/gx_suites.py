"""Great Expectations suites for the three dataset kinds, and their results as plain report entries.

A suite is a list of GX expectations built from the kind, the columns the frame has and the token budgets.
Token lengths are not something GX can measure, so the frame gets a `<column>_tokens` column (counts of the
policy tokenizer, of the text the chat template renders for a conversation) that a plain
`ExpectColumnValuesToBeBetween` bounds. Conversations (TRL's message lists) get the same treatment: their structure
becomes plain columns (`<column>_roles`, `<column>_blank_messages`, `formats`) that regex, range and set
expectations check. Rows are numbered from 1 (the frame's
index), so every unexpected row GX reports is the row number a user finds in the file. Values that are not
strings reach GX as their JSON text (tasks/stages/validate.py reports them with a plain check): GX fingerprints and
hashes every value, and a raw JSON list would crash it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd

KINDS = ("prompts", "sft", "preferences")
REQUIRED = {"prompts": ("prompt",), "sft": ("prompt", "completion"), "preferences": ("prompt", "chosen", "rejected")}
OPTIONAL = {"prompts": ("reference",), "sft": (), "preferences": ()}  # checked like the others when present
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

    def limit(self, column: str) -> int:
        return self.max_prompt_tokens if column == "prompt" else self.max_completion_tokens


def text_columns(kind: str, frame: pd.DataFrame) -> list[str]:
    """The kind's text columns that the frame has."""
    return [c for c in REQUIRED[kind] + OPTIONAL[kind] if c in frame.columns]


# A prompt: an optional system message, then user and assistant turns alternating, the last from the user.
PROMPT_ROLES = r"^(?:system,)?user(?:,assistant,user)*$"
ANSWER_ROLES = r"^assistant(?:,assistant)*$"  # the conversation before an answer belongs in `prompt`
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


def build_suite(kind: str, frame: pd.DataFrame, budget: TokenBudget) -> list:
    """The expectations for a frame of this kind; each carries a readable description."""
    import great_expectations.expectations as gxe

    assert kind in KINDS, f"unknown kind {kind!r}; expected one of {KINDS}"
    suite = [gxe.ExpectColumnToExist(column=c, description=f"column `{c}` exists") for c in REQUIRED[kind]]
    for c in text_columns(kind, frame):
        if c in REQUIRED[kind]:  # an optional column may be missing from some rows, never blank
            suite.append(gxe.ExpectColumnValuesToNotBeNull(column=c, description=f"`{c}` is present (not null or missing)"))
        suite.append(gxe.ExpectColumnValuesToMatchRegex(column=c, regex=r"\S", description=f"`{c}` is not blank"))
        if budget.tokenizer is not None:
            suite.append(gxe.ExpectColumnValuesToBeBetween(
                column=f"{c}_tokens", min_value=0, max_value=budget.limit(c),
                description=f"`{c}` has at most {budget.limit(c)} tokens (policy tokenizer)"))
    present = set(frame.columns)
    for c in text_columns(kind, frame):
        if f"{c}_roles" in present:
            regex, what = (PROMPT_ROLES, "an optional system message, then user and assistant turns alternating, "
                           "the last from the user") if c == "prompt" else \
                (ANSWER_ROLES, "assistant messages only (the conversation before it belongs in `prompt`)")
            suite += [
                gxe.ExpectColumnValuesToMatchRegex(column=f"{c}_roles", regex=regex,
                                                   description=f"`{c}` as messages: {what}"),
                gxe.ExpectColumnValuesToBeBetween(column=f"{c}_blank_messages", min_value=0, max_value=0,
                                                  description=f"every message of `{c}` has non-blank text content"),
            ]
    if "formats" in present:
        answers = [c for c in text_columns(kind, frame) if c != "prompt"]
        suite.append(gxe.ExpectColumnValuesToBeInSet(
            column="formats", value_set=sorted(SAME_FORMAT),
            description=f"{', '.join(f'`{c}`' for c in answers)} answer the row's own `prompt` in its format "
                        "(all text, or all messages)"))
    if kind == "prompts" and "prompt" in present:
        # RL and evaluation prompts are drawn once each: a repeat skews both
        suite.append(gxe.ExpectColumnValuesToBeUnique(column="prompt", description="each `prompt` appears once"))
    if kind == "sft" and {"prompt", "completion"} <= present:
        suite.append(gxe.ExpectCompoundColumnsToBeUnique(
            column_list=["prompt", "completion"], description="no duplicate (`prompt`, `completion`) rows"))
    if kind == "preferences" and {"prompt", "chosen", "rejected"} <= present:
        suite += [
            gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(
                column_list=["chosen", "rejected"], description="`chosen` differs from `rejected`"),
            gxe.ExpectCompoundColumnsToBeUnique(
                column_list=["prompt", "chosen", "rejected"], description="no duplicate (`prompt`, `chosen`, `rejected`) rows"),
        ]
    return suite


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
