"""Stage `evaluate`: greedy completions of the trained and the reference (SFT) policy, scored by the reward
model and, in the demo world, by the gold reward; metrics, a per-example table, the per-prompt scores (a sweep's
bootstrap over prompts reads reports/eval/scores.json) and plots. With train.tools or train.environment_factory the
completions are greedy multi-turn rollouts with those tools, and the tool-call and failure rates join the metrics."""

from __future__ import annotations

import hashlib
import json

from rlhf_core import chat
from rlhf_core.greedy_eval import evaluate
from rlhf_core.hub import load_tokenizer
from rlhf_core.jsonio import read_json, read_jsonl, write_json, write_jsonl
from rlhf_core.models import load_policy, load_scorer_model
from rlhf_core.multi_turn import ToolRollouts
from rlhf_core.runtime import Runtime
from rlhf_core.scoring import RewardModelScorer
from tasks.data.datasets import read_split
from tasks.demo_world.gold_wiring import gold_fn
from tasks.parameters.params import Params
from tasks.parameters.paths import Paths
from tasks.reports.plots import plot_evaluation
from tasks.tracking.progress import count_callback, progress_bar

SCORES_FILE = "scores.json"  # in reports/eval/: each prompt's scores, policy and reference (a sweep's bootstrap)


def tool_rollouts(params: Params, tokenizer, rows: list[dict]) -> ToolRollouts | None:
    """The training's tools and environment over the evaluation rows, at evaluate's completion budget; None
    without tools."""
    if not params.train.uses_tools:
        return None
    cfg = params.rl_config().model_copy(update={"response_length": params.evaluate.response_length})
    return ToolRollouts(cfg, tokenizer, rows, template_kwargs=params.prepare.chat_template_kwargs)


def run(params: Params, paths: Paths) -> dict:
    cfg = params.evaluate
    runtime = Runtime(params.runtime)
    if not runtime.is_main_process:  # launched with the others (the runtime of every model stage): rank 0 evaluates
        return {}
    tokenizer = load_tokenizer(paths.policy)
    prompts = [row["prompt"] for row in read_split(paths, "prompts_eval", tokenizer, params)[:cfg.num_prompts]]
    policy, reference, reward = (runtime.load_frozen(loader, source, sharded=False) for loader, source in
                                 ((load_policy, paths.policy), (load_policy, paths.sft_model),
                                  (load_scorer_model, paths.reward_model)))
    scorer = RewardModelScorer(reward, batch_size=cfg.batch_size)
    stored = read_jsonl(paths.split("prompts_eval"))[:cfg.num_prompts]
    with progress_bar("evaluate", total=2 * len(prompts)) as update, runtime.autocast():
        report = evaluate(policy, reference, tokenizer, prompts, scorer=scorer,
                          response_length=cfg.response_length, temperature=params.train.temperature,
                          gold=gold_fn(params), batch_size=cfg.batch_size,
                          on_batch=count_callback(update, "completions"), tools=tool_rollouts(params, tokenizer, stored))
    for row, original in zip(report.rows, stored, strict=True):  # the table shows a conversation's messages
        if chat.is_conversation(original["prompt"]):
            row["prompt"] = original["prompt"]
    out = paths.reports / "eval"
    write_jsonl(out / "completions.jsonl", report.rows)
    # the prompts' hash tells a sweep which points were scored on the same prompts (their bootstrap draws pair)
    prompts_md5 = hashlib.md5(json.dumps([row["prompt"] for row in stored]).encode()).hexdigest()
    write_json(out / SCORES_FILE, {"prompts_md5": prompts_md5, **report.per_prompt_scores()})
    history_file = paths.train_history
    plot_evaluation(report.rows, read_json(history_file) if history_file.is_file() else [], out)
    summary = {**report.summary, **runtime.layout}
    write_json(paths.metrics_file("eval"), summary)
    return summary
