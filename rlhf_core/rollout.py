"""Rollouts: sampling completions from left-padded prompts, and the one container a batch travels in.

Layout of every sequence (prompt left-padded to P, response right-padded to R):

    [pad pad q q q q | r r r EOS pad pad]      query_mask ++ response_mask
     <----- P -----> | <------ R ------>

Position ids come from the attention mask (`cumsum - 1`), so left padding shifts nothing: the
policy sees the same positions at sampling time, when log-probs are recomputed, and in training.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlhf_core import ops
from rlhf_core.kv_cache import CACHE


@dataclass(frozen=True)
class Rollout:
    """One batch of episodes, filled phase by phase (rollout → score → advantages).

    Shapes: B episodes, P prompt tokens (left-padded), R response tokens (right-padded).
    """

    queries: Tensor  # (B, P) prompt ids, left-padded
    query_mask: Tensor  # (B, P) bool, True on real prompt tokens
    responses: Tensor  # (B, R) ids truncated after the stop token, pad after
    response_mask: Tensor  # (B, R) bool, True on response tokens up to and including the stop token
    logprobs: Tensor  # (B, R) policy log-probs at sampling time (temperature-scaled), 0 on padding
    ref_logprobs: Tensor | None  # (B, R) reference-policy log-probs, 0 on padding; None: no reference (GRPO, beta 0)
    contains_stop: Tensor  # (B,) bool, the completion emitted the stop token
    values: Tensor | None = None  # (B, R) value estimates at sampling time (PPO), 0 on padding
    scores: Tensor | None = None  # (B,) reward of each completion, penalties included
    rewards: Tensor | None = None  # (B, R) per-token rewards (PPO, token-level RLOO)
    advantages: Tensor | None = None  # (B, R) or (B, 1) for sequence-level RLOO
    returns: Tensor | None = None  # (B, R) value targets (PPO)
    in_loss: Tensor | None = None  # (B,) bool, episodes the loss trains on (mask_truncated_completions); None: all
    # (B, R) bool, multi-turn rollouts (rlhf_core/multi_turn.py): False on tool-result tokens, which the policy attends
    # to but never wrote, so no loss and no KL (their log-probs and reference log-probs are 0); None: no tools
    tool_mask: Tensor | None = None
    env_rewards: Tensor | None = None  # (B,) each episode's environment's get_reward(); None: no such reward
    tool_calls: Tensor | None = None  # (B,) tool calls each episode made (failed or not); None: no tools
    tool_failures: Tensor | None = None  # (B,) of them, those that failed (unknown tool, exception, timeout)

    @property
    def context_length(self) -> int:
        return self.queries.shape[1]

    @property
    def response_lengths(self) -> Tensor:  # (B,)
        return self.response_mask.sum(1)

    @property
    def loss_mask(self) -> Tensor:  # (B, R) bool, the response tokens the loss averages over
        mask = self.response_mask if self.tool_mask is None else self.response_mask & self.tool_mask  # TRL's
        return mask if self.in_loss is None else mask & self.in_loss[:, None]

    @property
    def input_ids(self) -> Tensor:  # (B, P + R)
        return torch.cat([self.queries, self.responses], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # (B, P + R)
        return torch.cat([self.query_mask, self.response_mask], dim=1)

    def __len__(self) -> int:
        return self.queries.shape[0]

    def __getitem__(self, index: Tensor | slice) -> Rollout:
        """The episodes at `index` (a micro-batch)."""
        return replace(self, **{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    @classmethod
    def cat(cls, parts: Sequence[Rollout]) -> Rollout:
        """Concatenate rollouts of equal P and R along the episode dimension."""
        out = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            out[f.name] = None if values[0] is None else torch.cat(values, dim=0)
        return cls(**out)

    def to(self, device: torch.device | str) -> Rollout:
        return replace(self, **{f.name: _to(getattr(self, f.name), device) for f in fields(self)})


def _take(t: Tensor | None, index: Tensor | slice) -> Tensor | None:
    return None if t is None else t[index]


def _to(t: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if t is None else t.to(device)


def position_ids(attention_mask: Tensor) -> Tensor:
    """(B, T) mask → (B, T) positions counting only real tokens (0 on left padding)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def response_logits(model: nn.Module, batch: Rollout | tuple[Tensor, Tensor, Tensor, Tensor],
                    temperature: float, *, share_prompts: bool = False) -> Tensor:
    """Temperature-scaled logits that predicted each response token: (B, R, V).

    The logits at position t predict token t+1, hence the slice [P-1, P+R-1). With `share_prompts`, rows with
    the same prompt (RLOO's k samples) go through it once (`shared_prompt_forward`, differentiable): equal to
    rounding, so the rollout's log-probs and the training forward must both share or both not.
    """
    pieces = response_logit_pieces(model, batch, share_prompts=share_prompts)
    logits = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)  # (B, R, V)
    return logits.float() / temperature


def response_logit_pieces(model: nn.Module, batch: Rollout | tuple[Tensor, Tensor, Tensor, Tensor], *,
                          share_prompts: bool = False) -> list[Tensor]:
    """`response_logits` before it joins and scales them: the model's raw logits for the R response tokens in pieces
    along R, [(B, 1, V) at the last prompt position, (B, R - 1, V)] on the shared-prompt path, [(B, R, V)] otherwise
    (`ops.token_logprobs_and_entropy` reads them so, with no (B, R, V) concatenation or scaled copy)."""
    queries, query_mask, responses, response_mask = _parts(batch)
    R = responses.shape[1]
    groups = prompt_groups(model, queries, query_mask) if share_prompts else None
    if groups is not None:
        prompts, rest = shared_prompt_forward(model, (queries, query_mask, responses, response_mask), groups,
                                              response_tokens=R - 1, prompt_reads=1,
                                              prompt_kwargs={"logits_to_keep": 1})
        first_logits = prompts.logits[groups[1]]  # (B, 1, V): the last prompt position, read by every sample
        return [first_logits] if rest is None else [first_logits, rest.logits]
    input_ids = torch.cat([queries, responses], dim=1)  # (B, P+R)
    mask = torch.cat([query_mask, response_mask], dim=1)
    P = queries.shape[1]
    # the LM head on the R positions that predict a response token only, [P-1, P+R-1): not the prompt's (a (B, P, V)
    # matmul for nothing), nor the last one, whose (B, 1, V) slice off would cost the backward a zeroed (B, R+1, V)
    read = torch.arange(P - 1, P + R - 1, device=input_ids.device)  # (R,)
    with reading_last(model, R + 1):
        return [model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids(mask),
                      logits_to_keep=read).logits]  # (B, R, V)


def distinct_prompts(queries: Tensor, query_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """Rows that share their prompt (RLOO's k samples of one prompt): (one row of each distinct prompt (n,),
    the distinct prompt of each row (B,)), or None when no two rows share one."""
    rows = torch.cat([queries, query_mask.long()], dim=1)  # the mask too: a pad id can be a real token
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if len(unique) == len(rows):
        return None
    index = torch.arange(len(rows), device=rows.device)
    first = torch.full((len(unique),), len(rows), device=rows.device).scatter_reduce(0, inverse, index, "amin")
    return first, inverse


def prompt_groups(model: nn.Module, queries: Tensor, query_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """`distinct_prompts`, deciding between the shared-prompt path (two forwards: prompts, then responses) and the
    plain one (one forward). A model sharded by DeepSpeed ZeRO-3 gathers its weights layer by layer in every forward,
    a collective, so every rank must run as many forwards as the others: there the ranks agree (one all-reduce of a
    flag per call), and a rank whose rows share no prompt takes the shared path too, each row its own group."""
    groups = distinct_prompts(queries, query_mask)
    if not _sharded(model):
        return groups
    import torch.distributed as dist

    share = torch.tensor([groups is not None], dtype=torch.int32, device=queries.device)
    dist.all_reduce(share, op=dist.ReduceOp.MAX)
    if share.item() and groups is None:
        rows = torch.arange(len(queries), device=queries.device)
        groups = rows, rows
    return groups


def _sharded(model: nn.Module) -> bool:
    """Whether `model`'s forward gathers weights from other ranks: ZeRO-3 has partitioned it (its parameters carry
    `ds_id`) and they are not whole now (inside `runtime.whole_weights` they are, and one rank may run alone)."""
    import torch.distributed as dist

    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return any(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters()) \
        and dist.is_initialized() and dist.get_world_size() > 1


def shared_prompt_forward(model: nn.Module, parts: tuple[Tensor, Tensor, Tensor, Tensor], groups: tuple[Tensor, Tensor],
                          *, response_tokens: int, prompt_reads: int, prompt_kwargs: dict | None = None):
    """`model` (a causal LM or a backbone) over [prompt | first `response_tokens` response tokens] with each
    distinct prompt computed once: the prompts' forward fills a KV cache (n rows), copied to the B rows that
    share it, and the responses run on it. Returns (the prompts' output, the responses' output or None).
    The caller reads the prompts' output at their last `prompt_reads` positions only (`reading_last`).

    For k samples per prompt of P prompt and R response tokens, n·P + B·R tokens instead of B·(P + R): on
    bench-tiny's RLOO (P 48, R 24, k 2) a third fewer; on TL;DR (P ~500, R 53, k 4) ~3x fewer.
    """
    queries, query_mask, responses, response_mask = parts
    prompts, cache = prefill_shared_prompts(model, queries, query_mask, groups, reads=prompt_reads,
                                            **(prompt_kwargs or {}))
    if response_tokens == 0:
        return prompts, None
    mask = torch.cat([query_mask, response_mask[:, :response_tokens]], dim=1)  # (B, P + r)
    rest = model(input_ids=responses[:, :response_tokens], attention_mask=mask,
                 position_ids=position_ids(mask)[:, queries.shape[1]:], use_cache=True, **{CACHE: cache})
    return prompts, rest


def prefill_shared_prompts(model: nn.Module, queries: Tensor, query_mask: Tensor, groups: tuple[Tensor, Tensor],
                           *, reads: int, **kwargs):
    """The forward of each distinct prompt once (n rows) and its KV cache copied to the B rows that share it:
    (the prompts' output, read at its last `reads` positions only; the (B, ...) cache)."""
    prompts = prefill_distinct_prompts(model, queries, query_mask, groups[0], reads=reads, **kwargs)
    cache = getattr(prompts, CACHE)
    cache.reorder_cache(groups[1])  # (n, ...) -> (B, ...)
    return prompts, cache


def prefill_distinct_prompts(model: nn.Module, queries: Tensor, query_mask: Tensor, first: Tensor, *, reads: int,
                             **kwargs):
    """The forward of the distinct prompts `first` (n rows), read at their last `reads` positions only."""
    mask = query_mask[first]
    with reading_last(model, reads):
        return model(input_ids=queries[first], attention_mask=mask, position_ids=position_ids(mask), use_cache=True,
                     **kwargs)


# Decoders whose layers end in a position-wise `mlp` (dense, one output tensor): `reading_last` may cut their last
# layer's. tests/test_rollout_scoring.py checks each against the model's own forward.
POSITIONWISE_MLP_MODELS = frozenset({"gemma", "gemma2", "gpt2", "gpt_neox", "llama", "mistral", "olmo2", "phi3",
                                     "qwen2", "qwen3"})


@contextmanager
def reading_last(model: nn.Module, positions: int | None) -> Iterator[None]:
    """Inside the block, forwards of `model` are read at their last `positions` positions only (None: at all).

    `logits_to_keep` keeps the LM head off the positions nobody reads; the same holds one layer down. The last
    decoder layer's MLP is position-wise and its output reaches nothing but the head, so it runs on the read
    positions only and the others get zeros: the hidden states there are garbage, every read one is unchanged,
    and the KV cache, computed from the layer's input, is whole. On bench-tiny's PPO update (4 layers, 48 of 72
    positions a prompt's) that is 11 % fewer matmul FLOPs. Off for architectures not in POSITIONWISE_MLP_MODELS
    and under gradient checkpointing, whose backward recomputes the layer outside the block.
    """
    mlp = None if positions is None else last_layer_mlp(model)
    if mlp is None:
        yield
        return
    lengths: list[int] = []

    def keep_read(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (B, T, H)
        lengths.append(hidden.shape[1])
        return (hidden[:, max(hidden.shape[1] - positions, 0):].contiguous(), *args[1:])  # GPT-2 views it

    def pad_unread(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        return F.pad(output, (0, 0, lengths.pop() - output.shape[1], 0))  # zeros in front: (B, T, H)

    # first among the MLP's pre-hooks: any other (ZeRO-3's, a profiler's) sees what it runs on
    handles = [mlp.register_forward_pre_hook(keep_read, prepend=True), mlp.register_forward_hook(pad_unread)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def last_layer_mlp(model: nn.Module) -> nn.Module | None:
    """The last decoder layer's MLP where `reading_last` may cut it, else None."""
    if getattr(getattr(model, "config", None), "model_type", None) not in POSITIONWISE_MLP_MODELS:
        return None
    if gradient_checkpointing(model):
        return None
    mlps = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]
    return mlps[-1] if mlps else None


def gradient_checkpointing(model: nn.Module) -> bool:
    """Whether any part of `model` recomputes activations in the backward: it then keeps no KV cache, so rows
    cannot share a prompt's forward (the prompt's cache would be dropped)."""
    return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def _parts(batch: Rollout | tuple[Tensor, Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if isinstance(batch, Rollout):
        return batch.queries, batch.query_mask, batch.responses, batch.response_mask
    return batch


def backbone_hidden(model: nn.Module, input_ids: Tensor, mask: Tensor, *, reads: int | None = None) -> Tensor:
    """Last hidden states of a `*ForSequenceClassification` model's backbone: (B, T, H); with `reads`, valid at the
    last `reads` positions only (`reading_last`), which are all the caller may read.

    Going through the backbone (not the model's own forward, which picks the "last non-pad token"
    by searching for pad ids) lets us choose the scored token ourselves, so pad == EOS tokenizers
    and left padding are handled (see TRL's `get_reward`).
    """
    backbone = getattr(model, model.base_model_prefix)
    with reading_last(model, reads):
        return backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state


def score_head(model: nn.Module) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise TypeError(f"{type(model).__name__} has no `score` or `classifier` head; expected an "
                    "AutoModelForSequenceClassification with num_labels=1")


def token_values(value_model: nn.Module, batch: Rollout | tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """Value of the state before each response token: (B, R) (TRL: `vpred[:, P-1:-1]`)."""
    queries, query_mask, responses, response_mask = _parts(batch)
    input_ids = torch.cat([queries, responses], dim=1)
    mask = torch.cat([query_mask, response_mask], dim=1)
    R = responses.shape[1]
    hidden = backbone_hidden(value_model, input_ids, mask, reads=R + 1)  # (B, P+R, H), valid from P-1
    P = queries.shape[1]
    return score_head(value_model)(hidden[:, P - 1:-1]).squeeze(-1).float()  # (B, R)


def stop_mask(responses: Tensor, stop_token_id: int | None) -> tuple[Tensor, Tensor]:
    """(B, R) ids → (response_mask, contains_stop): tokens through the first stop token are real."""
    B, R = responses.shape
    if stop_token_id is None:
        return torch.ones_like(responses, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    is_stop = responses == stop_token_id
    first_stop = ops.first_true_indices(is_stop)  # (B,), R when none
    lengths = (first_stop + 1).clamp(max=R)
    mask = torch.arange(R, device=responses.device)[None, :] < lengths[:, None]
    return mask, is_stop.any(1)


@dataclass(frozen=True)
class PolicyOutput:
    """What the training forward of a micro-batch produces (with grad)."""

    logprobs: Tensor  # (B, R) log-probs of the sampled tokens under the current policy
    entropy: Tensor | None  # (B, R) entropy of the current policy at each response position; None: not measured
    values: Tensor | None = None  # (B, R) current value estimates (PPO)
