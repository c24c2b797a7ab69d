"""RLOO (REINFORCE Leave-One-Out, Ahmadian et al. 2024): k completions per prompt, no value model.

Each completion's advantage is its reward minus the mean reward of the other k-1 completions of
the same prompt. Episodes are laid out prompt-major: rows [i*k, (i+1)*k) share prompt i.

KL placement (`rloo.kl_level`):
- "sequence" (TRL's RLOOTrainer): reward = score - kl_coef * sum_t KL_t; one advantage and one
  clipped ratio per sequence (the ratio of summed log-probs).
- "token": per-token reward-to-go G_t = score - kl_coef * sum_{t'>=t} KL_t', baselined by the
  leave-one-out mean of G_0; per-token advantages and clipped per-token ratios, so a token is
  not blamed for KL spent before it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from rlhf_core import ops
from rlhf_core.config import RLConfig
from rlhf_core.rollout import PolicyOutput, Rollout

USES_VALUE_MODEL = False


def _standardize(x: Tensor, ref: Tensor, reduce: ops.Reduce | None, clip: float = math.inf) -> Tensor:
    """(x - mean(ref)) / (std(ref) + 1e-8), clipped to +-clip (TRL's normalize_reward); mean and std over
    the global batch when `reduce` sums across processes."""
    every = torch.ones_like(ref, dtype=torch.bool)
    mean = ops.masked_mean(ref, every, reduce=reduce)
    std = ops.masked_var(ref, every, reduce=reduce).sqrt()
    return ((x - mean) / (std + 1e-8)).clamp(-clip, clip)


def compute_advantages(batch: Rollout, cfg: RLConfig,
                       reduce: ops.Reduce | None = None) -> tuple[Rollout, dict[str, Tensor]]:
    """Fill advantages ((B, 1) sequence-level or (B, R) token-level) and per-episode stats (B,).

    Each process holds whole prompt groups (all k completions of a prompt), so the leave-one-out baseline
    is local; the normalizations use global statistics (`reduce`).

    The stats include each episode's baselined reward (`rloo/reward`: the sequence reward, or G_0 at token
    level, after any normalization) and its leave-one-out baseline (`rloo/baseline`).
    """
    opts, k, mask = cfg.rloo, cfg.rloo.rloo_k, batch.response_mask
    kl_all = ops.kl_penalty(batch.logprobs, batch.ref_logprobs, cfg.kl_estimator) * mask  # (B, R)
    # the penalty sums the KL over the tokens the loss trains on, as TRL 1.16 (its completion mask): a completion
    # mask_truncated_completions leaves out pays none, and its raw score stays in its group's baseline
    kl = kl_all * batch.loss_mask
    non_score_reward = -cfg.kl_coef * kl.sum(1)  # (B,)
    rlhf_reward = batch.scores + non_score_reward  # (B,)
    stats = {"kl": kl_all.sum(1), "non_score_reward": non_score_reward, "rlhf_reward": rlhf_reward}

    if opts.kl_level == "sequence":
        reward = _standardize(rlhf_reward, rlhf_reward, reduce, opts.reward_clip_range) if opts.normalize_reward \
            else rlhf_reward
        advantages = ops.rloo_advantages(reward.view(-1, k)).view(-1, 1)  # (B, 1)
        stats.update({"rloo/reward": reward, "rloo/baseline": reward - advantages.view(-1)})  # for the trace
        if opts.normalize_advantage:
            advantages = _standardize(advantages, advantages, reduce)
        rewards = None
    else:
        rewards = -cfg.kl_coef * kl  # (B, R)
        last = (batch.response_lengths - 1).clamp(min=0)
        rewards[torch.arange(len(batch), device=kl.device), last] += batch.scores
        to_go = rewards.flip(1).cumsum(1).flip(1)  # (B, R) G_t = sum_{t' >= t} r_t'
        if opts.normalize_reward:
            to_go = _standardize(to_go, to_go[:, 0], reduce, opts.reward_clip_range)
        start = to_go[:, 0]  # (B,) G_0, the whole episode's reward
        baseline = start - ops.rloo_advantages(start.view(-1, k)).view(-1)  # (B,) leave-one-out mean
        stats.update({"rloo/reward": start, "rloo/baseline": baseline})  # for the trace
        advantages = to_go - baseline[:, None]
        if opts.normalize_advantage:
            advantages = ops.masked_whiten(advantages, mask, reduce=reduce)
        advantages = advantages * mask
    filled = replace(batch, rewards=rewards, advantages=advantages)
    return filled, stats


def loss_units(batch: Rollout, cfg: RLConfig | None = None) -> Tensor:
    """Units the loss averages over, per episode (B,): one per sequence (those mask_truncated_completions leaves
    out included, at zero gradient, as TRL 1.16 counts them), or response tokens (none for one left out)."""
    if batch.advantages.shape[1] == 1:
        return torch.ones(len(batch), dtype=torch.long, device=batch.queries.device)
    return batch.loss_mask.sum(1)


def needs_entropy(cfg: RLConfig) -> bool:
    """Whether every training forward needs the per-token entropy: no, it is only logged (first epoch)."""
    return False


def loss(out: PolicyOutput, mb: Rollout, cfg: RLConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped REINFORCE loss with the leave-one-out advantage (sequence- or token-level ratio)."""
    mask = mb.loss_mask
    if mb.advantages.shape[1] == 1:  # sequence level: ratio of summed log-probs
        # a sequence out of the loss (mask_truncated_completions) sums no log-prob: ratio 1, a constant -A with no
        # gradient, counted in the mean as TRL 1.16 counts it
        new, old = (out.logprobs * mask).sum(1, keepdim=True), (mb.logprobs * mask).sum(1, keepdim=True)
        unit_mask = torch.ones_like(new, dtype=torch.bool)  # (B, 1)
    else:
        new, old, unit_mask = out.logprobs, mb.logprobs, mask
    pg_loss, pg_clipfrac = ops.ppo_policy_loss(new, old, mb.advantages, unit_mask, cfg.cliprange, cfg.epsilon_high)
    with torch.no_grad():
        logratio = new - old
        stats = {
            **ops.clip_ratios(logratio.exp(), mb.advantages, unit_mask, cfg.cliprange, cfg.epsilon_high),
            "policy/approxkl_avg": 0.5 * ops.masked_mean(logratio**2, unit_mask),
            "policy/clipfrac_avg": pg_clipfrac,
            "loss/policy_avg": pg_loss.detach(),
            "val/ratio": ops.masked_mean(logratio.exp(), unit_mask),
        }
        if out.entropy is not None:  # measured in the first epoch only (rl_update.optimize)
            stats["policy/entropy_avg"] = ops.masked_mean(out.entropy, mask)
    return pg_loss, stats
