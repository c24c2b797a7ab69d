"""Scorers: how a completion gets its scalar reward.

A scorer maps a rollout to a (B,) float tensor. Three kinds compose:
- `RewardModelScorer`: an `AutoModelForSequenceClassification` (num_labels=1) scoring the LAST REAL
  TOKEN of prompt + truncated response (the stop token when there is one), as TRL and the
  summarize-from-feedback reward models do.
- `FunctionScorer`: any `(prompts, completions) -> floats` over decoded text (a rule, a gold reward).
- `WeightedScorer`: a weighted sum of scorers.
The missing-EOS penalty is the trainer's (it is configuration, not a property of the scorer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from rlhf_core.reward_functions import RewardFn
from rlhf_core.rollout import Rollout, backbone_hidden, prompt_groups, score_head, shared_prompt_forward

GoldFn = Callable[[str, str, bool], float]
"""(prompt, completion, ended_with_eos) -> a known true reward (the demo world's `gold_reward`); evaluations
report it beside the reward model's score, so reward hacking shows."""


class Scorer(Protocol):
    def __call__(self, batch: Rollout) -> Tensor:  # (B,) float32
        ...


def completion_scores(model: nn.Module, parts: tuple[Tensor, Tensor, Tensor, Tensor], last: Tensor, *,
                      share_prompts: bool = True) -> Tensor:
    """A sequence classifier's score of each completion, read at `last` (B,): the index, within the completion,
    of its last real token (the stop token when there is one). (B,)

    parts: prompts (B, P) left-padded, their mask, completions (B, R) right-padded, their mask. Rows with the same
    prompt (RLOO's k samples, a preference pair's two completions) run it once (`shared_prompt_forward`) unless
    `share_prompts` is False: under gradient checkpointing, which keeps no KV cache.
    """
    queries, query_mask, completions, completion_mask = parts
    groups = prompt_groups(model, queries, query_mask) if share_prompts and queries.shape[1] else None
    if groups is None:
        mask = torch.cat([query_mask, completion_mask], dim=1)
        hidden = backbone_hidden(model, torch.cat([queries, completions], dim=1), mask,
                                 reads=completions.shape[1])[:, queries.shape[1]:]
    else:
        backbone = getattr(model, model.base_model_prefix)
        _, rest = shared_prompt_forward(backbone, parts, groups, response_tokens=completions.shape[1], prompt_reads=0)
        hidden = rest.last_hidden_state  # (B, R, H)
    picked = hidden[torch.arange(len(hidden), device=hidden.device), last]  # (B, H)
    return score_head(model)(picked).squeeze(-1).float()  # (B,)


class CompletionScores(nn.Module):
    """`completion_scores` as one module: what a trainer prepares (DDP, DeepSpeed) so that the backbone and the
    score head run inside its forward, where gradients are synchronized."""

    def __init__(self, model: nn.Module, share_prompts: bool = True):
        super().__init__()
        self.model, self.share_prompts = model, share_prompts

    def forward(self, queries: Tensor, query_mask: Tensor, completions: Tensor, completion_mask: Tensor,
                last: Tensor) -> Tensor:
        parts = (queries, query_mask, completions, completion_mask)
        return completion_scores(self.model, parts, last, share_prompts=self.share_prompts)  # (B,)


class RewardModelScorer:
    """Scores with a sequence-classification reward model, in chunks of `batch_size` rows."""

    def __init__(self, model: nn.Module, batch_size: int = 64):
        num_labels = getattr(model.config, "num_labels", None)
        if num_labels != 1:
            raise ValueError(f"reward model must have num_labels=1, got {num_labels}")
        self.model = model.eval().requires_grad_(False)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, batch: Rollout) -> Tensor:
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(batch), self.batch_size):
            chunk = batch[start:start + self.batch_size].to(device)
            parts = (chunk.queries, chunk.query_mask, chunk.responses, chunk.response_mask)
            out.append(completion_scores(self.model, parts, chunk.response_lengths - 1))
        return torch.cat(out).to(batch.queries.device)


def decode_texts(tokenizer, batch: Rollout, written_only: bool = False) -> tuple[list[str], list[str]]:
    """The prompts and completions of a rollout as text (padding and special tokens dropped); `written_only`: the
    completions as the policy wrote them, tool results left out (multi-turn rollouts: `Rollout.tool_mask`)."""
    prompts = tokenizer.batch_decode(
        [q[m].tolist() for q, m in zip(batch.queries, batch.query_mask, strict=True)], skip_special_tokens=True)
    kept = batch.response_mask & batch.tool_mask if written_only and batch.tool_mask is not None \
        else batch.response_mask
    completions = tokenizer.batch_decode(
        [r[m].tolist() for r, m in zip(batch.responses, kept, strict=True)], skip_special_tokens=True)
    return prompts, completions


class FunctionScorer:
    """Scores decoded text with a plain Python function (prompts, completions) -> floats."""

    def __init__(self, fn: RewardFn, tokenizer):
        self.fn = fn
        self.tokenizer = tokenizer

    def __call__(self, batch: Rollout) -> Tensor:
        prompts, completions = decode_texts(self.tokenizer, batch)
        scores = list(self.fn(prompts, completions))
        if len(scores) != len(batch):
            raise ValueError(f"reward function returned {len(scores)} scores for {len(batch)} completions")
        return torch.tensor(scores, dtype=torch.float32, device=batch.queries.device)


class GoldScorer:
    """A world's gold reward of each completion: a monitor the trainer logs (monitor/<name>), never a reward,
    so reward hacking shows during training as the proxy score rises while the gold one falls. It reads what the
    policy wrote: a tool's result is not the policy's summary (the reward model and reward functions read it all)."""

    def __init__(self, gold: GoldFn, tokenizer):
        self.gold = gold
        self.tokenizer = tokenizer

    def __call__(self, batch: Rollout) -> Tensor:
        prompts, completions = decode_texts(self.tokenizer, batch, written_only=True)
        stopped = batch.contains_stop.tolist()
        return torch.tensor([self.gold(p, c, e) for p, c, e in zip(prompts, completions, stopped, strict=True)],
                            dtype=torch.float32, device=batch.queries.device)


class WeightedScorer:
    """sum_i w_i * scorer_i(batch), each term named (TRL's reward_funcs + reward_weights): the trainer logs
    every source's own scores as `rewards/<name>/mean` and `rewards/<name>/std`."""

    def __init__(self, terms: Sequence[tuple[float, Scorer]], names: Sequence[str] | None = None):
        if not terms:
            raise ValueError("WeightedScorer needs at least one (weight, scorer) term")
        self.terms = list(terms)
        self.names = list(names) if names is not None else [f"source_{i}" for i in range(len(self.terms))]
        if len(self.names) != len(self.terms) or len(set(self.names)) != len(self.names):
            raise ValueError(f"WeightedScorer: {len(self.terms)} terms need as many distinct names, got {self.names}")

    def by_source(self, batch: Rollout) -> dict[str, Tensor]:
        """Each source's unweighted scores (B,), by name."""
        return {name: scorer(batch) for name, (_, scorer) in zip(self.names, self.terms, strict=True)}

    def combine(self, scores: dict[str, Tensor]) -> Tensor:
        """The weighted sum of `by_source`'s scores (B,)."""
        return sum(w * scores[name] for name, (w, _) in zip(self.names, self.terms, strict=True))

    def __call__(self, batch: Rollout) -> Tensor:
        return self.combine(self.by_source(batch))


def scores_by_source(scorer: Scorer, batch: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
    """`scorer`'s (B,) float32 scores of `batch`, and a `WeightedScorer`'s unweighted (B,) scores by source name
    (empty for any other scorer), which the trainer logs as rewards/<name>/mean and /std."""
    if not isinstance(scorer, WeightedScorer):
        return scorer(batch).to(batch.queries.device).float(), {}
    by_source = scorer.by_source(batch)
    return scorer.combine(by_source).to(batch.queries.device).float(), by_source
