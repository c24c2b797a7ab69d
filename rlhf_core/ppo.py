"""PPO for language models: what differs from RLOO is the value model, GAE and the value loss.

Reward shaping (per token t of a response of length L):
    r_t = -kl_coef * KL_t            for t < L-1
    r_t = -kl_coef * KL_t + score    for t = L-1, the final response token

Score placement: we put the score on the final response token (the stop token, or the R-th token
when the completion was truncated). TRL's PPOTrainer put it one position later, on the first pad
after EOS (`sequence_lengths + 1`, see huggingface/trl#1893), which forces an extra masked-in pad
step whose value the critic must learn; our placement keeps the episode exactly the response and
gives the same return at every real token when gamma = lam = 1.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from rlhf_core import ops
from rlhf_core.config import RLConfig
from rlhf_core.rollout import PolicyOutput, Rollout

USES_VALUE_MODEL = True


def score_positions(batch: Rollout) -> Tensor:
    """(B,) the response position that receives the score: the final response token (see above)."""
    return (batch.response_lengths - 1).clamp(min=0)


def shaped_rewards(batch: Rollout, kl_coef: float, estimator: str) -> tuple[Tensor, Tensor]:
    """Per-token rewards (B, R): KL penalty everywhere, score on the final response token.

    Returns (rewards, kl), both zero on padding.
    """
    mask = batch.response_mask
    kl = ops.kl_penalty(batch.logprobs, batch.ref_logprobs, estimator) * mask  # (B, R)
    rewards = -kl_coef * kl
    rewards[torch.arange(len(batch), device=rewards.device), score_positions(batch)] += batch.scores
    return rewards, kl


def compute_advantages(batch: Rollout, cfg: RLConfig,
                       reduce: ops.Reduce | None = None) -> tuple[Rollout, dict[str, Tensor]]:
    """Fill rewards, advantages (GAE, whitened) and returns; also per-episode stats (B,). Whitening uses the
    global batch's statistics when `reduce` sums across processes."""
    mask = batch.response_mask
    rewards, kl = shaped_rewards(batch, cfg.kl_coef, cfg.kl_estimator)
    if cfg.ppo.whiten_rewards:
        rewards = ops.masked_whiten(rewards, mask, shift_mean=False, reduce=reduce) * mask
    advantages, returns = ops.gae(rewards, batch.values * mask, cfg.ppo.gamma, cfg.ppo.lam)
    if cfg.whiten_advantages:
        advantages = ops.masked_whiten(advantages, mask, reduce=reduce)
    advantages = advantages * mask
    non_score_reward = -cfg.kl_coef * kl.sum(1)  # (B,)
    stats = {"kl": kl.sum(1), "non_score_reward": non_score_reward,
             "rlhf_reward": batch.scores + non_score_reward}
    filled = replace(batch, rewards=rewards, advantages=advantages, returns=returns)
    return filled, stats


def loss_units(batch: Rollout, cfg: RLConfig | None = None) -> Tensor:
    """Units the loss averages over, per episode (B,): response tokens (none for an episode left out)."""
    return batch.loss_mask.sum(1)


def needs_entropy(cfg: RLConfig) -> bool:
    """Whether every training forward needs the per-token entropy: no, it is only logged (first epoch)."""
    return False


def loss(out: PolicyOutput, mb: Rollout, cfg: RLConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy loss + vf_coef * clipped value loss, token-averaged over the micro-batch."""
    mask = mb.loss_mask
    pg_loss, pg_clipfrac = ops.ppo_policy_loss(out.logprobs, mb.logprobs, mb.advantages, mask, cfg.cliprange,
                                               cfg.epsilon_high)
    vf_loss, vf_clipfrac = ops.ppo_value_loss(out.values, mb.values, mb.returns, mask, cfg.ppo.cliprange_value)
    with torch.no_grad():
        logratio = out.logprobs - mb.logprobs
        stats = {
            **ops.clip_ratios(logratio.exp(), mb.advantages, mask, cfg.cliprange, cfg.epsilon_high),
            "policy/approxkl_avg": 0.5 * ops.masked_mean(logratio**2, mask),
            "policy/clipfrac_avg": pg_clipfrac,
            "loss/policy_avg": pg_loss.detach(),
            "loss/value_avg": vf_loss.detach(),
            "val/clipfrac_avg": vf_clipfrac,
            "val/ratio": ops.masked_mean(logratio.exp(), mask),
        }
        if out.entropy is not None:  # measured in the first epoch only (rl_update.optimize)
            stats["policy/entropy_avg"] = ops.masked_mean(out.entropy, mask)
    return pg_loss + cfg.ppo.vf_coef * vf_loss, stats
