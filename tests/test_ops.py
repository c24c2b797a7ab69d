"""Unit tests for rlhf_core.ops: each function against a plain Python-loop reference."""

import math

import pytest
import torch

from rlhf_core import ops
from rlhf_core.ops import (
    entropy_from_logits,
    first_true_indices,
    gae,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    ppo_value_loss,
    rloo_advantages,
    selective_log_softmax,
    truncate_after_stop,
)

B, T, V = 4, 7, 11


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


def _random_mask(*shape, seed: int, p: float = 0.6) -> torch.Tensor:
    """Random bool mask with at least two True entries."""
    mask = torch.rand(*shape, generator=_gen(seed)) < p
    mask.view(-1)[:2] = True
    return mask


def _naive_masked_stats(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, int]:
    """(mean, sum of squared deviations, n) over masked elements, with Python floats."""
    xs = [float(v) for v, m in zip(values.flatten().tolist(), mask.flatten().tolist(), strict=True) if m]
    mean = sum(xs) / len(xs)
    return mean, sum((x - mean) ** 2 for x in xs), len(xs)


# ---------------------------------------------------------------------------------------------
# masked statistics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("float_mask", [False, True])
def test_masked_mean_all_and_dim(float_mask):
    values = _randn(B, T, seed=0)
    mask = _random_mask(B, T, seed=1)
    m = mask.double() if float_mask else mask

    mean, _, _ = _naive_masked_stats(values, mask)
    assert masked_mean(values, m).item() == pytest.approx(mean, rel=1e-12)

    per_row = masked_mean(values, m, dim=1)
    assert per_row.shape == (B,)
    for b in range(B):
        xs = [values[b, t].item() for t in range(T) if mask[b, t]]
        assert per_row[b].item() == pytest.approx(sum(xs) / len(xs), rel=1e-12)

    per_col = masked_mean(values, m, dim=0)
    assert per_col.shape == (T,)
    for t in range(T):
        xs = [values[b, t].item() for b in range(B) if mask[b, t]]
        if xs:
            assert per_col[t].item() == pytest.approx(sum(xs) / len(xs), rel=1e-12)
        else:
            assert math.isnan(per_col[t].item())  # 0 / 0: documented, no host sync to check it


def test_masked_mean_shape_mismatch():
    with pytest.raises(AssertionError, match="differ"):
        masked_mean(torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool))


def test_masked_var_unbiased_biased_and_torch_var():
    values = _randn(B, T, seed=2)
    mask = _random_mask(B, T, seed=3)
    _, ssd, n = _naive_masked_stats(values, mask)

    unbiased = masked_var(values, mask)
    biased = masked_var(values, mask, unbiased=False)
    assert unbiased.item() == pytest.approx(ssd / (n - 1), rel=1e-12)
    assert biased.item() == pytest.approx(ssd / n, rel=1e-12)
    torch.testing.assert_close(unbiased, torch.var(values[mask], unbiased=True))
    torch.testing.assert_close(biased, torch.var(values[mask], unbiased=False))
    # a float 0/1 mask gives the same result
    torch.testing.assert_close(masked_var(values, mask.double()), unbiased)


def test_masked_var_too_few_elements():
    values = _randn(2, 3, seed=4)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    single = empty.clone()
    single[1, 2] = True
    with pytest.raises(ValueError, match="no elements"):
        masked_var(values, empty)
    with pytest.raises(ValueError, match="no elements"):
        masked_var(values, empty, unbiased=False)
    with pytest.raises(ValueError, match="single element"):
        masked_var(values, single)
    assert masked_var(values, single, unbiased=False).item() == 0.0


def test_masked_whiten():
    values = 3.0 + 2.5 * _randn(B, T, seed=5)
    mask = _random_mask(B, T, seed=6)
    mean, ssd, n = _naive_masked_stats(values, mask)
    std = math.sqrt(ssd / (n - 1) + 1e-8)

    whitened = masked_whiten(values, mask)
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-10)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, rel=1e-6)
    for b in range(B):
        for t in range(T):  # masked-out positions get the same transform, they are not zeroed
            assert whitened[b, t].item() == pytest.approx((values[b, t].item() - mean) / std, rel=1e-10)

    scaled = masked_whiten(values, mask, shift_mean=False)
    assert masked_mean(scaled, mask).item() == pytest.approx(mean, rel=1e-10)
    assert masked_var(scaled, mask).item() == pytest.approx(1.0, rel=1e-6)
    torch.testing.assert_close(scaled, whitened + mean)


# ---------------------------------------------------------------------------------------------
# token bookkeeping
# ---------------------------------------------------------------------------------------------


def _naive_first_true(row: list[bool]) -> int:
    for i, x in enumerate(row):
        if x:
            return i
    return len(row)


def test_first_true_indices():
    bools = torch.rand(8, T, generator=_gen(7)) < 0.3
    bools[0] = True  # all True -> 0
    bools[1] = False  # no True -> T
    bools[2] = False
    bools[2, -1] = True  # only the last -> T - 1
    out = first_true_indices(bools)
    assert out.shape == (8,) and out.dtype == torch.long
    assert out.tolist() == [_naive_first_true(row) for row in bools.tolist()]
    assert out[0] == 0 and out[1] == T and out[2] == T - 1
    assert first_true_indices(bools, dtype=torch.int32).dtype == torch.int32


def test_first_true_indices_rejects_non_bool():
    with pytest.raises(AssertionError, match="bool"):
        first_true_indices(torch.zeros(2, 3, dtype=torch.long))


def _naive_truncate(responses: torch.Tensor, stop: int, pad: int) -> list[list[int]]:
    out = []
    for row in responses.tolist():
        new_row, seen_stop = [], False
        for tok in row:
            new_row.append(pad if seen_stop else tok)
            if tok == stop:
                seen_stop = True
        out.append(new_row)
    return out


@pytest.mark.parametrize(("stop", "pad"), [(2, 0), (0, 0), (3, 99)])
def test_truncate_after_stop(stop, pad):
    responses = torch.randint(0, 6, (10, T), generator=_gen(8))
    responses[0] = torch.tensor([5, 4, 1, 5, 4, 1, 5])[:T]  # no stop token (values != 0, 2, 3)
    responses[1, 0] = stop  # stop at position 0
    responses[2, -1] = stop  # stop at the last position
    responses[2, :-1] = 1
    responses[3, 2] = stop  # several stop tokens: only the first counts
    responses[3, 5] = stop
    original = responses.clone()

    out = truncate_after_stop(responses, stop, pad)
    assert torch.equal(responses, original)  # input untouched
    assert out.tolist() == _naive_truncate(responses, stop, pad)
    assert torch.equal(out[0], responses[0])
    assert out[1, 0] == stop and (out[1, 1:] == pad).all()
    assert torch.equal(out[2], responses[2])


# ---------------------------------------------------------------------------------------------
# log-probabilities and entropy
# ---------------------------------------------------------------------------------------------


def _naive_log_softmax_at(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    rows = logits.double().tolist()
    out = torch.zeros(index.shape, dtype=torch.float64)
    for b in range(index.shape[0]):
        for t in range(index.shape[1]):
            row = rows[b][t]
            top = max(row)
            lse = top + math.log(sum(math.exp(x - top) for x in row))
            out[b, t] = row[int(index[b, t])] - lse
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_log_softmax_full_precision(dtype):
    logits = 3.0 * _randn(B, T, V, seed=9, dtype=dtype)
    index = torch.randint(0, V, (B, T), generator=_gen(10))
    out = selective_log_softmax(logits, index)
    assert out.shape == (B, T) and out.dtype == dtype
    reference = torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(out.double(), _naive_log_softmax_at(logits, index), rtol=1e-5, atol=1e-5)


def test_selective_log_softmax_bf16():
    logits = (3.0 * _randn(B, T, V, seed=11, dtype=torch.float32)).to(torch.bfloat16)
    index = torch.randint(0, V, (B, T), generator=_gen(12))
    out = selective_log_softmax(logits, index)
    assert out.shape == (B, T) and out.dtype == torch.bfloat16
    reference = torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, reference)
    # close to the exact log-probs of the (bf16-rounded) logits, within bf16 resolution
    torch.testing.assert_close(out.double(), _naive_log_softmax_at(logits, index), rtol=2e-2, atol=2e-2)


def test_selective_log_softmax_grad_and_shape_check():
    logits = _randn(B, T, V, seed=13).requires_grad_()
    index = torch.randint(0, V, (B, T), generator=_gen(14))
    selective_log_softmax(logits, index).sum().backward()
    reference = logits.detach().clone().requires_grad_()
    torch.log_softmax(reference, -1).gather(-1, index.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad)
    with pytest.raises(AssertionError, match="vocab"):
        selective_log_softmax(logits, index[:, :-1])


def _naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    rows = logits.double().tolist()
    out = torch.zeros(logits.shape[:-1], dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            top = max(rows[b][t])
            exps = [math.exp(x - top) for x in rows[b][t]]
            total = sum(exps)
            out[b, t] = -sum((e / total) * math.log(e / total) for e in exps if e > 0)
    return out


def test_entropy_from_logits():
    logits = 4.0 * _randn(B, T, V, seed=15)
    out = entropy_from_logits(logits)
    assert out.shape == (B, T)
    torch.testing.assert_close(out, _naive_entropy(logits))
    # uniform -> log V; one-hot-like -> ~0
    assert entropy_from_logits(torch.zeros(1, 1, V)).item() == pytest.approx(math.log(V), rel=1e-6)
    peaked = torch.full((1, 1, V), -1e4)
    peaked[..., 0] = 0.0
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_from_logits_with_masked_logits():
    logits = 2.0 * _randn(B, T, V, seed=16)
    logits[..., : V // 2] = -math.inf  # e.g. top-k filtering
    logits.requires_grad_()
    out = entropy_from_logits(logits)
    torch.testing.assert_close(out, _naive_entropy(logits.detach()))
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ---------------------------------------------------------------------------------------------
# KL penalty and advantages
# ---------------------------------------------------------------------------------------------


def test_kl_penalty_estimators():
    logprobs = -torch.rand(B, T, generator=_gen(17), dtype=torch.float64) * 3
    ref_logprobs = -torch.rand(B, T, generator=_gen(18), dtype=torch.float64) * 3
    k1 = kl_penalty(logprobs, ref_logprobs, "k1")
    k3 = kl_penalty(logprobs, ref_logprobs, "k3")
    assert k1.shape == k3.shape == (B, T)
    for b in range(B):
        for t in range(T):
            lp, ref = logprobs[b, t].item(), ref_logprobs[b, t].item()
            r = ref - lp
            assert k1[b, t].item() == pytest.approx(lp - ref, rel=1e-12)
            assert k3[b, t].item() == pytest.approx((math.exp(r) - 1) - r, rel=1e-12, abs=1e-15)
    assert (k3 >= 0).all()
    assert torch.equal(kl_penalty(logprobs, logprobs, "k3"), torch.zeros(B, T, dtype=torch.float64))


def test_kl_penalty_bad_estimator():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(x, x, "k2")
    with pytest.raises(AssertionError, match="differ"):
        kl_penalty(x, torch.zeros(3, 2), "k1")


def _naive_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    r, v = rewards.tolist(), values.tolist()
    adv = [[0.0] * len(row) for row in r]
    for b in range(len(r)):
        last = 0.0
        for t in reversed(range(len(r[b]))):
            next_value = v[b][t + 1] if t + 1 < len(r[b]) else 0.0
            delta = r[b][t] + gamma * next_value - v[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
    returns = [[a + x for a, x in zip(arow, vrow, strict=True)] for arow, vrow in zip(adv, v, strict=True)]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (1.0, 0.9), (0.5, 0.0)])
def test_gae_matches_loop(gamma, lam):
    rewards = _randn(B, T, seed=19)
    values = _randn(B, T, seed=20)
    advantages, returns = gae(rewards, values, gamma, lam)
    ref_adv, ref_ret = _naive_gae(rewards, values, gamma, lam)
    torch.testing.assert_close(advantages, ref_adv)
    torch.testing.assert_close(returns, ref_ret)
    if gamma == 1.0 and lam == 1.0:  # Monte Carlo: A_t = sum_{s >= t} r_s - V_t
        torch.testing.assert_close(advantages, rewards.flip(1).cumsum(1).flip(1) - values)
    if lam == 0.0:  # one-step TD error
        next_values = torch.cat([values[:, 1:], torch.zeros(B, 1, dtype=values.dtype)], dim=1)
        torch.testing.assert_close(advantages, rewards + gamma * next_values - values)


def test_gae_outputs_carry_no_grad():
    rewards = _randn(B, T, seed=21).requires_grad_()
    values = _randn(B, T, seed=22).requires_grad_()
    advantages, returns = gae(rewards, values, 0.99, 0.95)
    assert not advantages.requires_grad and not returns.requires_grad
    with pytest.raises(AssertionError, match="differ"):
        gae(rewards, values[:, :-1], 1.0, 1.0)


@pytest.mark.parametrize("k", [2, 4])
def test_rloo_advantages(k):
    rewards = _randn(5, k, seed=23)
    out = rloo_advantages(rewards)
    assert out.shape == (5, k)
    rows = rewards.tolist()
    for p in range(5):
        for i in range(k):
            others = [rows[p][j] for j in range(k) if j != i]
            assert out[p, i].item() == pytest.approx(rows[p][i] - sum(others) / (k - 1), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(out.sum(dim=1), torch.zeros(5, dtype=torch.float64))
    if k == 2:  # each sample is compared with its only sibling
        torch.testing.assert_close(out[:, 0], rewards[:, 0] - rewards[:, 1])


def test_rloo_advantages_needs_two_samples():
    with pytest.raises(AssertionError, match="k >= 2"):
        rloo_advantages(torch.zeros(3, 1))
    with pytest.raises(AssertionError, match="num_prompts, k"):
        rloo_advantages(torch.zeros(6))


# ---------------------------------------------------------------------------------------------
# PPO losses
# ---------------------------------------------------------------------------------------------


def _naive_policy_loss(logprobs, old_logprobs, advantages, mask, eps):
    """Per-element loop with torch scalars so that autograd works; returns (loss, clipfrac)."""
    total, clipped, count = 0.0, 0.0, 0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if not mask[b, t]:
                continue
            ratio = torch.exp(logprobs[b, t] - old_logprobs[b, t])
            a = advantages[b, t].item()
            unclipped_loss = -a * ratio
            clipped_loss = -a * min(max(ratio, 1 - eps), 1 + eps)
            total = total + max(unclipped_loss, clipped_loss)
            clipped += float(clipped_loss > unclipped_loss)
            count += 1
    return total / count, clipped / count


@pytest.mark.parametrize("shape", [(B, T), (B, 1)])
def test_ppo_policy_loss_matches_loop(shape):
    eps = 0.2
    logprobs = (-torch.rand(*shape, generator=_gen(24), dtype=torch.float64)).requires_grad_()
    # perturbations up to +-0.5 in log-ratio, so that many tokens fall outside [1 - eps, 1 + eps]
    old_logprobs = logprobs.detach() + (torch.rand(*shape, generator=_gen(25), dtype=torch.float64) - 0.5)
    advantages = _randn(*shape, seed=26)
    mask = _random_mask(*shape, seed=27)

    loss, clipfrac = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, eps)
    assert loss.dim() == 0 and clipfrac.dim() == 0
    assert loss.requires_grad and not clipfrac.requires_grad
    loss.backward()

    logprobs_ref = logprobs.detach().clone().requires_grad_()
    ref_loss, ref_clipfrac = _naive_policy_loss(logprobs_ref, old_logprobs, advantages, mask, eps)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    assert clipfrac.item() == pytest.approx(ref_clipfrac, abs=1e-12)
    torch.testing.assert_close(logprobs.grad, logprobs_ref.grad)
    assert (logprobs.grad[~mask] == 0).all()  # padding gets no gradient


def test_ppo_policy_loss_clipfrac_values():
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    old_logprobs = torch.zeros(1, 5)
    # ratios 1.5 (A>0: clipped), 0.5 (A>0: not clipped), 0.5 (A<0: clipped), 1.5 (A<0: not), 1.0
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.0]])).requires_grad_()
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, clipfrac = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, 0.2)
    assert clipfrac.item() == pytest.approx(2 / 5)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 - 1.0) / 5, rel=1e-6)
    loss.backward()
    # clipped tokens get zero gradient; the rest get -A * ratio / n
    expected_grad = torch.tensor([[0.0, -0.5, 0.0, 1.5, -1.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected_grad)

    mask[0, :2] = False  # the clipfrac only counts masked tokens
    _, clipfrac = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, 0.2)
    assert clipfrac.item() == pytest.approx(1 / 3)


def test_ppo_policy_loss_shape_mismatch():
    x = torch.zeros(2, 3)
    with pytest.raises(AssertionError, match="shape mismatch"):
        ppo_policy_loss(x, x, x, torch.ones(2, 4, dtype=torch.bool), 0.2)


def _naive_value_loss(values, old_values, returns, mask, eps):
    total, clipped, count = 0.0, 0.0, 0
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not mask[b, t]:
                continue
            v, old, ret = values[b, t], old_values[b, t].item(), returns[b, t].item()
            v_clipped = old + min(max(v - old, -eps), eps)
            unclipped_loss, clipped_loss = (v - ret) ** 2, (v_clipped - ret) ** 2
            total = total + max(unclipped_loss, clipped_loss)
            clipped += float(clipped_loss > unclipped_loss)
            count += 1
    return 0.5 * total / count, clipped / count


def test_ppo_value_loss_matches_loop():
    eps = 0.2
    values = _randn(B, T, seed=28).requires_grad_()
    old_values = values.detach() + 0.5 * _randn(B, T, seed=29)
    returns = _randn(B, T, seed=30)
    mask = _random_mask(B, T, seed=31).double()  # float mask

    loss, clipfrac = ppo_value_loss(values, old_values, returns, mask, eps)
    assert loss.dim() == 0 and loss.requires_grad and not clipfrac.requires_grad
    loss.backward()

    values_ref = values.detach().clone().requires_grad_()
    ref_loss, ref_clipfrac = _naive_value_loss(values_ref, old_values, returns, mask.bool(), eps)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    assert clipfrac.item() == pytest.approx(ref_clipfrac, abs=1e-12)
    assert 0.0 < clipfrac.item() < 1.0
    torch.testing.assert_close(values.grad, values_ref.grad)


def test_ppo_value_loss_clipfrac_values():
    old_values = torch.zeros(1, 3)
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    # v=0.5: clipped to 0.2 -> (0.8)^2 > (0.5)^2 -> clipped term active
    # v=-0.5: clipped to -0.2 -> (1.2)^2 < (1.5)^2 -> not active
    # v=0.1: inside the range -> equal terms -> not active
    values = torch.tensor([[0.5, -0.5, 0.1]], requires_grad=True)
    loss, clipfrac = ppo_value_loss(values, old_values, returns, torch.ones(1, 3), 0.2)
    assert clipfrac.item() == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25 + 0.01) / 3, rel=1e-6)
    loss.backward()
    # the clipped element has no gradient (the clipped prediction does not depend on values)
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -1.5, 0.1]]) / 3)


def test_global_statistics_on_one_process_equal_the_local_ones():
    """`reduce` sums across processes; on one process (identity) every statistic is bitwise the local one."""
    generator = torch.Generator().manual_seed(0)
    values, mask = torch.randn(4, 6, generator=generator), torch.rand(4, 6, generator=generator) > 0.3
    same = lambda t: t  # noqa: E731
    assert torch.equal(masked_mean(values, mask, reduce=same), masked_mean(values, mask))
    assert torch.equal(masked_var(values, mask, reduce=same), masked_var(values, mask))
    assert torch.equal(masked_whiten(values, mask, reduce=same), masked_whiten(values, mask))


@pytest.mark.parametrize("rows_per_chunk", [1, 2, B])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_and_entropy_are_the_same_whatever_the_chunking(monkeypatch, rows_per_chunk, dtype):
    """The memory bound splits the batch into chunks of rows (one, a few, or all at once): same values and
    gradients as the naive references."""
    import rlhf_core.ops as ops

    monkeypatch.setattr(ops, "CHUNK_BYTES", rows_per_chunk * T * V * 4)
    assert len(ops._row_chunks(torch.zeros(B, T, V))) == -(-B // rows_per_chunk)
    logits = (3.0 * _randn(B, T, V, seed=17)).to(dtype).requires_grad_()
    index = torch.randint(0, V, (B, T), generator=_gen(18))
    logps = selective_log_softmax(logits, index)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logps.double(), _naive_log_softmax_at(logits.detach(), index), **tolerance)
    entropy = entropy_from_logits(logits.detach())
    if dtype == torch.float32:
        torch.testing.assert_close(entropy.double(), _naive_entropy(logits.detach()), **tolerance)
    else:  # bf16 softmax is coarse (the trainer passes fp32 logits): the chunking alone must change nothing
        monkeypatch.setattr(ops, "CHUNK_BYTES", B * T * V * 4)
        torch.testing.assert_close(entropy, entropy_from_logits(logits.detach()))
    logps.float().sum().backward()
    expected = torch.softmax(logits.detach().float(), -1).neg()
    expected.scatter_add_(-1, index.unsqueeze(-1), torch.ones(B, T, 1))
    torch.testing.assert_close(logits.grad.float(), expected, **tolerance)


def _splitmix64_reference(x: int) -> int:
    """SplitMix64's output function in plain Python integers (the published constants)."""
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_splitmix64_on_int64_tensors_matches_the_reference():
    values = [0, 1, 2, 12345, (1 << 63) - 1, -1, -(1 << 63)]
    got = ops.splitmix64(torch.tensor(values, dtype=torch.long)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_splitmix64_reference(v & ((1 << 64) - 1)) for v in values]


def test_sample_categorical_draws_the_softmax_and_never_a_token_of_probability_zero():
    scores = torch.tensor([2.0, 1.0, float("-inf"), 0.0, -1.0, -3.0, float("-inf")])  # -inf: masked by a warper
    n = 40_000
    torch.manual_seed(0)
    draws = ops.sample_categorical(scores.expand(n, -1), torch.rand(n, dtype=torch.float64))
    frequencies = torch.bincount(draws, minlength=7).float() / n
    torch.testing.assert_close(frequencies, scores.softmax(-1), atol=0.01, rtol=0)
    # the extreme uniforms land on the first and the last token that can be drawn, never on a masked one
    edges = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    assert ops.sample_categorical(scores.expand(2, -1), edges).tolist() == [0, 5]
    tail_masked = torch.tensor([[0.0, 1.0, float("-inf")]])
    assert ops.sample_categorical(tail_masked, torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)).tolist() == [1]
    nan_row = torch.tensor([[0.0, float("nan"), 1.0]])  # a diverged model: a valid index, the NaN goes on to the loss
    assert 0 <= ops.sample_categorical(nan_row, torch.tensor([0.5], dtype=torch.float64)).item() < 3
    # a token of tiny probability keeps its mass in the fp64 running sum
    tiny = torch.tensor([[0.0, -20.0]])  # p(1) ~ 2e-9: drawn for uniforms past 1 - p(1)
    p1 = tiny.softmax(-1)[0, 1].double()
    assert ops.sample_categorical(tiny.expand(2, -1), torch.tensor([1 - 2 * p1, 1 - p1 / 2])).tolist() == [0, 1]


def test_keyed_uniforms_sample_the_softmax_and_depend_only_on_the_key():
    scores = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    keys = ops.episode_keys(0, 3, torch.arange(20_000), torch.zeros(20_000, dtype=torch.long))
    uniform = ops.keyed_uniform(keys, step=5)
    assert uniform.dtype == torch.float64 and ((uniform >= 0) & (uniform < 1)).all()
    draws = ops.sample_categorical(scores.expand(len(keys), -1), uniform)
    frequencies = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(frequencies, scores.softmax(-1), atol=0.01, rtol=0)
    # a row's uniform is the same in any batch, and differs by step, prompt, sample and update
    some = keys[[7, 3, 11]]
    assert torch.equal(ops.keyed_uniform(some, 5), uniform[[7, 3, 11]])
    assert not torch.equal(ops.keyed_uniform(some, 5), ops.keyed_uniform(some, 6))
    one = lambda update, prompt, sample: ops.episode_keys(0, update, torch.tensor([prompt]), torch.tensor([sample]))  # noqa: E731
    assert len({one(0, 0, 0).item(), one(0, 0, 1).item(), one(0, 1, 0).item(), one(1, 0, 0).item()}) == 4


@pytest.mark.parametrize("widths", [[5], [1, 4]])
def test_fused_token_logprobs_and_entropy_match_the_reference_and_its_gradient(widths):
    """GRPO's fused pass (ops.token_logprobs_and_entropy) over the logit pieces against selective_log_softmax and
    entropy_from_logits of the joined, temperature-scaled logits: values and gradients to rounding in fp32, and
    torch's numerical gradient check in fp64."""
    g = torch.Generator().manual_seed(0)
    B, V, temperature = 3, 11, 0.7
    pieces = [torch.randn(B, w, V, generator=g, dtype=torch.float64, requires_grad=True) for w in widths]
    index = torch.randint(0, V, (B, sum(widths)), generator=g)
    weights = torch.randn(B, sum(widths), generator=g, dtype=torch.float64)
    logprobs, entropy = ops.token_logprobs_and_entropy(pieces, index, temperature)
    (logprobs * weights).sum().backward()
    fused_grads = [p.grad.clone() for p in pieces]
    joined = torch.cat([p.detach() for p in pieces], dim=1).requires_grad_()
    reference = ops.selective_log_softmax(joined / temperature, index)
    (reference * weights).sum().backward()
    torch.testing.assert_close(logprobs, reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ops.entropy_from_logits(joined.detach() / temperature), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(fused_grads, dim=1), joined.grad, rtol=1e-12, atol=1e-12)
    inputs = [p.detach().requires_grad_() for p in pieces]
    assert torch.autograd.gradcheck(lambda *xs: ops.token_logprobs_and_entropy(list(xs), index, temperature)[0],
                                    inputs)
    assert ops.token_logprobs_and_entropy(pieces, index, temperature, with_entropy=False)[1] is None
