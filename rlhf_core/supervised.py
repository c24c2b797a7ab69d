"""The supervised loop `fit`, shared by SFT (sft_trainer.py) and reward-model training (reward_trainer.py).

Its batch hierarchy is the RL trainer's: one optimizer step takes a mini-batch of `gradient_accumulation_steps`
micro-batches of `per_device_train_batch_size` rows on each process. Its loss is the exact mean over the
mini-batch's units (completion tokens for SFT, pairs for the reward model) across micro-batches and processes,
so any micro-batch x accumulation x process split gives the same update (transformers' `num_items_in_batch`
fix of 2024).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import Tensor, nn
from torch.utils.data import DataLoader

from rlhf_core.config import SupervisedConfig
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.runtime import adamw, averaged_over, configure_deepspeed, lr_schedule
from rlhf_core.threads import refit_threads

# Mini-batches whose rows are sorted by length together: enough to group lengths, few enough to stay random.
LENGTH_WINDOW = 64
Row = Mapping[str, str]
Batch = dict[str, Tensor]
Progress = Callable[[int, Mapping[str, float]], None]
"""Called with (optimizer step, metrics) every `logging_steps` steps and after each epoch's evaluation."""


@dataclass(frozen=True)
class TrainResult:
    """What a supervised run returns."""

    model: nn.Module  # the trained model, unwrapped from accelerate (under ZeRO-3 a shard: see `engine`)
    engine: nn.Module  # what accelerate prepared (DDP, DeepSpeed): runtime.whole_weights(acc, engine) gathers `model`
    history: list[dict[str, float]]  # every report `progress` received, in order
    metrics: dict[str, float]  # the evaluation after the last epoch
    train_seconds: float  # wall-clock of the whole loop, evaluations included


def epoch_micro_batches(lengths: Sequence[int], cfg: SupervisedConfig, epoch: int, rank: int,
                        num_processes: int) -> list[list[int]]:
    """This process's row indices of one epoch, one list per micro-batch, mini-batch after mini-batch.

    A seeded permutation all processes agree on is cut into global mini-batches (a trailing partial
    one is dropped, so every optimizer step sees the same number of rows); process `rank` takes every
    `num_processes`-th row of each, so the union over processes is the same whatever their number.
    With `group_by_length`, rows are sorted by length within windows of LENGTH_WINDOW mini-batches
    before the cut and the mini-batches shuffled after it (transformers' LengthGroupedSampler).
    """
    micro = cfg.per_device_train_batch_size
    global_mini = micro * cfg.gradient_accumulation_steps * num_processes
    if len(lengths) < global_mini:
        raise ValueError(f"{len(lengths)} training rows cannot fill one mini-batch of "
                         f"per_device_train_batch_size * gradient_accumulation_steps * processes "
                         f"= {global_mini} rows")
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    order = order[:len(order) - len(order) % global_mini]
    if cfg.group_by_length:
        window = global_mini * LENGTH_WINDOW
        order = [i for start in range(0, len(order), window)
                 for i in sorted(order[start:start + window], key=lengths.__getitem__)]
    minis = [order[start:start + global_mini] for start in range(0, len(order), global_mini)]
    if cfg.group_by_length:
        minis = [minis[i] for i in torch.randperm(len(minis), generator=generator).tolist()]
    local = [mini[rank::num_processes] for mini in minis]
    return [rows[i:i + micro] for rows in local for i in range(0, len(rows), micro)]


def _grouped(batches: Iterator[Batch], size: int) -> Iterator[list[Batch]]:
    """Consecutive groups of `size` micro-batches: the mini-batches of one epoch."""
    while group := [batch for _, batch in zip(range(size), batches, strict=False)]:
        yield group


def _optimizer_step(acc: Accelerator, model: nn.Module, optimizer, scheduler, micro_batches: list[Batch],
                    losses_fn: Callable[[nn.Module, Batch], dict[str, Tensor]],
                    units_fn: Callable[[Batch], Tensor], cfg: SupervisedConfig,
                    metrics: MetricAccumulator) -> None:
    """One mini-batch: accumulate the gradient of the exact mean loss over all its units, then step."""
    micro_batches = [{k: v.to(acc.device) for k, v in batch.items()} for batch in micro_batches]
    local_units = sum(units_fn(b) for b in micro_batches).float().to(acc.device)
    units = acc.reduce(local_units, reduction="sum")  # all processes' units of this mini-batch
    scale = averaged_over(acc) / units.clamp(min=1)  # undo accelerate's and DDP's averaging: the exact mean
    for batch in micro_batches:
        with acc.accumulate(model):
            losses = losses_fn(model, batch)  # each (U,) or (B,)
            acc.backward(losses["loss"].sum() * scale)
            if acc.sync_gradients:
                if cfg.max_grad_norm is not None:
                    metrics.add("train/grad_norm", acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        for name, values in losses.items():
            metrics.add_mean(f"train/{name}", values.detach())


def fit(cfg: SupervisedConfig, model: nn.Module, examples: Sequence, lengths: Sequence[int], *,
        collate: Callable[[list], Batch], losses_fn: Callable[[nn.Module, Batch], dict[str, Tensor]],
        units_fn: Callable[[Batch], Tensor],
        evaluate: Callable[[nn.Module], dict[str, float]], accelerator: Accelerator | None = None,
        progress: Progress | None = None) -> TrainResult:
    """Train `model` on `examples` (of token `lengths`) for cfg.epochs; `evaluate` runs after each epoch.

    losses_fn(model, micro_batch) returns per-unit tensors, "loss" among them (the others are logged);
    units_fn(micro_batch) counts the loss units before the forward, so the mean is exact.
    """
    acc = accelerator or Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                     step_scheduler_with_optimizer=False)
    if acc.gradient_accumulation_steps != cfg.gradient_accumulation_steps:
        raise ValueError("the accelerator's gradient_accumulation_steps must equal the config's")
    if acc.step_scheduler_with_optimizer:
        raise ValueError("make the Accelerator with step_scheduler_with_optimizer=False: the schedule counts "
                         "optimizer steps, which this loop already takes only on synced micro-batches")
    set_seed(cfg.seed)
    batch_plan = [epoch_micro_batches(lengths, cfg, epoch, acc.process_index, acc.num_processes)
                  for epoch in range(cfg.epochs)]
    steps_per_epoch = len(batch_plan[0]) // cfg.gradient_accumulation_steps
    total_steps = steps_per_epoch * cfg.epochs
    optimizer = adamw(model, acc, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = lr_schedule(cfg.lr_scheduler, optimizer, warmup_steps=round(cfg.warmup_ratio * total_steps),
                            total_steps=total_steps)
    module = model  # what DDP / DeepSpeed wrap; accelerate's unwrap_model would import deepspeed (+115 MB RSS)
    configure_deepspeed(acc, micro_batch_size=cfg.per_device_train_batch_size, max_grad_norm=cfg.max_grad_norm)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)

    history: list[dict[str, float]] = []

    def report(step: int, logs: dict[str, float]) -> None:
        history.append({"step": step, **logs})
        if progress is not None and acc.is_main_process:
            progress(step, logs)

    start, step, metrics = time.perf_counter(), 0, MetricAccumulator()
    for epoch in range(cfg.epochs):
        model.train()
        loader = DataLoader(examples, batch_sampler=batch_plan[epoch], collate_fn=collate)
        for micro_batches in _grouped(iter(loader), cfg.gradient_accumulation_steps):
            refit_threads()  # another torch process may have started beside this one (rlhf_core/threads.py)
            _optimizer_step(acc, model, optimizer, scheduler, micro_batches, losses_fn, units_fn, cfg,
                            metrics)
            step += 1
            if step % cfg.logging_steps == 0 or step % steps_per_epoch == 0:
                lr = scheduler.get_last_lr()[0]
                report(step, {**metrics.reduce(acc), "lr": lr, "epoch": step / steps_per_epoch})
                metrics = MetricAccumulator()
        with acc.autocast():  # the training forward's precision
            eval_metrics = evaluate(module)
        report(step, {**eval_metrics, "epoch": epoch + 1.0})
    return TrainResult(model=module, engine=model, history=history, metrics=eval_metrics,
                       train_seconds=time.perf_counter() - start)
