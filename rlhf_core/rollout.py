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
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlhf_core import ops
from rlhf_core.kv_cache import CACHE, GrowingCache


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
    ref_logprobs: Tensor  # (B, R) reference-policy log-probs, 0 on padding
    contains_stop: Tensor  # (B,) bool, the completion emitted the stop token
    values: Tensor | None = None  # (B, R) value estimates at sampling time (PPO), 0 on padding
    scores: Tensor | None = None  # (B,) reward of each completion, penalties included
    rewards: Tensor | None = None  # (B, R) per-token rewards (PPO, token-level RLOO)
    advantages: Tensor | None = None  # (B, R) or (B, 1) for sequence-level RLOO
    returns: Tensor | None = None  # (B, R) value targets (PPO)
    in_loss: Tensor | None = None  # (B,) bool, episodes the loss trains on (mask_truncated_completions); None: all

    @property
    def context_length(self) -> int:
        return self.queries.shape[1]

    @property
    def response_lengths(self) -> Tensor:  # (B,)
        return self.response_mask.sum(1)

    @property
    def loss_mask(self) -> Tensor:  # (B, R) bool, the response tokens the loss averages over
        return self.response_mask if self.in_loss is None else self.response_mask & self.in_loss[:, None]

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
    queries, query_mask, responses, response_mask = _parts(batch)
    R = responses.shape[1]
    groups = prompt_groups(model, queries, query_mask) if share_prompts else None
    if groups is not None:
        prompts, rest = shared_prompt_forward(model, (queries, query_mask, responses, response_mask), groups,
                                              response_tokens=R - 1, prompt_reads=1,
                                              prompt_kwargs={"logits_to_keep": 1})
        first_logits = prompts.logits[groups[1]]  # (B, 1, V): the last prompt position, read by every sample
        logits = first_logits if rest is None else torch.cat([first_logits, rest.logits], dim=1)  # (B, R, V)
        return logits.float() / temperature
    input_ids = torch.cat([queries, responses], dim=1)  # (B, P+R)
    mask = torch.cat([query_mask, response_mask], dim=1)
    # the LM head on the R + 1 last positions only: the prompt's logits would be a (B, P, V) matmul for nothing
    with reading_last(model, R + 1):
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids(mask),
                       logits_to_keep=R + 1).logits  # (B, R + 1, V)
    return logits[:, :-1].float() / temperature  # (B, R, V)


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
    first, inverse = groups
    mask = query_mask[first]
    with reading_last(model, reads):
        prompts = model(input_ids=queries[first], attention_mask=mask, position_ids=position_ids(mask),
                        use_cache=True, **kwargs)
    cache = getattr(prompts, CACHE)
    cache.reorder_cache(inverse)  # (n, ...) -> (B, ...)
    return prompts, cache


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


@torch.no_grad()
def sample_responses(policy: nn.Module, queries: Tensor, query_mask: Tensor, *, response_length: int,
                     temperature: float, pad_token_id: int, stop_token_id: int | None, top_k: int = 0,
                     top_p: float = 1.0, min_p: float | None = None, repetition_penalty: float = 1.0,
                     noise_keys: Tensor | None = None, keep_logprobs: bool = False) -> tuple[Tensor, Tensor | None]:
    """Sample (B, R) responses with the KV cache; rows that stopped early are padded to R.

    By default pure sampling from softmax(logits / T): top_k 0 and top_p 1 disable truncation, so the
    log-probs recomputed in training describe exactly the distribution that was sampled. The truncations
    (top_k, top_p, min_p, repetition_penalty) are the user's choice, with the off-policy ratio they bring.
    The draw is `TokenSampler`'s (inverse CDF, one uniform per row and token): the same distribution as
    `generate`'s multinomial draw, faster. The policy's weights must be whole on this rank (under ZeRO-3: gathered,
    `runtime.whole_weights`): ranks decode independently, with no collective per token. `noise_keys` (B,): each row draws its own keyed uniforms
    (`ops.keyed_uniform`) instead of the global random stream.

    Returns the responses and, with `keep_logprobs`, the log-prob of each sampled token under the unwarped
    softmax(logits / T) of the sampling step: (B, R) float32, not masked (0 after the step where every row had
    stopped). The (B, R, V) logits are never kept.
    """
    sampler = TokenSampler(noise_keys, queries.shape[1], temperature if keep_logprobs else None)
    processors = LogitsProcessorList([
        sampler.observer, *_warpers(temperature, top_k, top_p, min_p, repetition_penalty), sampler])
    # greedy over the sampler's scores, which single out its draw: the processors above are the whole sampler
    config = GenerationConfig(max_new_tokens=response_length, do_sample=False, pad_token_id=pad_token_id,
                              eos_token_id=stop_token_id, use_cache=True, return_dict_in_generate=True)
    with own_generation_config(policy), reading_last(policy, 1):  # each decoding step reads its last position
        # synced_gpus: under ZeRO-3 with 2+ ranks transformers would default it to True (an all-reduce per token, and
        # a rank that finished running forwards until all have), for weights sharded per forward; ours are whole
        out = policy.generate(input_ids=queries, attention_mask=query_mask.long(), generation_config=config,
                              logits_processor=processors, synced_gpus=False, **{CACHE: _sampling_cache(
                                  policy, queries, query_mask, capacity=queries.shape[1] + response_length)})
    responses = out.sequences[:, queries.shape[1]:]  # (B, <=R)
    missing = response_length - responses.shape[1]  # every row stopped before R
    if missing:
        responses = torch.cat([responses, responses.new_full((responses.shape[0], missing), pad_token_id)], dim=1)
    if not keep_logprobs:
        return responses, None
    logprobs = torch.stack(sampler.logprobs, dim=1)  # (B, <=R)
    return responses, F.pad(logprobs, (0, missing)) if missing else logprobs


class TokenSampler(LogitsProcessor):
    """The last of `generate`'s logits processors: draws each row's next token from softmax(warped scores)
    (`ops.sample_categorical`) and returns scores on which greedy decoding picks exactly that token.

    keys (B,): each row's uniform at each step is keyed (`ops.keyed_uniform`), so its sample depends only on the
    key, not on its batch or process; None: the global random stream. With a `temperature`, the log-prob of each
    draw under the unwarped softmax(logits / temperature) is kept (`logprobs`, one (B,) per step): `observer`, the
    first processor, sees the logits before any warper changes them.
    """

    def __init__(self, keys: Tensor | None, prompt_length: int, temperature: float | None = None):
        self.keys, self.prompt_length = keys, prompt_length
        self.observer = _UnwarpedLogits(temperature)
        self.logprobs: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.keys is None:
            uniform = torch.rand(scores.shape[0], dtype=torch.float64, device=scores.device)
        else:
            uniform = ops.keyed_uniform(self.keys.to(scores.device), input_ids.shape[1] - self.prompt_length)
        tokens = ops.sample_categorical(scores, uniform)  # (B,)
        if self.observer.scaled is not None:
            self.logprobs.append(self.observer.scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


class _UnwarpedLogits(LogitsProcessor):
    """The first processor of `TokenSampler`'s list: keeps the step's logits / temperature (None: nothing)."""

    def __init__(self, temperature: float | None):
        self.temperature = temperature
        self.scaled: Tensor | None = None  # (B, V)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.temperature is not None:
            self.scaled = scores.float() / self.temperature  # a new tensor: no later warper can change it in place
        return scores


@contextmanager
def own_generation_config(model: nn.Module) -> Iterator[None]:
    """`generate` fills every option its call leaves unset from the model's own generation config, and a hub
    model's generation_config.json often sets some (repetition_penalty, no_repeat_ngram_size, top_k,
    suppress_tokens...): sampling would then add processors the loss knows nothing of, off-policy without a word,
    and a call without a stop token (eos_token_id None) would still stop and pad at the model's EOS. Inside this
    block the model (a PEFT model's base) has a blank one; the saved model keeps its own."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        yield
    finally:
        target.generation_config = saved


def _sampling_cache(policy: nn.Module, queries: Tensor, query_mask: Tensor, *, capacity: int) -> GrowingCache:
    """The KV cache `generate` samples with, room for `capacity` tokens. Rows that share their prompt (RLOO's k
    samples) are prefilled here, each distinct prompt once: the cache of every prompt but its last token, copied
    to the rows that share it; `generate` then feeds the last token. Otherwise empty: `generate` prefills it."""
    cache = GrowingCache(capacity)
    prefixes, prefix_mask = queries[:, :-1], query_mask[:, :-1]
    groups = distinct_prompts(prefixes, prefix_mask) if queries.shape[1] > 1 else None
    if groups is not None:
        prefill_shared_prompts(policy, prefixes, prefix_mask, groups, reads=0, logits_to_keep=1, **{CACHE: cache})
    return cache


def _warpers(temperature: float, top_k: int, top_p: float, min_p: float | None,
             repetition_penalty: float) -> list[LogitsProcessor]:
    """What `generate` applies before sampling, in its order: the repetition penalty, then the warpers."""
    out: list[LogitsProcessor] = []
    if repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    out.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        out.append(MinPLogitsWarper(min_p))
    return out


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
