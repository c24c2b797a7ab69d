"""Supervised fine-tuning (SFT) of a causal LM on {"prompt", "completion"} rows.

Each row trains as  tokens(prompt) + tokens(completion) + [EOS]  with the cross-entropy on the completion
tokens and the EOS only; prompt positions are labelled -100 (TRL SFTTrainer's `completion_only_loss`), so
the policy learns to summarize and to stop, not to write posts.

The supervised loop `fit` is shared with reward_training.py. Its batch hierarchy is the RL trainer's: one
optimizer step takes a mini-batch of `gradient_accumulation_steps` micro-batches of
`per_device_train_batch_size` rows on each process. Its loss is the exact mean over the mini-batch's units
(completion tokens here, pairs for the reward model) across micro-batches and processes, so any micro-batch
x accumulation x process split gives the same update (transformers' `num_items_in_batch` fix of 2024).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import get_scheduler

from rlhf_core.greedy_eval import decode_responses, greedy_rollout
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.rollout import position_ids

IGNORE_INDEX = -100  # torch's cross-entropy skips this label
# Mini-batches whose rows are sorted by length together: enough to group lengths, few enough to stay random.
LENGTH_WINDOW = 64
Row = Mapping[str, str]
Batch = dict[str, Tensor]
Progress = Callable[[int, Mapping[str, float]], None]
"""Called with (optimizer step, metrics) every `logging_steps` steps and after each epoch's evaluation."""
GoldFn = Callable[[str, str, bool], float]
"""(prompt, completion, ended_with_eos) -> gold reward, like `rlhf_core.world.gold_reward`."""


class SupervisedConfig(BaseModel):
    """Optimization settings that SFT and reward-model training share."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    seed: int = 0
    """Seeds the data order (and dropout, if any); with it a run is reproducible."""
    epochs: int = Field(2, gt=0)
    """Passes over the rows (demo world: the second still helps; the reward model overfits in a third)."""
    per_device_train_batch_size: int = Field(16, gt=0)
    """Micro-batch: rows per process per forward/backward."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches accumulated into one mini-batch (one optimizer step)."""
    learning_rate: float = Field(1e-3, gt=0.0)
    """Peak learning rate of AdamW (for the tiny demo models trained from scratch; ~1e-5 for a 1B model)."""
    lr_scheduler: Literal["linear", "cosine", "constant_with_warmup"] = "cosine"
    """Decay after warm-up over all optimizer steps of the run."""
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0)
    """Fraction of optimizer steps of linear warm-up."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm of each optimizer step; None disables."""
    group_by_length: bool = True
    """Batch rows of similar length together (demo world: padding wastes ~25% of the compute otherwise)."""
    logging_steps: int = Field(10, gt=0)
    """Report the training metrics every this many optimizer steps."""
    eval_batch_size: int = Field(64, gt=0)
    """Rows per forward when evaluating (no grad)."""


class SFTConfig(SupervisedConfig):
    """Supervised fine-tuning of a causal LM on prompt/completion rows."""

    learning_rate: float = Field(3e-3, gt=0.0)
    """Peak learning rate of AdamW; this high, the demo policy learns to copy facts in two epochs."""

    max_prompt_length: int = Field(256, gt=0)
    """Prompt tokens kept (from the end, where the TL;DR: cue is)."""
    max_completion_length: int = Field(64, gt=0)
    """Completion + EOS tokens kept (from the start; a longer completion loses its EOS, as in TRL)."""


@dataclass(frozen=True)
class TrainResult:
    """What a supervised run returns."""

    model: nn.Module  # the trained model, unwrapped from accelerate
    history: list[dict[str, float]]  # every report `progress` received, in order
    metrics: dict[str, float]  # the evaluation after the last epoch
    train_seconds: float  # wall-clock of the whole loop, evaluations included


SFTResult = TrainResult


# ---------------------------------------------------------------------------------------- SFT data


def encode_sft(tokenizer, rows: Sequence[Row], cfg: SFTConfig) -> list[tuple[list[int], list[int]]]:
    """Rows -> (input_ids, labels): prompt + completion + EOS, the prompt labelled IGNORE_INDEX."""
    assert tokenizer.eos_token_id is not None, "the tokenizer needs an EOS token: SFT teaches when to stop"
    prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    completions = tokenizer([r["completion"] for r in rows], add_special_tokens=False)["input_ids"]
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        prompt = prompt[-cfg.max_prompt_length:]
        completion = (completion + [tokenizer.eos_token_id])[:cfg.max_completion_length]
        out.append((prompt + completion, [IGNORE_INDEX] * len(prompt) + completion))
    return out


def right_pad(sequences: Sequence[Sequence[int]], pad_value: int) -> Tensor:
    """Token lists -> (B, T) with T the longest, padded on the right."""
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


def sft_collate(examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> Batch:
    """Right-pad a micro-batch: input_ids, attention_mask (bool) and labels, each (B, T)."""
    input_ids = right_pad([ids for ids, _ in examples], pad_token_id)  # (B, T)
    return {"input_ids": input_ids,
            "attention_mask": right_pad([[1] * len(ids) for ids, _ in examples], 0).bool(),  # (B, T)
            "labels": right_pad([labels for _, labels in examples], IGNORE_INDEX)}  # (B, T)


def completion_tokens(batch: Batch) -> Tensor:
    """Number of supervised (completion + EOS) tokens in a batch: the units SFT's loss averages over."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def token_losses(model: nn.Module, batch: Batch) -> dict[str, Tensor]:
    """Cross-entropy of each supervised token: {"loss": (U,)}, U = completion_tokens(batch)."""
    mask = batch["attention_mask"]
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask)).logits
    labels = batch["labels"][:, 1:]  # (B, T-1): position t predicts token t+1
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                          ignore_index=IGNORE_INDEX, reduction="none")  # (B*(T-1),)
    return {"loss": nll[labels.flatten() != IGNORE_INDEX]}  # (U,)


# ---------------------------------------------------------------------------------------- the supervised loop


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
    # accelerate divides each loss by the accumulation steps and DDP averages over processes: undo both
    scale = cfg.gradient_accumulation_steps * acc.num_processes / units.clamp(min=1)
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
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_training_steps=total_steps,
                              num_warmup_steps=round(cfg.warmup_ratio * total_steps))
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
            _optimizer_step(acc, model, optimizer, scheduler, micro_batches, losses_fn, units_fn, cfg,
                            metrics)
            step += 1
            if step % cfg.logging_steps == 0 or step % steps_per_epoch == 0:
                lr = scheduler.get_last_lr()[0]
                report(step, {**metrics.reduce(acc), "lr": lr, "epoch": step / steps_per_epoch})
                metrics = MetricAccumulator()
        eval_metrics = evaluate(acc.unwrap_model(model))
        report(step, {**eval_metrics, "epoch": epoch + 1.0})
    return TrainResult(model=acc.unwrap_model(model), history=history, metrics=eval_metrics,
                       train_seconds=time.perf_counter() - start)


# ---------------------------------------------------------------------------------------- SFT


def train_sft(cfg: SFTConfig, model: nn.Module, tokenizer, train_rows: Sequence[Row],
              eval_rows: Sequence[Row], *, accelerator: Accelerator | None = None,
              progress: Progress | None = None) -> SFTResult:
    """Fine-tune `model` on prompt/completion rows; after each epoch, its held-out loss on `eval_rows`."""
    examples = encode_sft(tokenizer, train_rows, cfg)
    return fit(cfg, model, examples, [len(ids) for ids, _ in examples],
               collate=lambda ex: sft_collate(ex, tokenizer.pad_token_id),
               losses_fn=token_losses, units_fn=completion_tokens,
               evaluate=lambda m: {"eval/loss": sft_loss(m, tokenizer, eval_rows, cfg)},
               accelerator=accelerator, progress=progress)


@torch.no_grad()
def sft_loss(model: nn.Module, tokenizer, rows: Sequence[Row], cfg: SFTConfig) -> float:
    """Mean cross-entropy per completion token (EOS included) over all `rows`."""
    model.eval()
    device = next(model.parameters()).device
    examples = encode_sft(tokenizer, rows, cfg)
    total, count = torch.zeros((), device=device), 0
    for start in range(0, len(examples), cfg.eval_batch_size):
        batch = sft_collate(examples[start:start + cfg.eval_batch_size], tokenizer.pad_token_id)
        nll = token_losses(model, {k: v.to(device) for k, v in batch.items()})["loss"]  # (U,)
        total, count = total + nll.sum(), count + nll.numel()
    return total.item() / max(count, 1)


def greedy_completions(model: nn.Module, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                       batch_size: int, max_prompt_length: int = 256) -> list[tuple[str, bool]]:
    """Greedy completions of `prompts` from left-padded batches: (text without EOS, ended_with_eos)."""
    ids = [p[-max_prompt_length:] for p in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
    batch = greedy_rollout(model, ids, response_length=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                           stop_token_id=tokenizer.eos_token_id, batch_size=batch_size)
    return list(zip(decode_responses(tokenizer, batch), batch.contains_stop.tolist(), strict=True))


def evaluate_sft(model: nn.Module, tokenizer, prompt_rows: Sequence[Row], max_new_tokens: int,
                 batch_size: int, *, eval_rows: Sequence[Row] = (), gold: GoldFn | None = None,
                 cfg: SFTConfig | None = None) -> dict[str, float]:
    """Held-out loss on `eval_rows` (when given) and greedy-decoding metrics on `prompt_rows`.

    eval/eos_rate is the fraction of greedy completions that emit EOS within `max_new_tokens`: a policy
    that cannot stop pays the missing-EOS penalty on every RL episode. eval/gold_reward needs `gold`
    (real datasets have none).
    """
    cfg = cfg or SFTConfig()
    prompts = [row["prompt"] for row in prompt_rows]
    completions = greedy_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                     batch_size=batch_size, max_prompt_length=cfg.max_prompt_length)
    metrics = {"eval/eos_rate": sum(ended for _, ended in completions) / len(completions),
               "eval/response_words": sum(len(text.split()) for text, _ in completions) / len(completions)}
    if eval_rows:
        metrics["eval/loss"] = sft_loss(model, tokenizer, eval_rows, cfg)
    if gold is not None:
        scores = [gold(p, text, ended) for p, (text, ended) in zip(prompts, completions, strict=True)]
        metrics["eval/gold_reward"] = sum(scores) / len(scores)
    return metrics
