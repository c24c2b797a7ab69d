"""Evaluation: greedy completions of a trained policy and its reference, scored side by side.

Greedy decoding removes sampling noise from the comparison. Each prompt yields one completion per
policy; both are scored by the reward model (the proxy) and, when the world knows it, by the gold
reward (the truth), so over-optimization of the proxy shows up as a gap between the two win rates.
The KL column is the exact per-token KL(policy || reference) over the vocabulary, summed along the
policy's own greedy completion, at the training temperature.

With tools (a `ToolRollouts`), each completion is a greedy multi-turn rollout (rlhf_core/multi_turn.py: the calls the
model writes run, their results appended as tokens), scored as training scores it: the reward model reads the whole
completion, tool results included; the gold reward what the policy wrote, tool results left out. The KL and the length
count the policy's own tokens only, and the report adds the tool-call rate (calls per completion, TRL's
tools/call_frequency) and the failure rate (failed calls per call, tools/failure_frequency).
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
from rlhf_core.multi_turn import ToolRollouts, completion_tensors
from rlhf_core.rollout import Rollout, response_logits, stop_mask
from rlhf_core.scoring import GoldFn, Scorer, decode_texts


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


@torch.no_grad()
def greedy_tool_rollout(policy: nn.Module, tools: ToolRollouts, prompt_indices: Sequence[int], *, pad_token_id: int,
                        stop_token_id: int, batch_size: int = 64,
                        on_batch: Callable[[int], None] | None = None) -> Rollout:
    """Greedy multi-turn completions of the tools' rows at `prompt_indices` (each rendered with its tools, its
    environment reset), as a Rollout with tool_mask, tool_calls and tool_failures (log-prob fields zeros)."""
    policy.eval()
    device = next(policy.parameters()).device
    parts = []
    for start in range(0, len(prompt_indices), batch_size):
        prompt_ids, episodes = tools.start(prompt_indices[start:start + batch_size], 1)
        queries, query_mask = (t.to(device) for t in pad(prompt_ids, pad_token_id, "left"))
        greedy = tools.chooser(TokenChoice(greedy=True), None, False)  # a test replays forced turns through it
        turns = tools.decode(policy, queries, query_mask, episodes, greedy, stop_token_id)
        done = completion_tensors(turns, tools.cfg.response_length, pad_token_id=pad_token_id,
                                  stop_token_id=stop_token_id, keep_logprobs=False, device="cpu")
        zeros = torch.zeros(done.responses.shape)
        parts.append(Rollout(queries=queries.cpu(), query_mask=query_mask.cpu(), responses=done.responses,
                             response_mask=done.response_mask, logprobs=zeros, ref_logprobs=zeros,
                             contains_stop=done.contains_stop, tool_mask=done.tool_mask,
                             tool_calls=torch.tensor(turns.calls), tool_failures=torch.tensor(turns.failures)))
        if on_batch is not None:
            on_batch(len(prompt_ids))
    return _pad_and_cat(parts, pad_token_id)


def decode_responses(tokenizer, batch: Rollout) -> list[str]:
    """The completions' text, stop token and padding removed."""
    return decode_texts(tokenizer, batch)[1]


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
        out.append((kl * chunk.loss_mask).sum(1).cpu())  # the policy's own tokens: tool results are not its
    return torch.cat(out)


def _win_rate(a: Tensor, b: Tensor) -> float:
    """P(a > b) with ties counted as half a win."""
    return ((a > b).float() + 0.5 * (a == b).float()).mean().item()


def tool_rates(batch: Rollout) -> dict[str, float]:
    """TRL's tool figures of a rollout: calls per completion, and failed calls per call (0 without calls)."""
    calls = batch.tool_calls.float()
    return {"tool_call_rate": calls.mean().item(),
            "tool_failure_rate": (batch.tool_failures.sum() / calls.sum().clamp(min=1)).item()}


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
             batch_size: int = 64, on_batch: Callable[[int], None] | None = None,
             tools: ToolRollouts | None = None) -> EvalReport:
    """Greedy completions of `policy` and `reference` on `prompts`, scored by `scorer` (and `gold`);
    `on_batch(n)` after each generation batch (2 * len(prompts) in all). With `tools`, multi-turn completions of its
    rows (one per prompt; its cfg's response_length), the prompts as rendered with their tools."""
    pad, stop = tokenizer.pad_token_id, tokenizer.eos_token_id
    if tools is None:
        prompt_ids = token_ids(tokenizer, prompts)
        kwargs = dict(response_length=response_length, pad_token_id=pad, stop_token_id=stop, batch_size=batch_size,
                      on_batch=on_batch)
        policy_batch, ref_batch = (greedy_rollout(model, prompt_ids, **kwargs) for model in (policy, reference))
    else:
        kwargs = dict(pad_token_id=pad, stop_token_id=stop, batch_size=batch_size, on_batch=on_batch)
        policy_batch, ref_batch = (greedy_tool_rollout(model, tools, range(len(prompts)), **kwargs)
                                   for model in (policy, reference))
        prompts = [tokenizer.decode(q[m].tolist()) for q, m in zip(policy_batch.queries, policy_batch.query_mask,
                                                                  strict=True)]
    texts = {"policy": decode_responses(tokenizer, policy_batch), "ref": decode_responses(tokenizer, ref_batch)}
    rm = {"policy": scorer(policy_batch).cpu(), "ref": scorer(ref_batch).cpu()}
    kl = sequence_kl(policy, reference, policy_batch, temperature, batch_size)
    summary = {"win_rate_rm": _win_rate(rm["policy"], rm["ref"]), "mean_kl": kl.mean().item()}
    gold_scores = {}
    if gold is not None:
        for name, batch in (("policy", policy_batch), ("ref", ref_batch)):
            written = decode_texts(tokenizer, batch, written_only=True)[1]  # as the gold monitor reads it in training
            gold_scores[name] = torch.tensor([gold(p, c, bool(e)) for p, c, e in
                                              zip(prompts, written, batch.contains_stop, strict=True)])
        summary["win_rate_gold"] = _win_rate(gold_scores["policy"], gold_scores["ref"])
    for name, batch in (("policy", policy_batch), ("ref", ref_batch)):
        prefix = "" if name == "policy" else "ref_"
        summary[f"{prefix}mean_score_rm"] = rm[name].mean().item()
        if gold is not None:
            summary[f"{prefix}mean_score_gold"] = gold_scores[name].mean().item()
        summary[f"{prefix}eos_rate"] = batch.contains_stop.float().mean().item()
        summary[f"{prefix}mean_length"] = batch.loss_mask.sum(1).float().mean().item()  # the policy's own tokens
        if batch.tool_calls is not None:
            summary.update({f"{prefix}{key}": value for key, value in tool_rates(batch).items()})
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": prompt, "completion": texts["policy"][i], "ref_completion": texts["ref"][i],
               "score_rm": rm["policy"][i].item(), "ref_score_rm": rm["ref"][i].item(), "kl": kl[i].item(),
               "eos": bool(policy_batch.contains_stop[i]), "ref_eos": bool(ref_batch.contains_stop[i])}
        if gold is not None:
            row.update(score_gold=gold_scores["policy"][i].item(), ref_score_gold=gold_scores["ref"][i].item())
        if tools is not None:
            row.update(tool_calls=int(policy_batch.tool_calls[i]), tool_failures=int(policy_batch.tool_failures[i]),
                       ref_tool_calls=int(ref_batch.tool_calls[i]), ref_tool_failures=int(ref_batch.tool_failures[i]))
        rows.append(row)
    return EvalReport(summary=summary, rows=rows)
