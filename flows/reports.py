"""What a pipeline run shows as Prefect artifacts, built from the files the stages leave (markdown text).

Pure functions of the workspace: each returns None when its file is not there, so a run only publishes
the reports of the stages it has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_core import chat
from rlhf_core.jsonio import read_json_object, read_jsonl
from tasks.tracking.registry import registry_verdict

# artifact key -> (stage whose output it shows, file under the workspace root)
STAGE_REPORTS = {
    "rlhf-validation": ("validate", "reports/validation/summary.md"),
    "rlhf-inspection": ("inspect", "reports/inspection/summary.md"),
}
EVAL_METRICS = ("win_rate_rm", "win_rate_gold", "mean_score_rm", "ref_mean_score_rm", "mean_score_gold",
                "ref_mean_score_gold", "mean_kl", "eos_rate", "ref_eos_rate", "mean_length", "ref_mean_length")
HEAD_ROWS = 5


def _text(value: Any, width: int = 120) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    text = text.replace("\n", " ⏎ ")
    return text if len(text) <= width else text[:width - 1] + "…"


def _cell(value: Any, width: int = 120) -> str:
    return _text(value, width).replace("|", "\\|")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _flat(result: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in result.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def stage_result(stage: str, result: dict) -> str:
    """The result `rlhf stage` prints (a JSON object) as a person reads it in a log: one key per line, sorted,
    values aligned, floats to 4 significant digits, inner objects' keys joined with '/'."""
    flat = _flat(result)
    width = max((len(key) for key in flat), default=0)
    lines = [f"  {key:<{width}}  {_text(value)}" for key, value in sorted(flat.items())]
    return "\n".join([f"{stage}'s result (to 4 digits; its log has every digit):", *lines])


def run_parameters(profile: str, overrides: list[str], changes: list[tuple[str, Any, Any]], record: Path) -> str:
    lines = [f"# Run parameters\n\nprofile: `{profile}`\n\noverrides: "
             + (", ".join(f"`{o}`" for o in overrides) if overrides else "none")]
    if changes:
        lines.append("\nparams.yaml for this run only (restored when it ends):\n")
        lines.append(markdown_table(["key", "before", "now"], [[k, old, new] for k, old, new in changes]))
    else:
        lines.append("\nparams.yaml unchanged.")
    lines.append(f"\nRecord: `{record}`")
    return "\n".join(lines) + "\n"


def evaluation(root: Path) -> str | None:
    """metrics/eval.json as a table, the champion decision, and the first completions side by side."""
    metrics = read_json_object(root / "metrics" / "eval.json")
    if metrics is None:
        return None
    shown = [k for k in EVAL_METRICS if k in metrics] + sorted(set(metrics) - set(EVAL_METRICS))
    parts = ["# Evaluation\n", markdown_table(["metric", "value"], [[k, metrics[k]] for k in shown])]
    register = read_json_object(root / "metrics" / "register.json")
    if register is not None:
        parts.append(f"\n**Registry:** {registry_verdict(root, register)}")
    completions = root / "reports" / "eval" / "completions.jsonl"
    if completions.is_file():
        rows = read_jsonl(completions)[:HEAD_ROWS]
        gold = ["score_gold", "ref_score_gold"] if rows and "score_gold" in rows[0] else []  # the world has it
        scores = ["score_rm", "ref_score_rm", *gold]
        parts.append(f"\n## First {len(rows)} completions (reports/eval/completions.jsonl)\n")
        parts.append(markdown_table(["prompt", "policy", "reference", *(s.replace("score_", "") for s in scores)],
                                    [[chat.as_text(r.get("prompt", "")), r.get("completion"), r.get("ref_completion"),
                                      *(r.get(s) for s in scores)] for r in rows]))
    return "\n".join(parts) + "\n"


def stage_report(root: Path, key: str) -> str | None:
    path = root / STAGE_REPORTS[key][1]
    return path.read_text() if path.is_file() else None


def mlflow_run(run_id: str, uri: str, url: str | None) -> str:
    where = f"[open the run]({url})" if url else "no UI link for this store"
    return (f"# MLflow run\n\nrun id: `{run_id}`; {where}\n\nBrowse locally: "
            f"`mlflow ui --backend-store-uri {uri}`\n")
