"""The update phase: the one module trained (`PolicyAndValue`), its optimizer, and one update's optimizer steps.

An update makes `num_epochs` passes over the rollout batch in shuffled mini-batches; each mini-batch is one
optimizer step, its gradient accumulated over micro-batches. The loss is the algorithm's (ppo.py / rloo.py /
grpo.py); how it is reduced is this module's, so that the step does not depend on the micro-batch split.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from rlhf_core import ops
from rlhf_core.config import BatchPlan, RLConfig
from rlhf_core.data import mini_batch_indices
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.rollout import PolicyOutput, Rollout, response_logit_pieces, response_logits, token_values
from rlhf_core.runtime import adamw, averaged_over, configure_deepspeed, lr_schedule


class PolicyAndValue(nn.Module):
    """Policy (and PPO's value model) as one module: one optimizer and one DDP/DeepSpeed wrapper own both.

    `fused_logprobs` (on for every algorithm): the log-probs and entropy from the raw logit pieces in one fused pass
    with a one-pass backward (`ops.token_logprobs_and_entropy`), ~10 fewer full-vocabulary passes per micro-batch.
    Off: `selective_log_softmax` and `entropy_from_logits` over the joined, temperature-scaled logits, the plain
    computation the fused pass is checked against (tests/test_speed_paths.py), the same figures to rounding."""

    def __init__(self, policy: nn.Module, value: nn.Module | None = None, *, fused_logprobs: bool = True):
        super().__init__()
        self.policy = policy
        self.value = value
        self.fused_logprobs = fused_logprobs

    def forward(self, queries: Tensor, query_mask: Tensor, responses: Tensor, response_mask: Tensor,
                temperature: float, share_prompts: bool = False, with_entropy: bool = True) -> PolicyOutput:
        parts = (queries, query_mask, responses, response_mask)
        if self.fused_logprobs:
            pieces = response_logit_pieces(self.policy, parts, share_prompts=share_prompts)  # [(B, r, V), ...]
            logprobs, entropy = ops.token_logprobs_and_entropy(pieces, responses, temperature, with_entropy)
            logprobs = logprobs * response_mask  # (B, R)
        else:
            logits = response_logits(self.policy, parts, temperature, share_prompts=share_prompts)  # (B, R, V)
            logprobs = ops.selective_log_softmax(logits, responses) * response_mask  # (B, R)
            entropy = None
            if with_entropy:
                with torch.no_grad():  # a logged statistic, not part of the loss
                    entropy = ops.entropy_from_logits(logits)  # (B, R)
        values = None if self.value is None else token_values(self.value, parts)  # (B, R)
        return PolicyOutput(logprobs=logprobs, entropy=entropy, values=values)


def prepare_for_training(model: PolicyAndValue, accelerator: Accelerator, cfg: RLConfig,
                         plan: BatchPlan) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """One AdamW over policy and value, an LR schedule over all the run's optimizer steps, both prepared by
    accelerate with `model` (wrapped for DDP or DeepSpeed)."""
    optimizer = adamw(model, accelerator, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    scheduler = lr_schedule(cfg.lr_scheduler, optimizer, warmup_steps=int(cfg.warmup_ratio * plan.num_optimizer_steps),
                            total_steps=plan.num_optimizer_steps)
    configure_deepspeed(accelerator, micro_batch_size=cfg.per_device_train_batch_size, max_grad_norm=cfg.max_grad_norm)
    return accelerator.prepare(model, optimizer, scheduler)


def optimize(batch: Rollout, metrics: MetricAccumulator, *, algo: ModuleType, cfg: RLConfig, plan: BatchPlan,
             accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, update: int, share_prompts: bool,
             after_optimizer_step: Callable[[int], None]) -> None:
    """One update of the prepared `model` on this process's share of `batch` (its advantages filled).

    The loss of a micro-batch is its mean over loss units (tokens or sequences) rescaled to its share of the whole
    mini-batch's units across processes, so one optimizer step sees the exact mini-batch mean whatever the
    micro-batch x accumulation x process split. `update` is the number of updates before this one: it seeds the
    shuffle and counts the run's optimizer steps, which `after_optimizer_step` receives after each.
    """
    acc = accelerator
    units = algo.loss_units(batch, cfg).float()  # (B,)
    every_entropy = algo.needs_entropy(cfg)  # else measured in the first epoch only (a logged statistic)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + update)
    model.train()
    optimizer_steps = update * cfg.num_epochs * cfg.num_mini_batches  # before this update
    for epoch in range(cfg.num_epochs):
        for mini in mini_batch_indices(plan.batch_size, cfg.num_mini_batches, rank=acc.process_index,
                                       num_processes=plan.num_processes, generator=generator,
                                       group_size=cfg.samples_per_prompt):
            mini = mini.to(batch.queries.device)
            # all processes' units (at least 1: a mini-batch of left-out episodes gives zero gradients)
            mini_units = acc.reduce(units[mini].sum(), reduction="sum").clamp(min=1)
            for micro in mini.split(plan.micro_batch_size):
                with acc.accumulate(model):
                    mb = batch[micro]
                    # the entropy is logged, never trained on: the first epoch's pass over the whole batch
                    # measures it (a full-vocabulary pass per micro-batch, ~5 % of a CPU PPO update per epoch)
                    out = model(mb.queries, mb.query_mask, mb.responses, mb.response_mask, cfg.temperature,
                                share_prompts, with_entropy=epoch == 0 or every_entropy)
                    loss, stats = algo.loss(out, mb, cfg)
                    share = units[micro].sum() * averaged_over(acc)  # the micro-batch's units, times
                    acc.backward(loss * share / mini_units)  # what accelerate and DDP average over
                    if acc.sync_gradients:
                        if cfg.max_grad_norm is not None:
                            grad_norm = acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                            if grad_norm is not None:
                                metrics.add("policy/grad_norm", grad_norm)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                        optimizer_steps += 1
                        after_optimizer_step(optimizer_steps)
                    metrics.add_all(stats)
