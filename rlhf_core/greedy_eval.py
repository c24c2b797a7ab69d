"""Evaluation: greedy completions of a trained policy and its reference, scored side by side.

Greedy decoding removes sampling noise from the comparison. Each prompt yields one completion per
policy; both are scored by the reward model (the proxy) and, when the world knows it, by the gold
reward (the truth), so over-optimization of the proxy shows up as a gap between the two win rates.
The KL column is the exact per-token KL(policy || reference) over the vocabulary, summed along the
policy's own greedy completion, at the training temperature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhf_core import ops
from rlhf_core.batching import pad, token_ids
from rlhf_core.decode import TokenChoice, decode
from rlhf_core.rollout import Rollout, response_logits, stop_mask
from rlhf_core.scoring import GoldFn, Scorer


@torch.no_grad()
def greedy_rollout(policy: nn.Module, prompt_ids: Sequence[Sequence[int]], *, response_length: int,
                   pad_token_id: int, stop_token_id: int | None, batch_size: int = 64,
                   on_batch: Callable[[int], None] | None = None) -> Rollout:
    """Greedy completions as a Rollout (log-prob fields are zeros: evaluation needs none); `on_batch(n)`
    after each batch of n prompts (a progress bar)."""
    policy.eval()
    device = next(policy.parameters()).device
    parts = []
    for start in range(0, len(prompt_ids), batch_size):
        queries, query_mask = (t.to(device) for t in pad(prompt_ids[start:start + batch_size], pad_token_id, "left"))
        responses, _ = decode(policy, queries, query_mask, response_length=response_length, pad_token_id=pad_token_id,
                              stop_token_id=stop_token_id, choice=TokenChoice(greedy=True))  # (b, R)
        if stop_token_id is not None:
            responses = ops.truncate_after_stop(responses, stop_token_id, pad_token_id)
        response_mask, contains_stop = stop_mask(responses, stop_token_id)
        zeros = torch.zeros(responses.shape, device=device)
        parts.append(Rollout(queries=queries.cpu(), query_mask=query_mask.cpu(), responses=responses.cpu(),
                             response_mask=response_mask.cpu(), logprobs=zeros.cpu(), ref_logprobs=zeros.cpu(),
                             contains_stop=contains_stop.cpu()))
        if on_batch is not None:
            on_batch(len(responses))
    return _pad_and_cat(parts, pad_token_id)


def decode_responses(tokenizer, batch: Rollout) -> list[str]:
    """The completions' text, stop token and padding removed."""
    return tokenizer.batch_decode([r[m].tolist() for r, m in zip(batch.responses, batch.response_mask, strict=True)],
                                  skip_special_tokens=True)


def _pad_and_cat(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Concatenate rollouts whose prompt widths differ by left-padding the narrower ones."""
    width = max(p.context_length for p in parts)
    widened = []
    for p in parts:
        extra = (width - p.context_length, 0)  # columns added on the left
        widened.append(replace(p, queries=F.pad(p.queries, extra, value=pad_token_id),
                               query_mask=F.pad(p.query_mask, extra, value=False)))
    return Rollout.cat(widened)


@torch.no_grad()
def sequence_kl(policy: nn.Module, reference: nn.Module, batch: Rollout, temperature: float,
                batch_size: int = 64) -> Tensor:
    """Exact sum over response tokens of KL(policy || reference) at `temperature`: (N,)."""
    device = next(policy.parameters()).device
    out = []
    for start in range(0, len(batch), batch_size):
        chunk = batch[start:start + batch_size].to(device)
        logp = response_logits(policy, chunk, temperature).log_softmax(-1)  # (b, R, V)
        logq = response_logits(reference, chunk, temperature).log_softmax(-1)
        kl = (logp.exp() * (logp - logq)).sum(-1)  # (b, R)
        out.append((kl * chunk.response_mask).sum(1).cpu())
    return torch.cat(out)


def _win_rate(a: Tensor, b: Tensor) -> float:
    """P(a > b) with ties counted as half a win."""
    return ((a > b).float() + 0.5 * (a == b).float()).mean().item()


SCORE_COLUMNS = ("score_rm", "ref_score_rm", "kl", "score_gold", "ref_score_gold")  # a row's per-prompt figures


@dataclass(frozen=True)
class EvalReport:
    summary: dict[str, float]
    """Headline figures for the policy, with `ref_*` figures for the reference beside them."""
    rows: list[dict]
    """One record per prompt: both completions and their scores."""

    def per_prompt_scores(self) -> dict[str, list[float]]:
        """The per-prompt scores as columns, in prompt order (6 decimals): `score_rm`, `ref_score_rm`, `kl` and,
        with a gold reward, `score_gold`, `ref_score_gold`. Policy and reference share a row, so a bootstrap over
        prompts can pair them."""
        keys = [k for k in SCORE_COLUMNS if self.rows and k in self.rows[0]]
        return {k: [round(row[k], 6) for row in self.rows] for k in keys}


def evaluate(policy: nn.Module, reference: nn.Module, tokenizer, prompts: Sequence[str], *, scorer: Scorer,
             response_length: int, temperature: float, gold: GoldFn | None = None,
             batch_size: int = 64, on_batch: Callable[[int], None] | None = None) -> EvalReport:
    """Greedy completions of `policy` and `reference` on `prompts`, scored by `scorer` (and `gold`);
    `on_batch(n)` after each generation batch (2 * len(prompts) in all)."""
    pad, stop = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_ids = token_ids(tokenizer, prompts)
    kwargs = dict(response_length=response_length, pad_token_id=pad, stop_token_id=stop, batch_size=batch_size,
                  on_batch=on_batch)
    policy_batch, ref_batch = greedy_rollout(policy, prompt_ids, **kwargs), greedy_rollout(reference, prompt_ids, **kwargs)
    texts = {"policy": decode_responses(tokenizer, policy_batch), "ref": decode_responses(tokenizer, ref_batch)}
    rm = {"policy": scorer(policy_batch).cpu(), "ref": scorer(ref_batch).cpu()}
    kl = sequence_kl(policy, reference, policy_batch, temperature, batch_size)
    summary = {"win_rate_rm": _win_rate(rm["policy"], rm["ref"]), "mean_kl": kl.mean().item()}
    gold_scores = {}
    if gold is not None:
        for name, batch in (("policy", policy_batch), ("ref", ref_batch)):
            gold_scores[name] = torch.tensor([gold(p, c, bool(e)) for p, c, e in
                                              zip(prompts, texts[name], batch.contains_stop, strict=True)])
        summary["win_rate_gold"] = _win_rate(gold_scores["policy"], gold_scores["ref"])
    for name, batch in (("policy", policy_batch), ("ref", ref_batch)):
        prefix = "" if name == "policy" else "ref_"
        summary[f"{prefix}mean_score_rm"] = rm[name].mean().item()
        if gold is not None:
            summary[f"{prefix}mean_score_gold"] = gold_scores[name].mean().item()
        summary[f"{prefix}eos_rate"] = batch.contains_stop.float().mean().item()
        summary[f"{prefix}mean_length"] = batch.response_lengths.float().mean().item()
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": prompt, "completion": texts["policy"][i], "ref_completion": texts["ref"][i],
               "score_rm": rm["policy"][i].item(), "ref_score_rm": rm["ref"][i].item(), "kl": kl[i].item(),
               "eos": bool(policy_batch.contains_stop[i]), "ref_eos": bool(ref_batch.contains_stop[i])}
        if gold is not None:
            row.update(score_gold=gold_scores["policy"][i].item(), ref_score_gold=gold_scores["ref"][i].item())
        rows.append(row)
    return EvalReport(summary=summary, rows=rows)
