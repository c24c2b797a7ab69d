"""Stage `train`: PPO, RLOO or GRPO from the SFT policy against the reward model, with checkpoints.

A rerun after a crash resumes from the newest checkpoint made from exactly these parameters and input
models and prompts (a fingerprint is kept beside the checkpoints); any other checkpoints are discarded.
The reward-flow traces are written beside the checkpoints too (a resumed run keeps those of the updates it
does not redo) and copied to reports/trace/ at the end: no output is `persist`, so DVC keeps the stage in its
run cache, and a run with the parameters of an earlier one restores its policy instead of training again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from rlhf_core.checkpoint import CheckpointNotSaved, list_checkpoints
from rlhf_core.guards import TrainingDiverged
from rlhf_core.hub import load_tokenizer
from rlhf_core.jsonio import atomic_path, read_jsonl, write_json, write_jsonl
from rlhf_core.lora import save_lora_policy, with_lora
from rlhf_core.models import load_policy, load_scorer_model, reward_model_from_policy
from rlhf_core.reward_functions import import_reward_function
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.runtime import Runtime
from rlhf_core.scoring import FunctionScorer, GoldScorer, RewardModelScorer, Scorer, WeightedScorer
from rlhf_core.trace import trace_due, trace_update
from rlhf_core.tracking import JsonlTracker, NullTracker
from tasks.checks.model_checks import check_lora_settings, check_reward_model, check_tokenizers
from tasks.data.datasets import read_split
from tasks.demo_world.gold_wiring import gold_fn
from tasks.execution.errors import StageFailed
from tasks.execution.figures import results
from tasks.execution.launcher import checkpoint_saved
from tasks.parameters.params import Params
from tasks.parameters.paths import Paths
from tasks.tracking.progress import ProgressTracker, progress_bar
from tasks.tracking.stage_tracking import log_history, stage_tracker

TRACE_DIR = "trace"


def _fingerprint(paths: Paths, cfg_json: dict) -> str:
    """Hash of everything a checkpoint depends on: the config and the input models and prompts."""
    digest = hashlib.sha256(json.dumps(cfg_json, sort_keys=True).encode())
    inputs = [paths.split("prompts_train"), *sorted(paths.sft_model.glob("*.safetensors")),
              *sorted(paths.reward_model.glob("*.safetensors"))]
    for path in inputs:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _logged_through(paths: Paths, checkpoint: Path) -> bool:
    """Whether the train log holds every update up to the checkpoint's (a resumed run keeps their history)."""
    update = int(checkpoint.name.split("-")[-1])
    steps = {row.get("step") for row in read_jsonl(paths.train_log)} if paths.train_log.is_file() else set()
    return steps >= set(range(1, update + 1))


def _resumable(paths: Paths, fingerprint: str, main: bool) -> Path | None:
    """The newest checkpoint made from exactly these inputs and config, when the train log still has the
    history of its updates; otherwise the main process starts clean (the other ranks ask after it did, and
    find the same answer)."""
    marker = paths.checkpoints / "inputs.sha256"
    checkpoints = list_checkpoints(paths.checkpoints)
    if checkpoints and marker.is_file() and marker.read_text() == fingerprint and _logged_through(paths, checkpoints[-1]):
        return checkpoints[-1]
    if main:
        shutil.rmtree(paths.checkpoints, ignore_errors=True)
        paths.checkpoints.mkdir(parents=True)
        marker.write_text(fingerprint)
    return None


def _prepare_outputs(paths: Paths, resumed: int) -> None:
    """The log and traces of a fresh run start empty; a resumed run drops what it will redo."""
    history_file = paths.train_log
    if not resumed:
        history_file.unlink(missing_ok=True)
    elif history_file.is_file():  # drop updates logged after the checkpoint: they will be redone
        write_jsonl(history_file, [h for h in read_jsonl(history_file) if h["step"] <= resumed])
    _prune_traces(paths.checkpoints / TRACE_DIR, resumed)


def _trace_writer(params: Params, tokenizer, out: Path):
    """The trainer's on_update hook: the reward-flow trace of due updates, as JSON and a PNG heatmap."""
    cfg, every, rollouts = params.rl_config(), params.train.trace_every, params.train.trace_rollouts

    def write(trainer: RLTrainer, batch, stats) -> None:
        update = trainer.state.update
        if not trace_due(update, trainer.plan.num_updates, every):
            return
        from tasks.reports.plots import plot_trace

        trace = trace_update(batch, stats, cfg, update=update, decode=tokenizer.decode, rollouts=rollouts)
        write_json(out / f"update-{update:04d}.json", trace)
        plot_trace(trace, out / f"update-{update:04d}.png")

    return write


def _prune_traces(out: Path, resumed: int) -> None:
    """Keep only the traces of updates a resumed run will not redo (a fresh run: none)."""
    for path in out.glob("update-*.*"):
        if int(path.stem.removeprefix("update-")) > resumed:
            path.unlink()


def _publish_traces(paths: Paths) -> None:
    """reports/trace/: the whole run's traces (resumed or not), from the scratch copy beside the checkpoints."""
    out, scratch = paths.reports / TRACE_DIR, paths.checkpoints / TRACE_DIR
    with atomic_path(out, directory=True) as tmp:
        if scratch.is_dir():
            shutil.copytree(scratch, tmp, dirs_exist_ok=True)


def _write_history(path: Path, rows: list[dict]) -> None:
    """A JSON list (what DVC plots read), one update per line (git diffs it line by line)."""
    with atomic_path(path) as tmp:
        tmp.write_text("[\n" + ",\n".join(json.dumps(row, sort_keys=True) for row in rows) + "\n]\n")


def build_trainer(params: Params, paths: Paths, runtime: Runtime | None = None,
                  **hooks) -> tuple[RLTrainer, PreTrainedTokenizerBase]:
    """The RL trainer of this stage, from the workspace's SFT policy, reward model and prompts, and its tokenizer.

    The one factory: the stage and bench/rl_curve.py train the same trainer. `hooks` go to RLTrainer
    (tracker, checkpoint_dir, on_update).
    """
    cfg = params.rl_config()
    runtime = runtime or Runtime(params.runtime, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    load, lora = runtime.load_kwargs, params.train.use_peft
    tokenizer = load_tokenizer(paths.sft_model)
    policy = load_policy(paths.sft_model, **load)
    scorer = build_scorer(params, paths, runtime, tokenizer)
    value = None
    if cfg.algo == "ppo":  # a full model, with or without LoRA on the policy (as TRL's PPO)
        value = load_scorer_model(paths.reward_model, **load) if params.train.value_model_init == "reward" \
            else reward_model_from_policy(policy, seed=params.base.seed)
        value = runtime.trainable(value)
    policy = runtime.trainable(with_lora(policy, params.peft_options(), seed=params.base.seed) if lora else policy)
    texts = [r["prompt"] for r in read_split(paths, "prompts_train", tokenizer, params)]
    max_prompt = params.prepare.max_prompt_tokens  # prompts keep their end, where the TL;DR: cue is
    prompts = [ids[-max_prompt:] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    gold = gold_fn(params)  # the demo world's true reward, logged as monitor/gold beside the proxy's score
    # with tools each episode's prompt is its row's messages rendered with the tools (rlhf_core/multi_turn.py)
    tool_rows = dict(tokenizer=tokenizer, prompt_rows=read_jsonl(paths.split("prompts_train")),
                     chat_template_kwargs=params.prepare.chat_template_kwargs) if cfg.uses_tools else {}
    trainer = RLTrainer(cfg, policy, scorer, prompts, pad_token_id=tokenizer.pad_token_id,
                        stop_token_id=tokenizer.eos_token_id, value_model=value,
                        # LoRA: no copy, the reference is the policy with its adapter off; GRPO with beta 0: none
                        ref_policy=None if lora or not cfg.uses_reference
                        else runtime.load_frozen(load_policy, paths.sft_model),
                        accelerator=runtime.accelerator,
                        monitors={"gold": GoldScorer(gold, tokenizer)} if gold is not None else None, **tool_rows,
                        **hooks)
    return trainer, tokenizer


def _save_policy(trainer: RLTrainer, runtime: Runtime, params: Params, paths: Paths, tokenizer, main: bool) -> None:
    """models/policy: the trained policy; with LoRA the base with the adapter merged in (what evaluate loads and
    register logs) and the adapter alone in models/policy/adapter/. Every rank joins (sharded weights are gathered)."""
    if not params.train.use_peft:
        trainer.save_pretrained(paths.policy, tokenizer)
        return
    adapter = paths.checkpoints / "adapter"  # scratch: the adapter as PEFT saves it, before the merge
    trainer.save_pretrained(adapter)
    if main:  # the main process alone merges, on the CPU: under ZeRO-3 the base must load whole (no collective)
        with runtime._unpartitioned_loading():
            base = load_policy(paths.sft_model)
            # the adapter names its base relative to the workspace: the same bytes in every clone
            save_lora_policy(adapter, base, paths.policy, tokenizer,
                             base_name=paths.sft_model.relative_to(paths.root).as_posix())
        shutil.rmtree(adapter)


def reward_models(params: Params, paths: Paths) -> list[str]:
    """The reward models the stage scores with: train.reward_funcs' models, else the pipeline's own."""
    if params.train.reward_funcs is None:
        return [str(paths.reward_model)]
    return [source.model for source in params.train.reward_funcs if source.model is not None]


def build_scorer(params: Params, paths: Paths, runtime: Runtime, tokenizer) -> Scorer:
    """The pipeline's reward model, or train.reward_funcs weighted by train.reward_weights (each source's
    scores logged as rewards/<name>/mean and /std)."""
    sources = params.train.reward_funcs
    if sources is None:
        return RewardModelScorer(runtime.load_frozen(load_scorer_model, paths.reward_model))
    weights = params.train.reward_weights or [1.0] * len(sources)
    terms = []
    for weight, source in zip(weights, sources, strict=True):
        scorer = (RewardModelScorer(runtime.load_frozen(load_scorer_model, source.model)) if source.model
                  else FunctionScorer(import_reward_function(source.function), tokenizer))
        terms.append((weight, scorer))
    return WeightedScorer(terms, names=[source.label for source in sources])


def run(params: Params, paths: Paths) -> dict:
    """Every rank trains; the main process alone prepares and writes the outputs (others return {})."""
    for model in reward_models(params, paths):  # before a checkpoint is kept or discarded, before models load
        check_reward_model(model)
        check_tokenizers(paths.sft_model, model)
    check_lora_settings(params, paths.root)
    cfg = params.rl_config()
    runtime = Runtime(params.runtime, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    acc, main = runtime.accelerator, runtime.accelerator.is_main_process
    # a checkpoint's format depends on the layout (processes, DeepSpeed): resume only on the same runtime
    inputs = {**cfg.model_dump(mode="json"), "runtime": params.runtime.checkpoint_layout}
    if params.train.reward_funcs is not None:  # other reward sources: a checkpoint made with others is not resumed
        inputs["reward_sources"] = params.train.model_dump(mode="json", include={"reward_funcs", "reward_weights"})
    if params.train.use_peft:  # an adapter's checkpoint holds other parameters than a full model's
        inputs["lora"] = params.peft_options().model_dump(mode="json")
    fingerprint = _fingerprint(paths, inputs)
    checkpoint = _resumable(paths, fingerprint, main) if main else None
    acc.wait_for_everyone()
    if not main:
        checkpoint = _resumable(paths, fingerprint, main)
    resumed = 0 if checkpoint is None else int(checkpoint.name.split("-")[-1])
    history_file = paths.train_log  # every figure as logged; metrics/ gets the results (tasks/execution/figures.py)
    tracker = NullTracker()
    if main:
        _prepare_outputs(paths, resumed)
        tracker = stage_tracker(JsonlTracker(history_file))  # + this stage's MLflow run, when tracking is on
        if resumed:  # the MLflow run gets the whole run's history
            log_history(history_file)
    trainer, tokenizer = build_trainer(params, paths, runtime, tracker=tracker, checkpoint_dir=paths.checkpoints)
    trainer.on_update = _trace_writer(params, tokenizer, paths.checkpoints / TRACE_DIR)  # called on the main rank
    trainer.on_checkpoint = checkpoint_saved  # every rank: a Ray rank persists it to the cluster's storage
    if checkpoint is not None:
        trainer.load_checkpoint(checkpoint)
    total = trainer.plan.num_updates
    with progress_bar("train", total=total, completed=resumed, enabled=main) as update:
        trainer.tracker = ProgressTracker(trainer.tracker, update, total)  # the bar moves every update
        try:
            trainer.train()
        except TrainingDiverged as error:  # its message names the update, the figures and the newest checkpoint
            raise StageFailed(str(error)) from None
        except CheckpointNotSaved as error:  # a full disk: which checkpoint is kept, and how to resume from it
            raise StageFailed(str(error)) from None
    _save_policy(trainer, runtime, params, paths, tokenizer, main)
    if not main:
        return {}
    history = read_jsonl(history_file) if history_file.is_file() else []  # the whole run's, resumed or not
    _publish_traces(paths)
    _write_history(paths.train_history, [results(row) for row in history])
    last = history[-1] if history else {}
    metrics = {**last, "resumed_from_update": resumed, **runtime.layout, "mixed_precision": acc.mixed_precision,
               "weight_gathers": trainer.weight_gathers}  # ZeRO-3: rollouts on the gathered policy (this process)
    write_json(paths.metrics_file("train"), results(metrics))  # timings and the resume point: reports/execution/
    return metrics
