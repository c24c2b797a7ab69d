"""Stage `sft`: the supervised policy (trained here, or a pretrained one evaluated as is)."""

from __future__ import annotations

from rlhf_core.hub import load_tokenizer
from rlhf_core.jsonio import write_json
from rlhf_core.models import load_policy, save_model
from rlhf_core.runtime import Runtime
from rlhf_core.sft_trainer import evaluate_sft, train_sft
from tasks.data.datasets import read_split
from tasks.demo_world.gold_wiring import gold_fn
from tasks.demo_world.tiny_models import tiny_policy
from tasks.execution.figures import results
from tasks.parameters.params import Params
from tasks.parameters.paths import Paths
from tasks.tracking.progress import epoch_callback, progress_bar


def run(params: Params, paths: Paths) -> dict:
    cfg = params.sft
    runtime = Runtime(params.runtime, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    main = runtime.is_main_process
    tokenizer = load_tokenizer(paths.tokenizer)
    eval_rows = read_split(paths, "sft_eval", tokenizer, params)
    prompt_rows = read_split(paths, "prompts_eval", tokenizer, params)
    if cfg.pretrained:  # evaluated as is, by the main process, whatever the launch (it is saved as the SFT policy)
        if not main:
            return {}
        model, metrics, engine = runtime.load_whole(load_policy, cfg.pretrained), {}, None
    else:
        model = load_policy(cfg.base_model, **runtime.load_kwargs) if cfg.base_model else tiny_policy(params, tokenizer)
        with progress_bar("sft", total=cfg.epochs, enabled=main) as update:
            result = train_sft(params.sft_config(), runtime.trainable(model), tokenizer,
                               read_split(paths, "sft_train", tokenizer, params), eval_rows, accelerator=runtime.accelerator,
                               progress=epoch_callback(update, cfg.epochs))
        model, metrics, engine = result.model, {"train_seconds": result.train_seconds}, result.engine
    with runtime.whole_weights(engine):  # every rank trained; rank 0 evaluates and writes, on whole weights
        if main:
            with runtime.autocast():
                metrics.update(evaluate_sft(model, tokenizer, prompt_rows, cfg.eval_max_new_tokens,
                                            cfg.eval_batch_size, eval_rows=eval_rows, gold=gold_fn(params), cfg=cfg))
            save_model(model, tokenizer, paths.sft_model)
        runtime.accelerator.wait_for_everyone()
    if not main:
        return {}
    metrics.update(runtime.layout)
    write_json(paths.metrics_file("sft"), results(metrics))  # train_seconds: reports/execution/
    return metrics
