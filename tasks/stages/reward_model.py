"""Stage `reward-model`: the pairwise reward model (trained here, or a pretrained one evaluated as is)."""

from __future__ import annotations

from rlhf_core import chat
from rlhf_core.hub import load_tokenizer
from rlhf_core.jsonio import read_jsonl, write_json
from rlhf_core.models import load_policy, load_scorer_model, reward_model_from_policy, save_model
from rlhf_core.reward_trainer import evaluate_reward_model, train_reward_model
from rlhf_core.runtime import Runtime
from rlhf_core.world.generator import misstated_pairs
from tasks.checks.model_checks import check_reward_model, check_tokenizers
from tasks.data.datasets import read_split
from tasks.demo_world.gold_wiring import gold_fn
from tasks.demo_world.tiny_models import tiny_reward_model
from tasks.execution.figures import results
from tasks.parameters.params import Params
from tasks.parameters.paths import Paths
from tasks.tracking.progress import epoch_callback, progress_bar


def run(params: Params, paths: Paths) -> dict:
    cfg = params.reward_model
    rm_cfg = params.reward_config()
    runtime = Runtime(params.runtime, gradient_accumulation_steps=rm_cfg.gradient_accumulation_steps)
    main, load = runtime.is_main_process, runtime.load_kwargs
    tokenizer = load_tokenizer(paths.tokenizer)
    train_rows, eval_rows = read_split(paths, "prefs_train", tokenizer, params), read_split(paths, "prefs_eval", tokenizer, params)
    gold = gold_fn(params)
    if cfg.pretrained:  # evaluated as is, by the main process, whatever the launch (it is saved as the reward model)
        if not main:
            return {}
        check_reward_model(cfg.pretrained)
        check_tokenizers(paths.tokenizer, cfg.pretrained)
        model, metrics, engine = runtime.load_whole(load_scorer_model, cfg.pretrained), {}, None
    else:
        if cfg.init_from_sft:
            model = reward_model_from_policy(load_policy(paths.sft_model, **load), seed=params.base.seed)
        else:
            model = tiny_reward_model(params, tokenizer)
        with progress_bar("reward model", total=rm_cfg.epochs, enabled=main) as update:
            result = train_reward_model(rm_cfg, runtime.trainable(model), tokenizer, train_rows, eval_rows,
                                        accelerator=runtime.accelerator,
                                        progress=epoch_callback(update, rm_cfg.epochs))
        model, metrics, engine = result.model, {"train_seconds": result.train_seconds}, result.engine
    with runtime.whole_weights(engine):  # every rank trained; rank 0 evaluates and writes, on whole weights
        if main:
            _evaluate_and_save(runtime, model, tokenizer, eval_rows, gold, params, paths, metrics)
        runtime.accelerator.wait_for_everyone()
    if not main:
        return {}
    metrics.update(runtime.layout)
    write_json(paths.metrics_file("reward"), results(metrics))  # train_seconds: reports/execution/
    return metrics


def _evaluate_and_save(runtime: Runtime, model, tokenizer, eval_rows, gold, params: Params, paths: Paths,
                       metrics: dict) -> None:
    """The held-out accuracy (against the labels and the gold reward), the world's blind-spot probe; the model saved."""
    rm_cfg = params.reward_config()
    with runtime.autocast():
        metrics.update(evaluate_reward_model(model, tokenizer, eval_rows, gold, cfg=rm_cfg))
        if gold is not None:  # the world's blind-spot probe: reference vs the same summary, one fact misstated
            seen = {chat.last_user_text(row["prompt"]) for split in ("prefs_train", "prefs_eval")
                    for row in read_jsonl(paths.split(split))}  # the posts, whatever the format
            probe = chat.render_rows(misstated_pairs(params.base.seed, len(eval_rows), exclude=seen,
                                                     conversational=params.prepare.world.conversational,
                                                     tool_task=params.prepare.world.tool_task),
                                     tokenizer, params.prepare.chat_template_kwargs)
            metrics["eval/misstated_accuracy"] = evaluate_reward_model(model, tokenizer, probe,
                                                                       cfg=rm_cfg)["eval/accuracy"]
    save_model(model, tokenizer, paths.reward_model)
