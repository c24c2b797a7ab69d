"""RL math for PPO / RLOO on causal language models, as small pure tensor functions.

Conventions used throughout:
    B = batch size (number of sequences), T = response length, V = vocabulary size.
    ``mask`` tensors are bool or 0/1 floats of the same shape as the values they mask;
    True / 1 marks a real (non-padding) response token.

Nothing here calls ``.item()`` or otherwise syncs with the device, except ``masked_var`` (and
``masked_whiten``, which calls it): it reads the number of masked elements once to raise a clear
error instead of returning NaN/inf.

References:
    - PPO: Schulman et al. 2017, https://arxiv.org/abs/1707.06347
    - GAE: Schulman et al. 2015, https://arxiv.org/abs/1506.02438
    - RLOO: Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740
    - KL estimators: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    - Implementation details: Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO",
      https://arxiv.org/abs/2403.17031 (summarize_from_feedback_details)
"""

from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F

KL_ESTIMATORS = ("k1", "k3")
Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over all processes (`accelerator.reduce(t, "sum")`); statistics that the docs call global
reduce their numerators and denominators with it, never means of means. None: this process alone."""


# ---------------------------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                reduce: Reduce | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set.

        masked_mean = sum(values * mask) / sum(mask)      (each sum over every process with ``reduce``)

    Args:
        values: (...) floating tensor, e.g. (B, T).
        mask: same shape as ``values``; bool or 0/1 float.
        dim: reduce over all elements when None (-> scalar), else along ``dim`` only.
        reduce: with dim None, sums the numerator and denominator across processes (a global mean).

    Returns:
        scalar tensor, or ``values`` with ``dim`` reduced. The scalar mean of an all-zero mask is 0 (a
        micro-batch with nothing in the loss gives a zero loss and zero gradients, not NaN); along ``dim``
        an all-zero slice gives NaN (0/0). No check syncs with the device.
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
    """Variance of ``values`` over all masked positions.

        mu  = masked_mean(values, mask)
        var = masked_mean((values - mu)^2, mask)        (biased, divides by n)
        var = var * n / (n - 1)                          (unbiased / Bessel-corrected)
        with n = sum(mask)

    Args:
        values: (...) floating tensor, e.g. (B, T).
        mask: same shape as ``values``; bool or 0/1 float.
        unbiased: apply Bessel's correction (matches ``torch.var(values[mask])``).
        reduce: makes mu, the squared deviations and n global sums over processes.

    Returns:
        scalar tensor.

    Raises:
        ValueError: if the mask is empty, or has a single element while ``unbiased`` is True.
            Checking this reads n on the host (one device sync per call).
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
    """Normalize ``values`` to zero mean and unit variance using masked statistics.

        out = (values - mu) * rsqrt(var + 1e-8)
        out = out + mu                    if not shift_mean (only the scale changes)
        with mu = masked_mean(values, mask), var = masked_var(values, mask, unbiased=True)

    Args:
        values: (...) floating tensor, e.g. advantages (B, T).
        mask: same shape as ``values``; bool or 0/1 float.
        shift_mean: subtract the mean (True) or keep it (False, e.g. for rewards).
        reduce: whiten with the statistics of the global batch (every process's shard).

    Returns:
        tensor of ``values``' shape. Masked-out positions hold the same affine transform of their
        input (they are not zeroed): callers must keep masking them.

    Raises:
        ValueError: from ``masked_var`` if the mask has fewer than 2 elements.
    """
    mean = masked_mean(values, mask, reduce=reduce)  # scalar
    var = masked_var(values, mask, unbiased=True, reduce=reduce)  # scalar; asserts shapes, raises on tiny masks
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)  # (...)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ---------------------------------------------------------------------------------------------
# token bookkeeping
# ---------------------------------------------------------------------------------------------


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first True in each row, or the row length T when a row has no True.

        idx[b] = min({t : bools[b, t]} ∪ {T})

    Args:
        bools: (B, T) bool tensor (any leading dims work; the last dim is searched).
        dtype: integer dtype of the result.

    Returns:
        (B,) tensor of indices in [0, T].
    """
    assert bools.dtype == torch.bool, f"first_true_indices expects a bool tensor, got {bools.dtype}"
    row_len = bools.size(-1)
    positions = torch.arange(row_len, dtype=dtype, device=bools.device)  # (T,)
    # non-True positions count as T, so the row minimum is the first True or T when there is none
    candidates = torch.where(bools, positions, torch.full_like(positions, row_len))  # (B, T)
    return candidates.min(dim=-1).values  # (B,)


def truncate_after_stop(responses: torch.Tensor, stop_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Replace every token after the first stop token with ``pad_token_id``.

        out[b, t] = responses[b, t]   if t <= first index of stop_token_id in row b
                  = pad_token_id      otherwise

    The stop token itself is kept; rows without a stop token are returned unchanged. Works when
    ``stop_token_id == pad_token_id`` (everything from the first pad on is pad).

    Args:
        responses: (B, T) integer token ids (generated continuations, prompt excluded).
        stop_token_id: e.g. the EOS token id.
        pad_token_id: the id written after the stop token.

    Returns:
        (B, T) tensor of token ids, a new tensor (the input is not modified).
    """
    assert responses.dim() == 2, f"responses must be (B, T), got shape {tuple(responses.shape)}"
    stop_idx = first_true_indices(responses == stop_token_id)  # (B,); T when there is no stop
    positions = torch.arange(responses.size(1), device=responses.device)  # (T,)
    keep = positions.unsqueeze(0) <= stop_idx.unsqueeze(1)  # (B, T)
    return torch.where(keep, responses, torch.full_like(responses, pad_token_id))  # (B, T)


# ---------------------------------------------------------------------------------------------
# log-probabilities and entropy
# ---------------------------------------------------------------------------------------------


CHUNK_BYTES = 64 * 2**20
"""Extra memory the log-prob and entropy helpers may use at once: rows of the batch go through in chunks of at
most this many bytes of (rows, T, V) floats. One chunk holds a whole small-vocabulary micro-batch (one kernel
per op instead of one per row: on tiny models the per-op overhead is the cost), and a few rows of a 50k vocab."""


def _row_chunks(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`logits` (B, T, V) split along B into chunks of at most CHUNK_BYTES (at least one row each)."""
    row_bytes = logits[0].numel() * max(logits.element_size(), 4)  # softmax and friends work in fp32 at least
    return logits.split(max(1, CHUNK_BYTES // max(row_bytes, 1)))


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) gathered at ``index``, without materializing the full (B, T, V) log-probs.

        out[b, t] = logits[b, t, index[b, t]] - logsumexp_v(logits[b, t, v])

    fp32 / fp64: gather the selected logits and subtract a logsumexp computed chunk by chunk of rows,
    so the peak extra memory is one chunk (CHUNK_BYTES) instead of a (B, T, V) copy.
    bf16 / fp16: ``logits - logsumexp`` loses precision in low-precision dtypes, so each chunk goes
    through ``log_softmax`` (as TRL does); the extra memory is still one chunk.

    Args:
        logits: (B, T, V) floating tensor (already divided by the sampling temperature, if any).
        index: (B, T) integer token ids to select.

    Returns:
        (B, T) log-probabilities in ``logits``' dtype; differentiable w.r.t. ``logits``.
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
    """Entropy of the categorical distribution softmax(logits), per position.

        H = -sum_v p_v log p_v = log S - (sum_v e_v z_v) / S,   z = logits - max(logits), e = exp(z), S = sum_v e_v

    The second form never takes the log of a probability, so it stays finite when some p_v
    underflow to 0; -inf logits (e.g. from top-k masking) are fine as long as one logit per
    position is finite (their z is set to 0: e_v z_v is 0 there, not 0 * -inf = NaN, forward and
    backward). One exp pass, and the sum of products as a batched dot product (no (B, T, V)
    product tensor): ~2x faster than softmax + logsumexp on a CPU. Rows go through in chunks of at
    most CHUNK_BYTES to bound peak memory.

    Args:
        logits: (B, T, V) floating tensor.

    Returns:
        (B, T) entropies in nats.
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
    """The log-prob of each chosen token under softmax(logits / temperature), and that distribution's entropy, from
    the raw logits in `pieces` along T (e.g. [(B, 1, V), (B, T - 1, V)], the shared prompt's last position and the
    rest): what ``selective_log_softmax(cat(pieces) / temperature, index)`` and ``entropy_from_logits`` of the same
    give, to rounding (GRPO's forward; PPO and RLOO keep those two).

    One fused pass per piece instead of a full-vocabulary tensor per step: z = (x - max x) / temperature and e = exp z
    once, then log p = z[index] - log S and H = log S - (e . z) / S with S = sum e, and e is what the backward needs:
    dlogp/dx = (onehot - e / S) / temperature, one pass over e (no concatenation, no scaled copy, no log-softmax
    backward, no dense gather backward, no gradient sum). Extra memory: e, of the logits' size, held for the backward
    in place of the scaled logits, and a CHUNK_BYTES chunk of z. The logits must be finite (a model's are: no
    top-k -inf here).

    Args:
        pieces: (B, T_i, V) raw logits with sum T_i = T; bf16 / fp16 ones (autocast) are upcast to fp32 here.
        index: (B, T) integer token ids to select.
        temperature: the sampling temperature the log-probs are taken at.
        with_entropy: also return the (B, T) entropies (no gradient; a logged statistic); else None.

    Returns:
        ((B, T) log-probs, differentiable w.r.t. every piece; (B, T) entropies in nats or None).
    """
    widths = [piece.shape[1] for piece in pieces]
    assert sum(widths) == index.shape[1] and all(p.shape[0] == index.shape[0] for p in pieces), (
        f"pieces {[tuple(p.shape) for p in pieces]} must cover index {tuple(index.shape)} along T"
    )
    upcast = [piece if piece.dtype in (torch.float32, torch.float64) else piece.float() for piece in pieces]
    logprobs, entropy = _TokenLogprobs.apply(index, float(temperature), with_entropy, *upcast)
    return logprobs, (entropy if with_entropy else None)


class _TokenLogprobs(torch.autograd.Function):
    """`token_logprobs_and_entropy`'s forward and its one-pass backward."""

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
                    dot = torch.bmm(e_rows.reshape(-1, 1, V), z.reshape(-1, V, 1)).view(s.shape)  # sum_v e_v z_v
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


# ---------------------------------------------------------------------------------------------
# KL penalty and advantages
# ---------------------------------------------------------------------------------------------


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, elementwise.

    With r = ref_logprobs - logprobs = log(pi_ref(x) / pi(x)) and x ~ pi:
        "k1":  -r = logprobs - ref_logprobs          (unbiased, high variance, can be negative)
        "k3":  (exp(r) - 1) - r                      (unbiased, lower variance, always >= 0)

    See John Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the policy.
        ref_logprobs: (B, T) log-probs of the same tokens under the reference model.
        estimator: "k1" or "k3".

    Returns:
        (B, T) per-token KL estimates (not masked: multiply by the response mask before summing).

    Raises:
        ValueError: for an unknown estimator.
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
    """Generalized Advantage Estimation, computed backwards over time.

        delta_t = r_t + gamma * V_{t+1} - V_t            with V_T = 0 (episode ends after T-1)
        A_t     = delta_t + gamma * lam * A_{t+1}         with A_T = 0
        returns = A + V

    Padding after the end of a response is not handled here: set rewards and values to 0 at
    padding positions before calling (so they add nothing), and mask the outputs afterwards.

    Outputs are computed under ``torch.no_grad`` and never carry autograd history: advantages and
    returns are regression / policy-gradient targets, not something to differentiate through.

    Args:
        rewards: (B, T) per-token rewards (e.g. -beta * KL, plus the score on the last token).
        values: (B, T) value estimates V(s_t) from the rollout.
        gamma: discount factor in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages, returns), both (B, T), detached.
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
    """REINFORCE Leave-One-Out advantages: each sample's reward minus the mean of its siblings.

        A[p, i] = R[p, i] - (sum_j R[p, j] - R[p, i]) / (k - 1)

    Args:
        rewards: (num_prompts, k) sequence-level rewards, the k samples of a prompt in one row.
            A flat batch laid out prompt-major (p0s0, p0s1, ..., p1s0, ...) is
            ``rewards.view(-1, k)``; a sample-major one (p0s0, p1s0, ..., p0s1, ...) is
            ``rewards.view(k, -1).T``.

    Returns:
        (num_prompts, k) advantages; each row sums to 0.
    """
    assert rewards.dim() == 2, f"rewards must be (num_prompts, k), got shape {tuple(rewards.shape)}"
    k = rewards.size(1)
    assert k >= 2, f"RLOO needs k >= 2 samples per prompt for a leave-one-out baseline, got k={k}"
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)  # (P, k), mean of the others
    return rewards - baseline  # (P, k)


# ---------------------------------------------------------------------------------------------
# PPO losses
# ---------------------------------------------------------------------------------------------


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate policy loss (to minimize).

        ratio    = exp(logprobs - old_logprobs)
        loss     = masked_mean(max(-A * ratio, -A * clamp(ratio, 1 - eps, 1 + eps_high)), mask)
        clipfrac = masked_mean(-A * clamp(ratio, 1 - eps, 1 + eps_high) > -A * ratio, mask)

    ``eps_high`` = ``cliprange_high`` (DAPO's clip-higher, TRL's ``epsilon_high``), ``cliprange`` when None:
    a larger upper bound lets tokens with a positive advantage gain more probability per update.

    ``old_logprobs`` and ``advantages`` are treated as constants (detached).

    Args:
        logprobs: (B, T) log-probs of the taken tokens under the current policy (with grad).
            (B, 1) works as well, for sequence-level log-probs.
        old_logprobs: (B, T) log-probs of the same tokens at rollout time.
        advantages: (B, T) advantages (already whitened, if desired).
        mask: (B, T) bool or 0/1 float; True at real response tokens.
        cliprange: epsilon, e.g. 0.2.
        cliprange_high: the upper epsilon, e.g. 0.28; None for the symmetric clip.

    Returns:
        (loss, clipfrac): scalar tensors; ``loss`` keeps the graph w.r.t. ``logprobs``,
        ``clipfrac`` (fraction of masked tokens where the clipped term was active) has no grad.
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
    """How often the clip bound, not the ratio, set the loss, by side (TRL's `clip_ratio/*` metrics):

        low    = masked_mean(ratio < 1 - eps and A < 0)        the ratio fell below the lower bound
        high   = masked_mean(ratio > 1 + eps_high and A > 0)   the ratio rose above the upper bound
        region = masked_mean(low or high)

    Args:
        ratio, advantages, mask: (B, T) (or (B, 1) per sequence), as in `ppo_policy_loss`.

    Returns:
        {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}: scalars, no grad.
    """
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
    """PPO clipped value loss (to minimize).

        v_clipped = old_values + clamp(values - old_values, -eps, eps)
        loss      = 0.5 * masked_mean(max((values - R)^2, (v_clipped - R)^2), mask)
        clipfrac  = masked_mean((v_clipped - R)^2 > (values - R)^2, mask)

    ``old_values`` and ``returns`` are treated as constants (detached).

    Args:
        values: (B, T) value predictions of the current value head (with grad).
        old_values: (B, T) value predictions at rollout time.
        returns: (B, T) regression targets, e.g. from ``gae``.
        mask: (B, T) bool or 0/1 float; True at real response tokens.
        cliprange_value: epsilon for the value clipping, in the units of the values, e.g. 0.2.

    Returns:
        (loss, clipfrac): scalar tensors; ``loss`` keeps the graph w.r.t. ``values``,
        ``clipfrac`` (fraction of masked tokens where the clipped term was larger) has no grad.
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


# -- keyed random numbers: the same sample for an episode whatever process or batch draws it ----------------------

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
    """SplitMix64's finalizer on int64 tensors (wrapping arithmetic): a bijective, well-mixed hash of each value."""
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
    """(B,) float64 uniforms in [0, 1) with 53 random bits, a pure function of (key, step): a row draws the same
    number wherever it is computed (any batch, any process)."""
    bits = splitmix64(keys ^ _int64(step * 0x2545F4914F6CDD1D))  # (B,)
    return _shr(bits, 11).to(torch.float64) / float(1 << 53)


def sample_categorical(scores: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw per row from softmax(scores), by inverse CDF: the first token whose cumulative probability
    exceeds the row's uniform times the total.

        p = softmax(scores);  c_v = sum_{u <= v} p_u  (fp64);  token = min{v : c_v > uniform * c_V}

    One random number per row instead of one per vocabulary entry (the Gumbel-max trick's `log(-log(u))`
    over a (B, V) draw took ~0.65 ms of a (64, 2048) decoding step on a CPU, this ~0.1 ms). The running sum is
    in fp64, so every token keeps its fp32 probability to ~1e-13; a token of probability 0 (-inf score, e.g.
    masked by top-k) is never drawn.

    Args:
        scores: (B, V) floating tensor (logits, already warped by temperature and truncation).
        uniform: (B,) floats in [0, 1).

    Returns:
        (B,) int64 token ids in [0, V).
    """
    probs = torch.softmax(scores.float(), dim=-1)  # (B, V)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    # strictly below the total: the search then always lands on a token of positive probability
    target = torch.minimum(uniform.to(torch.float64)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (B,)
    # a NaN row (a diverged model) finds no cumulative value above its target: keep its index valid, so the NaN
    # reaches the log-probs and the loss, where training stops with a named error, instead of an index error here
    return index.clamp_(max=scores.shape[-1] - 1)
