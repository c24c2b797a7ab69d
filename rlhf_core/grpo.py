"""GRPO (Shao et al. 2024) as TRL 1.16's GRPOTrainer computes it: k completions per prompt, no value model,
the group-normalized reward as every token's advantage, KL to the reference in the loss (not the reward).

Advantage (`grpo.scale_rewards`): A_i = (r_i - mean(group)) / (std + 1e-4), std over the prompt's group
('group'), over the whole batch ('batch', PPO Lite) or no division ('none', Dr. GRPO); std with Bessel's
correction, as TRL.

Loss per token, with w the importance weight (`grpo.importance_sampling_level`: the token ratio, or GSPO's
sequence ratio exp(mean_t log ratio)), eps_low = cliprange, eps_high = epsilon_high or cliprange:
    grpo, dr_grpo, dapo, bnpo  -max(w' A, clip(w, 1 - eps_low, 1 + eps_high) A) ... as -min(...); w' = min(w, delta)
    cispo                      -sg(min(w, eps_high)) A log pi(token)       (MiniMax-M1: the weight is clipped)
then * the high-entropy mask (`top_entropy_quantile`) and + beta * k3 KL(pi || ref) per token (times w with
`use_bias_correction_kl`, TRL's default).
`loss_type` only changes the reduction (`reduce_loss`; trl/trainer/grpo_trainer.py `_compute_loss`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from rlhf_core import ops
from rlhf_core.config import RLConfig
from rlhf_core.rollout import PolicyOutput, Rollout

USES_VALUE_MODEL = False
STD_EPS = 1e-4  # TRL's: the group std of equal rewards is 0


def group_advantages(rewards: Tensor, k: int, scale: str, reduce: ops.Reduce | None = None) -> Tensor:
    """(B,) rewards laid out prompt-major (k per prompt) -> (B,) advantages, `scale` group | batch | none.

    'batch' takes the std over the global batch when `reduce` sums across processes (TRL gathers the rewards)."""
    grouped = rewards.view(-1, k)  # (n, k)
    centered = (grouped - grouped.mean(1, keepdim=True)).view(-1)  # (B,)
    if scale == "none":
        return centered
    if scale == "group":
        std = grouped.std(1, keepdim=True).expand_as(grouped).reshape(-1)  # (B,) Bessel, as TRL's nanstd
    else:
        std = ops.masked_var(rewards, torch.ones_like(rewards, dtype=torch.bool), reduce=reduce).sqrt()
    return centered / (std + STD_EPS)


def importance_weights(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    """exp of the log ratio per token (B, R), or GSPO's per sequence (B, 1): the masked mean log ratio."""
    log_ratio = logprobs - old_logprobs.detach()  # (B, R)
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return log_ratio.exp()


def clipped_token_loss(weights: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                       delta: float | None) -> Tensor:
    """-min(w A, clip(w, 1 - eps_low, 1 + eps_high) A); with `delta` (INTELLECT-2's two-sided clip) w is also
    capped at delta in the unclipped term. Shapes broadcast: (B, R) or (B, 1) weights, (B, 1) advantages."""
    clipped = weights.clamp(1 - eps_low, 1 + eps_high)
    if delta is not None:
        weights = weights.clamp(max=delta)
    return -torch.min(weights * advantages, clipped * advantages)


def cispo_token_loss(weights: Tensor, advantages: Tensor, logprobs: Tensor, eps_high: float) -> Tensor:
    """CISPO: -sg(min(w, eps_high)) A log pi (B, R); the weight, not the update, is clipped."""
    return -weights.clamp(max=eps_high).detach() * advantages * logprobs


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """(B, R) bool: the tokens whose entropy is in the top `quantile` of the masked ones ("Beyond the 80/20
    rule"; TRL's `get_high_entropy_mask` with threshold 1 - quantile, over this micro-batch)."""
    mask = mask.bool()
    if not mask.any():
        return torch.zeros_like(mask)
    threshold = torch.quantile(entropy[mask].float(), 1 - quantile)
    return (entropy * mask >= threshold) & mask


def reduce_loss(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int) -> Tensor:
    """The micro-batch's loss from (B, R) per-token losses, per `loss_type`, in the units `loss_units` counts:
        grpo     mean over sequences of each one's token mean     (units: sequences)
        bnpo     token mean over the micro-batch                  (units: sequences, as TRL: per micro-batch)
        dr_grpo  token sum / (sequences * max_completion_length)  (units: sequences)
        dapo, cispo  token mean                                   (units: tokens: the mini-batch's token mean)
    """
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # bnpo, dapo, cispo


def compute_advantages(batch: Rollout, cfg: RLConfig,
                       reduce: ops.Reduce | None = None) -> tuple[Rollout, dict[str, Tensor]]:
    """Fill the (B, 1) group advantages and per-episode stats (B,). The KL is in the loss, not the reward:
    `kl` (logged as objective/kl) is measured only when there is a reference (beta > 0)."""
    advantages = group_advantages(batch.scores, cfg.samples_per_prompt, cfg.grpo.scale_rewards, reduce)
    stats = {"non_score_reward": torch.zeros_like(batch.scores), "rlhf_reward": batch.scores}
    if batch.ref_logprobs is not None:
        kl = (ops.kl_penalty(batch.logprobs, batch.ref_logprobs, cfg.kl_estimator) * batch.response_mask).sum(1)
        stats.update(kl=kl, non_score_reward=-cfg.kl_coef * kl, rlhf_reward=batch.scores - cfg.kl_coef * kl)
    return replace(batch, advantages=advantages[:, None]), stats


def loss_units(batch: Rollout, cfg: RLConfig) -> Tensor:
    """Units the loss averages over, per episode (B,): tokens for dapo and cispo, else sequences (TRL counts
    the sequences mask_truncated_completions leaves out, at zero loss)."""
    if cfg.grpo.loss_type in ("dapo", "cispo"):
        return batch.loss_mask.sum(1)
    return torch.ones(len(batch), dtype=torch.long, device=batch.queries.device)


def needs_entropy(cfg: RLConfig) -> bool:
    """Whether every training forward needs the per-token entropy (the high-entropy mask), not only the first."""
    return cfg.grpo.top_entropy_quantile < 1.0


def loss(out: PolicyOutput, mb: Rollout, cfg: RLConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of `cfg.grpo.loss_type` over the micro-batch (see the module docstring)."""
    opts, mask, adv = cfg.grpo, mb.loss_mask, mb.advantages  # (B, R), (B, R), (B, 1)
    eps_high = cfg.cliprange if cfg.epsilon_high is None else cfg.epsilon_high
    weights = importance_weights(out.logprobs, mb.logprobs, mask, opts.importance_sampling_level)  # (B, R|1)
    if opts.loss_type == "cispo":
        per_token = cispo_token_loss(weights, adv, out.logprobs, eps_high)
    else:
        per_token = clipped_token_loss(weights, adv, cfg.cliprange, eps_high, opts.delta)
    if opts.top_entropy_quantile < 1.0:
        per_token = per_token * high_entropy_mask(out.entropy, mask, opts.top_entropy_quantile)
    if cfg.kl_coef > 0:
        kl = ops.kl_penalty(out.logprobs, mb.ref_logprobs, "k3")  # (B, R), with grad: TRL's per_token_kl
        if opts.use_bias_correction_kl:
            kl = kl * weights  # the ratio before delta's cap, with its gradient (as TRL)
        per_token = per_token + cfg.kl_coef * kl
    pg_loss = reduce_loss(per_token.expand_as(mask), mask, opts.loss_type, cfg.response_length)
    with torch.no_grad():
        unit_mask = mask if weights.shape[1] > 1 else torch.ones_like(weights, dtype=torch.bool)
        log_ratio = (out.logprobs - mb.logprobs) * mask
        stats = {
            "policy/approxkl_avg": 0.5 * ops.masked_mean(log_ratio**2, mask),
            "loss/policy_avg": pg_loss.detach(),
            "val/ratio": ops.masked_mean(weights.expand_as(unit_mask), unit_mask),
        }
        if opts.loss_type == "cispo":
            stats["cispo_clip_ratio"] = ops.masked_mean(((weights > eps_high) & (adv > 0)).expand_as(unit_mask)
                                                        .float(), unit_mask)
        else:
            stats.update(ops.clip_ratios(weights, adv.expand_as(weights), unit_mask, cfg.cliprange, eps_high))
            stats["policy/clipfrac_avg"] = stats["clip_ratio/region_mean"]
        if cfg.kl_coef > 0:
            stats["kl"] = ops.masked_mean(kl.detach(), mask)  # TRL's `kl`: the loss's per-token k3
        if out.entropy is not None:
            stats["policy/entropy_avg"] = ops.masked_mean(out.entropy, mask)
    return pg_loss, stats
