"""Stage `inspect` and `rlhf inspect-rm`: the reward-model inspection report (rlhf_core/reward_inspection/).

Writes reports/inspection/{report.json, summary.md, scores.png} and metrics/inspect.json, then fails the stage
when a check failed, so `train` (which depends on the report) never starts on a reward model that scores the
wrong token. The report holds no timings: an unchanged model gives a byte-identical report and DVC skips train.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import InspectionConfig
from rlhf_core.hub import load_tokenizer
from rlhf_core.jsonio import atomic_path, write_json
from rlhf_core.models import load_scorer_model
from rlhf_core.reward_inspection.report import inspect_reward_model
from rlhf_core.runtime import Runtime
from tasks.data.datasets import read_rows
from tasks.execution.errors import VerdictFailed
from tasks.parameters.params import Params
from tasks.parameters.paths import Paths

REPORT_DIR = Path("reports") / "inspection"


class InspectionFailed(VerdictFailed, RuntimeError):
    """A check failed; the message says what is wrong and how to fix it (the CLI prints it, no traceback)."""


def inspect_model(source: str | Path, cfg: InspectionConfig, runtime: Runtime, pairs: Path | None = None,
                  prompts: Path | None = None, template_kwargs: dict | None = None) -> dict:
    """Load a reward model (directory or hub id) with its tokenizer and inspect it on the given files (text or
    conversations, rendered by its tokenizer's chat template), on the runtime's device in its frozen dtype (as RL
    and evaluation score with it)."""
    model = runtime.load_frozen(load_scorer_model, source, sharded=False)  # one process inspects it
    tokenizer = load_tokenizer(source)
    pair_rows = read_rows(pairs, tokenizer, template_kwargs, ("prompt", "chosen", "rejected")) if pairs else []
    prompt_rows = read_rows(prompts, tokenizer, template_kwargs, ("prompt",)) if prompts else []
    report = inspect_reward_model(model, tokenizer, pairs=pair_rows, prompts=prompt_rows, cfg=cfg)
    report["source"] = str(source)
    return report


def write_report(report: dict, out: Path) -> None:
    """report.json, summary.md and, when texts were scored, scores.png."""
    from tasks.reports.plots import plot_inspection

    write_json(out / "report.json", report)
    with atomic_path(out / "summary.md") as tmp:
        tmp.write_text(summary_markdown(report))
    if report.get("samples"):
        plot_inspection(report["samples"], out / "scores.png")


def metrics(report: dict) -> dict:
    """The numbers DVC compares across runs."""
    out = {"passed": int(report["passed"]), "checks_failed": sum(not c["passed"] for c in report["checks"])}
    if "pairs" in report:
        out.update(pair_accuracy=report["pairs"]["accuracy"], pair_margin=report["pairs"]["margin_mean"])
    if report.get("length_bias", {}).get("correlation") is not None:
        out["length_correlation"] = report["length_bias"]["correlation"]
    for name, dist in report.get("scores", {}).items():
        out[f"score_{name}_mean"], out[f"score_{name}_std"] = dist["mean"], dist["std"]
    return out


def run(params: Params, paths: Paths) -> dict:
    out = paths.root / REPORT_DIR
    runtime = Runtime(params.runtime)
    if not runtime.is_main_process:  # launched with the others (the runtime of every model stage): rank 0 inspects
        return {}
    report = inspect_model(paths.reward_model, params.inspect, runtime,
                           pairs=paths.split("prefs_eval"), prompts=paths.split("prompts_eval"),
                           template_kwargs=params.prepare.chat_template_kwargs)
    report["source"] = "models/reward"
    write_report(report, out)
    result = {**metrics(report), **runtime.layout}
    write_json(paths.metrics_file("inspect"), result)
    if not report["passed"]:
        raise InspectionFailed(failure_message(report, out / "summary.md"))
    return result


def failure_message(report: dict, summary: Path) -> str:
    lines = [f"reward-model inspection FAILED ({len(report['failures'])} problem(s)); full report: {summary}"]
    return "\n".join(lines + [f"- {f}" for f in report["failures"]])


# ------------------------------------------------------------------------------------------- summary.md


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def summary_markdown(report: dict) -> str:
    model, tokens = report["model"], report["tokens"]
    head = model["score_head"] or {}
    lines = [f"# Reward-model inspection: {'PASSED' if report['passed'] else 'FAILED'}", "",
             f"Model `{report.get('source', '?')}`: {model['class']} ({model['model_type']}), "
             f"num_labels={model['num_labels']}, {model['parameters']:,} parameters, {model['dtype']}; "
             f"score head `{head.get('module')}` {head.get('type')} weight {head.get('weight_shape')}, "
             f"bias {head.get('bias')}; dropout modules active: {model['dropout_modules_active']}"
             f"/{model['dropout_modules']}.", "",
             f"Tokens: pad {tokens['pad_token']!r} (tokenizer id {tokens['tokenizer_pad_token_id']}, config id "
             f"{tokens['config_pad_token_id']}), EOS {tokens['eos_token']!r} (id {tokens['tokenizer_eos_token_id']})"
             f"; pad == EOS: {tokens['pad_is_eos']}; the tokenizer appends EOS itself: "
             f"{tokens['tokenizer_appends_eos']}. {tokens['eos_handling']}.", ""]
    if report["failures"]:
        lines += ["## What is wrong and how to fix it", ""] + [f"- {f}" for f in report["failures"]] + [""]
    if report["warnings"]:
        lines += ["## Warnings", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    lines += ["## Checks", "", "`forward`: the model's own forward (its own pooling). `scorer`: "
              "rlhf_core.scoring.RewardModelScorer, what reward training, RL and evaluation use.", "",
              "| path | check | result | detail |", "|---|---|---|---|"]
    lines += [f"| {c['path']} | {c['name']} | {'pass' if c['passed'] else '**FAIL**'} | {c['detail']} |"
              for c in report["checks"]]
    if "pairs" in report:
        p = report["pairs"]
        lines += ["", "## Held-out pairs", "", f"{p['n']} pairs: accuracy {_fmt(p['accuracy'])}, margin "
                  f"{_fmt(p['margin_mean'])} ± {_fmt(p['margin_std'])}. Of pairs of unequal length, the reward "
                  f"model prefers the longer completion in {_fmt(p['rm_prefers_longer'])}, the labels in "
                  f"{_fmt(p['labels_prefer_longer'])}."]
    if report.get("scores"):
        lines += ["", "## Score distribution", "", "| completions | n | mean | std | min | p05 | median | p95 | max |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(_fmt(d[k]) for k in ("n", "mean", "std", "min", "p05", "median",
                                                                      "p95", "max")) + " |"
                  for name, d in report["scores"].items()]
        bias = report["length_bias"]
        per_set = ", ".join(f"{k} {_fmt(v)}" for k, v in bias["per_set"].items())
        lines += ["", f"Length bias: corr(score, completion tokens) = {_fmt(bias['correlation'])} over "
                  f"{bias['n']} completions ({per_set}). See scores.png."]
    return "\n".join(lines) + "\n"
