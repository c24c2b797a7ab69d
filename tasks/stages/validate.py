"""Stage `validate` and `rlhf validate`: every dataset is checked before any model trains on it.

Each split in data/ is validated with the Great Expectations suite of its kind (tasks/checks/gx_suites.py), plus
plain checks for what GX does not express on one frame: values that are not strings, prompts shared between
train and eval splits, and files that cannot be read at all. The stage writes `reports/validation/report.json`
(every expectation: column, success, unexpected count, example rows), `reports/validation/summary.md` (each
failed expectation with example rows) and `metrics/validate.json`, then fails when anything failed, so
`dvc repro` never trains on data that failed validation.

Tool-call data (TRL's tool calling: a `tools` column of function schemas, assistant messages with `tool_calls`,
`tool` messages) is checked too: the schemas, every call well formed and naming one of them, the order of calls and
results; its token lengths are those of the text rendered with the row's tools, by a chat template that must render
tools at all (else one error naming the file, the row and what is expected).

`rlhf validate FILE --kind K` checks a source file as it is, in whichever layout `prepare` reads it
(tasks/data/layouts.py: our columns or their aliases, TRL's `messages`, TRL's implicit-prompt pairs), so a file
passes here exactly when `prepare` can read it into rows that pass the stage's checks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from rlhf_core import chat
from rlhf_core.jsonio import atomic_path, write_json
from rlhf_core.sources import SourceError, load_rows
from tasks.checks.gx_suites import (
    LAYOUT_KIND,
    TokenBudget,
    build_suite,
    entry,
    run_suites,
    with_token_counts,
)
from tasks.data.layouts import EXPLICIT, IMPLICIT, MESSAGES, Layout, detect_layout, explicit_prompt
from tasks.execution.errors import VerdictFailed
from tasks.parameters.params import Params, ParamsError, load_params
from tasks.parameters.paths import SPLITS, Paths

SPLIT_KINDS = {"sft": "sft", "prefs": "preferences", "prompts": "prompts"}  # split name prefix -> kind
REPORT_DIR = "validation"  # under reports/
DEFAULT_TOKENIZER = Path("models/tokenizer")  # what `prepare` writes: the policy tokenizer


class ValidateError(ValueError):
    """Validation could not run (unreadable file, tokenizer, params); the message names the file and line."""


class ValidationFailed(VerdictFailed, RuntimeError):
    """Some expectation failed; the message lists them and where the full report is."""


def kind_of_split(name: str) -> str:
    return SPLIT_KINDS[name.split("_")[0]]


# -- reading -------------------------------------------------------------------------------------------------

def read_dataset(path: str | Path) -> list[dict]:
    """The file's records, or a ValidateError naming the file (and line) that says why it cannot be read."""
    path = Path(path)
    if not path.exists():
        raise ValidateError(f"{path}: no such file")
    if not path.is_file():
        raise ValidateError(f"{path}: not a file; expected a .jsonl, .json or .parquet file")
    try:
        rows = load_rows(path)
    except SourceError as err:
        raise ValidateError(str(err)) from None
    if not rows:
        raise ValidateError(f"{path}: no records; expected at least one row")
    return rows


# -- checks --------------------------------------------------------------------------------------------------

def _is_null(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def to_frame(rows: list[dict], layout: Layout) -> tuple[pd.DataFrame, list[dict]]:
    """The layout's columns, as the file names them, in a frame whose index is the row number (from 1), and the
    plain check that every value is text or a conversation (TRL's list of {role, content} messages; only a
    conversation where the prompt lives inside it); other values (numbers, odd lists) reach GX as their JSON text.
    A conversational dataset also gets its structure as plain columns: `<column>_roles`, `<column>_blank_messages`,
    the row's `formats` (all text, all messages, or mixed) and, for an implicit prompt, the roles of the prompt
    `chosen` and `rejected` share and of the answers after it."""
    frame = pd.DataFrame(rows, index=pd.RangeIndex(1, len(rows) + 1), dtype=object)
    columns = [c for c in layout.columns.values() if c in frame.columns]
    frame = frame[columns]
    conversational = layout.conversation_only or any(chat.is_conversation(v) for c in columns for v in frame[c])
    checks = []
    for column in columns:
        values = frame[column].tolist()
        if layout.conversation_only:
            bad = [(row, v) for row, v in zip(frame.index, values, strict=True)
                   if not (_is_null(v) or chat.is_conversation(v))]
            checks.append(entry("values_are_messages", f"`{column}` is a list of {{role, content}} messages (the "
                                f"{layout.name} layout: the prompt is inside the conversation)", column, bad))
        else:
            bad = [(row, v) for row, v in zip(frame.index, values, strict=True)
                   if not (_is_null(v) or chat.value_format(v) != "invalid")]
            checks.append(entry("values_are_text_or_messages",
                                f"`{column}` is a string or a list of {{role, content}} messages", column, bad))
        frame[column] = [None if _is_null(v) else v if isinstance(v, str) else json.dumps(v) for v in values]
        if conversational:
            frame[f"{column}_roles"] = [chat.roles(v) for v in values]
            frame[f"{column}_blank_messages"] = pd.Series([chat.blank_messages(v) for v in values],
                                                          index=frame.index, dtype="Int64")
    if layout.name == IMPLICIT and len(columns) == 2:
        parts = [_implicit_parts(row) for row in rows]
        frame["shared_prompt_roles"] = [p and ",".join(str(m["role"]) for m in p[0]) for p in parts]
        for i, name in ((1, "chosen_answer"), (2, "rejected_answer")):  # no shared prompt: that check says so
            frame[f"{name}_roles"] = [",".join(str(m["role"]) for m in p[i]) if p and p[0] else None for p in parts]
    if layout.name == EXPLICIT and conversational and len(columns) > 1:
        frame["formats"] = [_row_format([row.get(c) for c in columns]) for row in rows]
    if chat.first_tool_use(rows) is not None:
        frame = frame.join(tool_columns(rows, columns, frame.index))
    return frame, checks


def tool_columns(rows: list[dict], columns: list[str], index: pd.Index) -> pd.DataFrame:
    """Tool calling as plain columns GX checks (gx_suites `_tool_suite`): `tools_invalid`, the JSON text of a
    `tools` value that is not a list of function schemas (null when it is, or when the row has none), and
    `<column>_bad_tool_calls`, how many calls of each conversation are malformed or name no function of the row's
    `tools`."""
    tools = [chat.row_tools(row) for row in rows]
    out = pd.DataFrame(index=index)
    if any("tools" in row for row in rows):
        out["tools_invalid"] = [None if t is None or chat.tool_names(t) is not None else json.dumps(t) for t in tools]
    for column in columns:
        out[f"{column}_bad_tool_calls"] = pd.Series(
            [chat.bad_tool_calls(row.get(column), t) for row, t in zip(rows, tools, strict=True)], index=index,
            dtype="Int64")
    return out


def _implicit_parts(row: dict) -> tuple[list, list, list] | None:
    """(shared prompt, chosen answer, rejected answer) as `prepare` extracts them; None unless both are messages."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if not (chat.is_conversation(chosen) and chat.is_conversation(rejected)):
        return None
    return chat.extract_shared_prompt(chosen, rejected)


def measured(layout: Layout) -> dict[str, str]:
    """Our field -> the frame column whose token count bounds it (`<column>_tokens`): the file's column, or for a
    prompt inside conversations the part `prepare` splits off."""
    if layout.name == MESSAGES:
        return {"prompt": "messages_prompt", "completion": "messages_completion"}
    if layout.name == IMPLICIT:
        return {"prompt": "shared_prompt", "chosen": "chosen_answer", "rejected": "rejected_answer"}
    return dict(layout.columns)


def _row_format(values: list) -> str | None:
    """"text" or "messages" when a row's present values share that format, else what they are ("text/messages")."""
    formats = [chat.value_format(v) for v in values if not _is_null(v)]
    if not formats:
        return None
    return formats[0] if len(set(formats)) == 1 else "/".join(formats)


def rendered_texts(rows: list[dict], layout: Layout, budget: TokenBudget) -> tuple[dict[str, list], dict]:
    """Each measured part (see `measured`) as the policy reads it: the row as `prepare` converts it, conversations
    through the tokenizer's chat template; and the plain check that every conversation renders. A row whose
    conversation is malformed has no parts (its structure checks report it)."""
    parts = measured(layout)
    texts: dict[str, list] = {column: [] for column in parts.values()}
    failed = []
    for number, row in enumerate(rows, 1):
        ours = explicit_prompt(row, layout.kind)
        rendered = {}
        if not layout.conversation_only or all(chat.is_conversation(ours.get(f)) for f in parts):
            try:
                rendered = chat.render_row({"tools": ours.get("tools"), **{f: ours.get(f) for f in parts}},
                                           budget.tokenizer, budget.template_kwargs)
            except Exception as err:  # noqa: BLE001 - Jinja and templates raise anything; the report says what
                failed.append((number, f"{type(err).__name__}: {err}"))
        for field, column in parts.items():
            texts[column].append(rendered.get(field))
    check = entry("conversations_render", "conversations render with the tokenizer's chat template", "", failed)
    return texts, check


def leakage_checks(frames: Mapping[str, pd.DataFrame]) -> dict[str, dict]:
    """For each `*_eval` frame: its rows whose prompt is also in a `*_train` frame (held-out evaluation must
    not score prompts a model trained on)."""
    seen_in: dict[str, list[str]] = {}
    for name, frame in frames.items():
        if name.endswith("_train") and "prompt" in frame:
            for prompt in frame["prompt"].dropna().unique():
                seen_in.setdefault(prompt, []).append(name)
    checks = {}
    for name, frame in frames.items():
        if name.endswith("_eval") and "prompt" in frame:
            bad = [(row, {"prompt": p, "also_in": ", ".join(seen_in[p])})
                   for row, p in frame["prompt"].items() if p in seen_in]
            checks[name] = entry("no_prompt_shared_with_train_splits",
                                 "no `prompt` also appears in a train split", "prompt", bad)
    return checks


def validate_files(datasets: Mapping[str, tuple[Path, str]], budget: TokenBudget, *, cross_split: bool = False,
                   root: Path | None = None) -> dict:
    """Validate each named (path, kind); with cross_split, eval splits must share no prompt with train splits.

    Returns the report: {success, token_budget, datasets: [{name, path, kind, layout, rows, success, checks}]}.
    """
    reports, batches, plain, frames = {}, {}, {}, {}
    for name, (path, kind) in datasets.items():
        reports[name] = {"name": name, "path": _shown(path, root), "kind": kind, "rows": 0}
        try:
            rows = read_dataset(path)
        except ValidateError as err:
            reports[name]["checks"] = [entry("file_is_readable", "the file can be read", "", [], error=str(err))]
            continue
        layout = detect_layout(rows, LAYOUT_KIND[kind])
        if budget.tokenizer is not None and not getattr(budget.tokenizer, "chat_template", None) \
                and chat.is_conversational(rows):  # one error of the setup, not a failed check on every row
            raise ValidateError(f"{path} is conversational but the tokenizer "
                                f"{budget.tokenizer.name_or_path!r} has no chat template, so its conversations "
                                "cannot be rendered and measured in tokens. Use a chat model's tokenizer "
                                "(--tokenizer), set prepare.chat_template in params.yaml to a Jinja file, or pass "
                                "--skip-token-lengths")
        if budget.tokenizer is not None:
            _check_tool_template(path, rows, budget)
        frame, plain[name] = to_frame(rows, layout)
        frames[name] = frame
        if budget.tokenizer is not None:
            texts, rendering = rendered_texts(rows, layout, budget)
            frame = with_token_counts(frame, texts, budget.tokenizer)
            if any(c.endswith("_roles") for c in frame.columns):  # conversational: rendering is a check too
                plain[name].append(rendering)
        batches[name] = (frame, build_suite(layout, frame, budget))
        reports[name].update(rows=len(rows), layout=layout.name)
    results = run_suites(batches) if batches else {}
    leaks = leakage_checks(frames) if cross_split else {}
    for name, gx_checks in results.items():
        reports[name]["checks"] = gx_checks + plain[name] + ([leaks[name]] if name in leaks else [])
    for report in reports.values():
        report["success"] = all(check["success"] for check in report["checks"])
    return {
        "success": all(report["success"] for report in reports.values()),
        "token_budget": {"tokenizer": budget.tokenizer and _shown(Path(budget.tokenizer.name_or_path), root),
                         "max_prompt_tokens": budget.max_prompt_tokens,
                         "max_completion_tokens": budget.max_completion_tokens},
        "datasets": list(reports.values()),
    }


def _check_tool_template(path: Path, rows: list[dict], budget: TokenBudget) -> None:
    """One error of the setup, not a failed check on every row: tool-call rows need a chat template that renders a
    tool exchange (rlhf_core/tool_chat.py `check_tool_rendering`, TRL's `supports_tool_calling`)."""
    from rlhf_core.tool_chat import check_tool_rendering

    used = chat.first_tool_use(rows)
    if used is None:
        return
    try:
        check_tool_rendering(budget.tokenizer, budget.template_kwargs)
    except ValueError as err:
        row, column = used
        raise ValidateError(f"{path}: row {row + 1} uses tools (`{column}`) but the tokenizer "
                            f"{budget.tokenizer.name_or_path!r} cannot render them ({str(err).removeprefix('tools: ')})."
                            " Expected a chat template that renders a row's `tools`, assistant `tool_calls` and "
                            "`tool` messages (TRL's tool-calling format): use such a model's tokenizer (--tokenizer), "
                            "set prepare.chat_template in params.yaml to one, or pass --skip-token-lengths") from None


def _shown(path: Path, root: Path | None) -> str:
    """Paths relative to the workspace: the report is a DVC dependency and must not change with its location."""
    return str(path.relative_to(root)) if root and path.is_relative_to(root) else str(path)


# -- what users read -----------------------------------------------------------------------------------------

def failures(report: dict) -> list[tuple[dict, dict]]:
    """(dataset, check) for every failed check."""
    return [(d, c) for d in report["datasets"] for c in d["checks"] if not c["success"]]


def _code(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def describe(check: dict) -> str:
    """One line: what failed, where, and on which rows."""
    where = f"`{check['expectation']}`" + (f" on `{check['column']}`" if check["column"] else "")
    if check.get("error"):
        return f"**{check['description']}** ({where}): {check['error']}"
    if not check["unexpected_count"]:
        return f"**{check['description']}** ({where}): failed"
    count = check["unexpected_count"]
    rows = ", ".join(map(str, check["rows"])) + (", …" if count > len(check["rows"]) else "")
    return f"**{check['description']}** ({where}): {count} row{'s' * (count > 1)} (row{'s' * (count > 1)} {rows})"


def summary_markdown(report: dict) -> str:
    failed = failures(report)
    total = sum(len(d["checks"]) for d in report["datasets"])
    rows = sum(d["rows"] for d in report["datasets"])
    verdict = f"FAILED: {len(failed)} of {total} checks failed" if failed else f"passed: {total} checks"
    lines = [f"# Data validation {verdict}", "",
             f"{len(report['datasets'])} dataset(s), {rows} rows. Rows are numbered from 1 (the line of a JSONL file "
             "without blank lines).", ""]
    budget = report["token_budget"]
    if budget["tokenizer"] is None:
        lines += ["Token lengths were not checked: no tokenizer (pass `--tokenizer DIR`).", ""]
    else:
        lines += [f"Token budgets ({budget['tokenizer']}): prompt ≤ {budget['max_prompt_tokens']}, "
                  f"completions ≤ {budget['max_completion_tokens']}.", ""]
    lines += ["| dataset | kind | layout | rows | checks | failed |", "|---|---|---|---:|---:|---:|"]
    for d in report["datasets"]:
        bad = sum(not c["success"] for c in d["checks"])
        lines.append(f"| {d['name']} | {d['kind']} | {d.get('layout', '')} | {d['rows']} | {len(d['checks'])} "
                     f"| {bad} |")
    for d in report["datasets"]:
        bad = [c for c in d["checks"] if not c["success"]]
        if not bad:
            continue
        lines += ["", f"## {d['name']} (`{d['path']}`): {len(bad)} failed", ""]
        for check in bad:
            lines.append(f"- {describe(check)}")
            lines += [f"  - row {ex['row']}: {_code(ex['value'])}" for ex in check["examples"]]
    return "\n".join(lines) + "\n"


def validation_counts(report: dict) -> dict:
    """metrics/validate.json: rows and failed checks per dataset and in total."""
    counts = {"success": report["success"], "checks": sum(len(d["checks"]) for d in report["datasets"]),
              "failed": len(failures(report)), "rows": sum(d["rows"] for d in report["datasets"])}
    for d in report["datasets"]:
        counts[d["name"]] = {"rows": d["rows"], "failed": sum(not c["success"] for c in d["checks"])}
    return counts


# -- entry points --------------------------------------------------------------------------------------------

def run(params: Params, paths: Paths) -> dict:
    """Validate every split of data/ with its kind; write the report, summary and counts; fail on any failure."""
    from rlhf_core.hub import load_tokenizer

    cfg = params.prepare
    budget = TokenBudget(load_tokenizer(paths.tokenizer), cfg.max_prompt_tokens, cfg.max_completion_tokens,
                         cfg.chat_template_kwargs)
    datasets = {name: (paths.split(name), kind_of_split(name)) for name in SPLITS}
    report = validate_files(datasets, budget, cross_split=True, root=paths.root)
    out = paths.reports / REPORT_DIR
    with atomic_path(out, directory=True) as tmp:
        (tmp / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        (tmp / "summary.md").write_text(summary_markdown(report))
    counts = validation_counts(report)
    write_json(paths.metrics_file("validate"), counts)
    if not report["success"]:
        listed = "\n".join(f"  {d['name']}: {describe(c).replace('**', '')}" for d, c in failures(report))
        raise ValidationFailed(f"data validation failed ({counts['failed']} of {counts['checks']} checks); "
                               f"see {out / 'summary.md'}\n{listed}")
    return counts


def check_file(path: str | Path, kind: str, tokenizer: str | None = None, max_prompt_tokens: int | None = None,
               max_completion_tokens: int | None = None, skip_token_lengths: bool = False) -> dict:
    """`rlhf validate`: one file against its kind's suite. Budgets default to params.yaml's `prepare` section
    (of the current directory), the tokenizer to the pipeline's (pipeline_tokenizer); with none, the command
    fails rather than pass prompts that the pipeline would later drop as too long."""
    try:
        cfg = load_params(".").prepare
    except ParamsError as err:
        raise ValidateError(str(err)) from None
    max_prompt_tokens = max_prompt_tokens or cfg.max_prompt_tokens
    name = None if skip_token_lengths else tokenizer or pipeline_tokenizer(cfg, max_prompt_tokens)
    loaded = _load_tokenizer(name) if name else None
    if loaded is not None and cfg.chat_template and not getattr(loaded, "chat_template", None):
        template = Path(cfg.chat_template)  # what `prepare` gives the pipeline's tokenizer
        if template.is_file():
            loaded.chat_template = template.read_text(encoding="utf-8")
    budget = TokenBudget(loaded, max_prompt_tokens, max_completion_tokens or cfg.max_completion_tokens,
                         cfg.chat_template_kwargs)
    path = Path(path)
    report = validate_files({path.stem: (path, kind)}, budget)
    unreadable = [c["error"] for c in report["datasets"][0]["checks"] if c["expectation"] == "file_is_readable"]
    if unreadable:  # a file that cannot be read is an error of the command, not a failed expectation
        raise ValidateError(unreadable[0])
    return report


def pipeline_tokenizer(cfg, max_prompt_tokens: int) -> str:
    """The tokenizer the pipeline measures lengths with: params.yaml's prepare.tokenizer (a real profile's),
    else the one `prepare` trained (models/tokenizer); a ValidateError saying what to do when there is none."""
    if cfg.tokenizer:
        return cfg.tokenizer
    if DEFAULT_TOKENIZER.is_dir():
        return str(DEFAULT_TOKENIZER)
    raise ValidateError(f"no tokenizer to check token lengths with (prompts <= {max_prompt_tokens} tokens): "
                        f"params.yaml names no prepare.tokenizer and {DEFAULT_TOKENIZER} does not exist yet. Run "
                        "`rlhf stage prepare` (it trains the demo's tokenizer), pass --tokenizer DIR_OR_HUB_ID, "
                        "or --skip-token-lengths")


def _load_tokenizer(name: str):
    from rlhf_core.hub import load_tokenizer

    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as err:
        raise ValidateError(f"--tokenizer {name}: {err}") from None
