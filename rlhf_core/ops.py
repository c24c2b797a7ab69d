"""RL math for PPO, RLOO and GRPO on causal language models, as small pure tensor functions.

Shapes: B sequences, T response tokens, V vocabulary; a ``mask`` has its values' shape (bool or 0/1, True
at real response tokens). Only ``masked_var`` (and ``masked_whiten``) syncs with the device: to raise, not
return NaN.
Derivations, numerics and references: docs/trainer.md#the-math-in-rlhf_coreopspy
"""

from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F

KL_ESTIMATORS = ("k1", "k3")
Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over all processes (`accelerator.reduce(t, "sum")`); statistics that the docs call global
reduce their numerators and denominators with it, never means of means. None: this process alone."""


# -- masked statistics ---------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                reduce: Reduce | None = None) -> torch.Tensor:
    """sum(values * mask) / sum(mask): a scalar over all elements, or along ``dim``; ``reduce`` (dim None
    only) sums numerator and denominator over processes, a global mean.

    An empty mask gives 0 as a scalar (a micro-batch with nothing in the loss has zero loss and gradients,
    not NaN) and NaN along ``dim``. Why: docs/trainer.md#masked-statistics
    """
    assert values.shape == mask.shape, f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ"
    mask = mask.to(values.dtype)  # bool -> float so that multiplication and sums are in values' dtype
    if dim is None:  # a 0/1 mask sums to 0 or at least 1: the clamp changes only the empty case
        if reduce is not None:
            return reduce((values * mask).sum()) / reduce(mask.sum()).clamp(min=1)
        return (values * mask).sum() / mask.sum().clamp(min=1)
    assert reduce is None, "a global mean is over all elements (dim=None)"
    return (values * mask).sum(dim) / mask.sum(dim)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True,
               reduce: Reduce | None = None) -> torch.Tensor:
    """Scalar variance of ``values`` over the masked positions, Bessel-corrected when ``unbiased`` (as
    ``torch.var(values[mask])``); ``reduce`` makes it global. Formula: docs/trainer.md#masked-statistics

    Raises:
        ValueError: if the mask is empty, or selects one element while ``unbiased`` (checking reads n on the
            host: the one device sync).
    """
    assert values.shape == mask.shape, f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ"
    n = mask.sum() if reduce is None else reduce(mask.sum().to(values.dtype))  # scalar
    n_host = float(n)  # the single sync: needed to raise instead of silently returning NaN/inf
    if n_host == 0:
        raise ValueError("masked_var: the mask selects no elements; the variance is undefined.")
    if unbiased and n_host == 1:
        raise ValueError(
            "masked_var: the mask selects a single element; the unbiased variance (n - 1 = 0) is "
            "undefined. Use more elements or unbiased=False."
        )
    mean = masked_mean(values, mask, reduce=reduce)  # scalar
    variance = masked_mean((values - mean) ** 2, mask, reduce=reduce)  # scalar
    if unbiased:
        variance = variance * (n_host / (n_host - 1))  # Bessel's correction
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  reduce: Reduce | None = None) -> torch.Tensor:
    """``values`` scaled to unit masked variance and, with ``shift_mean``, to zero masked mean (False keeps
    the mean, e.g. for rewards); ``reduce``: with the global batch's statistics. Masked-out positions get the
    same affine map, not zeros: keep masking them. Raises ``masked_var``'s ValueError (fewer than 2
    elements). Formula: docs/trainer.md#masked-statistics
    """
    mean = masked_mean(values, mask, reduce=reduce)  # scalar
    var = masked_var(values, mask, unbiased=True, reduce=reduce)  # scalar; asserts shapes, raises if n < 2
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)  # (...)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# -- token bookkeeping ---------------------------------------------------------------------------------------


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """(B,) index of the first True of each row of ``bools`` (B, T) (the last dim is searched; any leading
    dims work), or T where a row has none."""
    assert bools.dtype == torch.bool, f"first_true_indices expects a bool tensor, got {bools.dtype}"
    row_len = bools.size(-1)
    positions = torch.arange(row_len, dtype=dtype, device=bools.device)  # (T,)
    # non-True positions count as T, so the row minimum is the first True or T when there is none
    candidates = torch.where(bools, positions, torch.full_like(positions, row_len))  # (B, T)
    return candidates.min(dim=-1).values  # (B,)


def truncate_after_stop(responses: torch.Tensor, stop_token_id: int, pad_token_id: int) -> torch.Tensor:
    """A new (B, T) ``responses`` (token ids, prompt excluded) with every token after a row's first
    ``stop_token_id`` set to ``pad_token_id``; the stop token stays, rows without one are unchanged, and
    ``stop_token_id == pad_token_id`` works."""
    assert responses.dim() == 2, f"responses must be (B, T), got shape {tuple(responses.shape)}"
    stop_idx = first_true_indices(responses == stop_token_id)  # (B,); T when there is no stop
    positions = torch.arange(responses.size(1), device=responses.device)  # (T,)
    keep = positions.unsqueeze(0) <= stop_idx.unsqueeze(1)  # (B, T)
    return torch.where(keep, responses, torch.full_like(responses, pad_token_id))  # (B, T)


# -- log-probabilities and entropy ---------------------------------------------------------------------------


CHUNK_BYTES = 64 * 2**20
"""Extra memory the log-prob and entropy helpers may use at once: rows of the batch go through in chunks of at
most this many bytes of (rows, T, V) floats. One chunk holds a whole small-vocabulary micro-batch (one kernel
per op instead of one per row: on tiny models the per-op overhead is the cost), and a few rows of a 50k vocab."""


def _row_chunks(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`logits` (B, T, V) split along B into chunks of at most CHUNK_BYTES (at least one row each)."""
    row_bytes = logits[0].numel() * max(logits.element_size(), 4)  # softmax and friends work in fp32 at least
    return logits.split(max(1, CHUNK_BYTES // max(row_bytes, 1)))


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, T) log softmax(``logits``) (B, T, V) gathered at ``index`` (B, T), in ``logits``' dtype and
    differentiable, with one CHUNK_BYTES chunk of extra memory instead of a (B, T, V) copy. ``logits`` are
    already divided by the sampling temperature.
    Why fp32 and bf16 differ: docs/trainer.md#selective_log_softmax
    """
    assert logits.shape[:-1] == index.shape, (
        f"logits {tuple(logits.shape)} must be index {tuple(index.shape)} plus a vocab dim"
    )
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)  # (B, T)
        logsumexp = torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in _row_chunks(logits)])  # (B, T)
        return selected - logsumexp  # (B, T)
    chunks = _row_chunks(logits)
    out = []
    for chunk_logits, chunk_index in zip(chunks, index.split([len(c) for c in chunks]), strict=True):
        chunk_logps = F.log_softmax(chunk_logits, dim=-1)  # (b, T, V)
        out.append(chunk_logps.gather(dim=-1, index=chunk_index.unsqueeze(-1)).squeeze(-1))  # (b, T)
    return torch.cat(out)  # (B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T) entropies in nats of softmax(``logits``) (B, T, V), in CHUNK_BYTES chunks of rows. Finite when
    probabilities underflow and with -inf logits (top-k) as long as one logit per position is finite.
    Formula and speed: docs/trainer.md#entropy_from_logits
    """
    assert logits.dim() >= 2, f"logits must be (B, T, V), got shape {tuple(logits.shape)}"
    out = []
    for chunk in _row_chunks(logits):  # (b, T, V)
        z = chunk - chunk.amax(dim=-1, keepdim=True)  # (b, T, V), max 0
        e = z.exp()
        total = e.sum(dim=-1)  # (b, T), >= 1
        z = z.nan_to_num(neginf=0.0)
        V = z.shape[-1]
        dot = torch.bmm(e.reshape(-1, 1, V), z.reshape(-1, V, 1)).view(total.shape)  # (b, T) sum_v e_v z_v
        out.append(total.log() - dot / total)
    return torch.cat(out)  # (B, T)


def token_logprobs_and_entropy(pieces: Sequence[torch.Tensor], index: torch.Tensor, temperature: float,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log-probs of ``index`` under softmax(logits / temperature) and (B, T) entropies of it (no
    gradient; None without ``with_entropy``), from raw logit ``pieces`` (B, T_i, V) that cover T, e.g. a
    shared prompt's last position and the rest. Equal to rounding to ``selective_log_softmax`` +
    ``entropy_from_logits`` of the concatenated scaled logits, in one fused pass with a one-pass backward:
    the training forward of every algorithm and the rollout's log-prob forwards. bf16 / fp16 pieces are upcast to fp32; the logits
    must be finite. Derivation and memory: docs/trainer.md#token_logprobs_and_entropy
    """
    widths = [piece.shape[1] for piece in pieces]
    assert sum(widths) == index.shape[1] and all(p.shape[0] == index.shape[0] for p in pieces), (
        f"pieces {[tuple(p.shape) for p in pieces]} must cover index {tuple(index.shape)} along T"
    )
    upcast = [piece if piece.dtype in (torch.float32, torch.float64) else piece.float() for piece in pieces]
    logprobs, entropy = _TokenLogprobs.apply(index, float(temperature), with_entropy, *upcast)
    return logprobs, (entropy if with_entropy else None)


class _TokenLogprobs(torch.autograd.Function):
    """`token_logprobs_and_entropy`'s forward and its one-pass backward.

    Derivation: docs/trainer.md#token_logprobs_and_entropy
    """

    @staticmethod
    def forward(ctx, index: torch.Tensor, temperature: float, with_entropy: bool, *pieces: torch.Tensor):
        widths = [piece.shape[1] for piece in pieces]
        logprobs = pieces[0].new_empty(index.shape)  # (B, T)
        entropy = pieces[0].new_empty(index.shape if with_entropy else (0,))  # (B, T) or nothing
        kept = []
        for piece, columns, piece_index in zip(pieces, _spans(widths), index.split(widths, dim=1), strict=True):
            e = piece.new_empty(piece.shape)  # (B, t, V) exp z, kept for the backward (contiguous)
            total = piece.new_empty(piece.shape[:-1])  # (B, t) S
            for rows in _row_ranges(piece):  # z in chunks of rows: at most CHUNK_BYTES of it at once
                x = piece[rows]  # (b, t, V)
                # (x - max x) / temperature in one pass: -max/temperature + x/temperature, (b, t, V), max ~0
                z = torch.add(x.amax(dim=-1, keepdim=True).div_(-temperature), x, alpha=1 / temperature)
                e_rows = torch.exp(z, out=e[rows])
                s = torch.sum(e_rows, dim=-1, out=total[rows])  # (b, t) >= 1
                log_s = s.log()
                logprobs[rows, columns] = z.gather(-1, piece_index[rows].unsqueeze(-1)).squeeze(-1) - log_s
                if with_entropy:
                    V = z.shape[-1]
                    dot = torch.bmm(e_rows.reshape(-1, 1, V), z.reshape(-1, V, 1)).view(s.shape)  # e . z
                    entropy[rows, columns] = log_s - dot / s
            kept += [e, total]
        ctx.temperature, ctx.widths = temperature, widths
        ctx.save_for_backward(index, *kept)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor, _grad_entropy: torch.Tensor | None):
        index, *saved = ctx.saved_tensors
        grads = []
        for (e, total), piece_grad, piece_index in zip(zip(saved[::2], saved[1::2], strict=True),
                                                       grad.split(ctx.widths, dim=1),
                                                       index.split(ctx.widths, dim=1), strict=True):
            g = piece_grad / ctx.temperature  # (B, t)
            out = e * (-g / total).unsqueeze(-1)  # (B, t, V) -g softmax / temperature
            grads.append(out.scatter_add_(-1, piece_index.unsqueeze(-1), g.unsqueeze(-1)))  # + g onehot
        return None, None, None, *grads


def _spans(widths: list[int]) -> list[slice]:
    """Consecutive slices of the given widths: [0, w0), [w0, w0 + w1), ..."""
    return [slice(end - width, end) for width, end in zip(widths, accumulate(widths), strict=True)]


def _row_ranges(logits: torch.Tensor) -> list[slice]:
    """Slices of rows of `logits` (B, T, V), each at most CHUNK_BYTES of fp32 (at least one row)."""
    step = max(1, CHUNK_BYTES // max(logits[0].numel() * 4, 1))
    return [slice(start, start + step) for start in range(0, logits.shape[0], step)]


# -- KL penalty and advantages -------------------------------------------------------------------------------


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """(B, T) per-token estimates of KL(pi || pi_ref) from the log-probs (B, T) of tokens sampled from pi,
    not masked: "k1" = logprobs - ref_logprobs (unbiased, high variance, can be negative) or
    "k3" = (exp(r) - 1) - r, r = ref_logprobs - logprobs (unbiased, lower variance, >= 0); ValueError for
    another estimator. Derivation: docs/trainer.md#kl_penalty
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    assert logprobs.shape == ref_logprobs.shape, (
        f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
    )
    if estimator == "k1":
        return logprobs - ref_logprobs  # (B, T)
    log_ratio = ref_logprobs - logprobs  # (B, T), r = log(pi_ref / pi)
    return torch.expm1(log_ratio) - log_ratio  # (B, T); expm1 is exact for small r


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation: (advantages, returns = advantages + values), both (B, T) and
    detached (targets, not differentiated), from per-token ``rewards`` and ``values`` V(s_t) (B, T), with
    V_T = A_T = 0. Padding is not handled: zero rewards and values there before, mask the outputs after.
    Recursion: docs/trainer.md#gae
    """
    assert rewards.shape == values.shape, (
        f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} differ"
    )
    assert rewards.dim() == 2, f"rewards/values must be (B, T), got shape {tuple(rewards.shape)}"
    with torch.no_grad():
        num_steps = rewards.size(1)
        next_advantage = torch.zeros_like(values[:, 0])  # (B,), A_T = 0
        next_value = torch.zeros_like(values[:, 0])  # (B,), V_T = 0
        advantages_reversed = []
        for t in reversed(range(num_steps)):  # T is a response length: a Python loop is cheap
            delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
            next_advantage = delta + gamma * lam * next_advantage  # (B,)
            next_value = values[:, t]
            advantages_reversed.append(next_advantage)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, T)
        returns = advantages + values  # (B, T)
    return advantages, returns


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE Leave-One-Out advantages (num_prompts, k): each sequence reward minus the mean of the k - 1
    other samples of its prompt (rows sum to 0). Formula: docs/trainer.md#rloo_advantages

    Args:
        rewards: (num_prompts, k), a prompt's k samples in one row: a flat prompt-major batch (p0s0, p0s1,
            ..., p1s0, ...) is ``rewards.view(-1, k)``, a sample-major one (p0s0, p1s0, ..., p0s1, ...)
            ``rewards.view(k, -1).T``.
    """
    assert rewards.dim() == 2, f"rewards must be (num_prompts, k), got shape {tuple(rewards.shape)}"
    k = rewards.size(1)
    assert k >= 2, f"RLOO needs k >= 2 samples per prompt for a leave-one-out baseline, got k={k}"
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)  # (P, k), mean of the others
    return rewards - baseline  # (P, k)


# -- PPO losses ----------------------------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate loss (to minimize) and clip fraction, scalars, from (B, T) inputs ((B, 1) for
    sequence-level log-probs): the masked mean of the larger of -A * ratio and -A * ratio clipped to
    [1 - cliprange, 1 + cliprange_high], the pessimistic bound. ``cliprange_high`` (DAPO's clip-higher, TRL's
    ``epsilon_high``; ``cliprange`` when None) lets positive-advantage tokens gain more per update.
    Formulas: docs/trainer.md#ppo_policy_loss-and-ppo_value_loss

    Returns:
        (loss, clipfrac): ``loss`` keeps the graph w.r.t. ``logprobs`` (``old_logprobs`` and ``advantages``
        are detached); ``clipfrac``, the fraction of masked tokens where the clipped term was active, has no
        grad.
    """
    assert logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape, (
        f"shape mismatch: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)}, "
        f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}"
    )
    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    pg_losses = -advantages * ratio  # (B, T)
    high = cliprange if cliprange_high is None else cliprange_high
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)  # (B, T)
    # pessimistic bound: the max of the two losses = the min of the two surrogate objectives
    loss = masked_mean(torch.max(pg_losses, pg_losses_clipped), mask)  # scalar
    clipfrac = masked_mean((pg_losses_clipped > pg_losses).to(pg_losses.dtype), mask).detach()  # scalar
    return loss, clipfrac


def clip_ratios(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cliprange: float,
                cliprange_high: float | None = None) -> dict[str, torch.Tensor]:
    """TRL's ``clip_ratio/{low,high,region}_mean`` metrics (scalars, no grad): the masked fractions of tokens
    whose loss a clip bound set, not the ratio: low (ratio < 1 - eps, A < 0), high (ratio > 1 + eps_high,
    A > 0) or either. Arguments (B, T) or (B, 1), as in ``ppo_policy_loss``."""
    ratio, advantages = ratio.detach(), advantages.detach()
    high = cliprange if cliprange_high is None else cliprange_high
    is_low = (ratio < 1.0 - cliprange) & (advantages < 0)
    is_high = (ratio > 1.0 + high) & (advantages > 0)
    return {"clip_ratio/low_mean": masked_mean(is_low.float(), mask),
            "clip_ratio/high_mean": masked_mean(is_high.float(), mask),
            "clip_ratio/region_mean": masked_mean((is_low | is_high).float(), mask)}


def mix_into(target: Iterable[torch.Tensor], source: Iterable[torch.Tensor], alpha: float) -> None:
    """In place, parameter by parameter: target <- alpha * source + (1 - alpha) * target (TR-DPO's soft
    reference update; alpha = 1 copies). Each target keeps its dtype; the mix is computed in fp32."""
    with torch.no_grad():
        for t, s in zip(target, source, strict=True):
            assert t.shape == s.shape, f"reference {tuple(t.shape)} and policy {tuple(s.shape)} differ"
            mixed = alpha * s.detach().float() + (1.0 - alpha) * t.float()
            t.copy_(mixed.to(t.dtype))


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (to minimize) and clip fraction, scalars, from (B, T) inputs: 0.5 * the masked
    mean of the larger squared error to ``returns`` of ``values`` and of values kept within
    ``cliprange_value`` (in the values' units) of ``old_values``.
    Formulas: docs/trainer.md#ppo_policy_loss-and-ppo_value_loss

    Returns:
        (loss, clipfrac): ``loss`` keeps the graph w.r.t. ``values`` (``old_values`` and ``returns`` are
        detached); ``clipfrac``, the fraction of masked tokens where the clipped term was larger, has no grad.
    """
    assert values.shape == old_values.shape == returns.shape == mask.shape, (
        f"shape mismatch: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, "
        f"returns {tuple(returns.shape)}, mask {tuple(mask.shape)}"
    )
    old_values, returns = old_values.detach(), returns.detach()
    delta = torch.clamp(values - old_values, -cliprange_value, cliprange_value)  # (B, T)
    values_clipped = old_values + delta  # (B, T)
    vf_losses = (values - returns) ** 2  # (B, T)
    vf_losses_clipped = (values_clipped - returns) ** 2  # (B, T)
    loss = 0.5 * masked_mean(torch.max(vf_losses, vf_losses_clipped), mask)  # scalar
    clipfrac = masked_mean((vf_losses_clipped > vf_losses).to(vf_losses.dtype), mask).detach()  # scalar
    return loss, clipfrac


# -- keyed random numbers: the same sample for an episode whatever process or batch draws it ---------------

_MASK64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores (the bits are what matter)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (wrapping arithmetic): a bijective, well-mixed hash of each
    value."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def episode_keys(seed: int, update: int, prompt_indices: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """(B,) int64 keys of episodes: one per (seed, update, prompt, sample of that prompt)."""
    key = splitmix64(torch.full_like(prompt_indices, _int64(seed)))
    for part in (torch.full_like(prompt_indices, update), prompt_indices, sample):
        key = splitmix64(key ^ part)
    return key


def keyed_uniform(keys: torch.Tensor, step: int) -> torch.Tensor:
    """(B,) float64 uniforms in [0, 1) with 53 random bits, a pure function of (key, step): a row draws the
    same number wherever it is computed (any batch, any process)."""
    bits = splitmix64(keys ^ _int64(step * 0x2545F4914F6CDD1D))  # (B,)
    return _shr(bits, 11).to(torch.float64) / float(1 << 53)


def sample_categorical(scores: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """(B,) int64 token ids, one draw per row from softmax(``scores``) (B, V) (logits already warped by
    temperature and truncation) by inverse CDF with the row's ``uniform`` (B,) in [0, 1): the first token
    whose fp64 cumulative probability exceeds uniform times the total. One random number per row instead of
    one per vocabulary entry; a token of probability 0 (-inf score) is never drawn.
    Why and numerics: docs/trainer.md#sample_categorical
    """
    probs = torch.softmax(scores.float(), dim=-1)  # (B, V)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    # strictly below the total: the search then always lands on a token of positive probability
    target = torch.minimum(uniform.to(torch.float64)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (B,)
    # a NaN row (a diverged model) finds no cumulative value above its target: keep its index valid, so the
    # NaN reaches the log-probs and the loss, where training stops with a named error, not an index error here
    return index.clamp_(max=scores.shape[-1] - 1)
