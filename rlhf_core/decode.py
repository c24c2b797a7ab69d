"""The rollout's own decode loop: one prefill, then one-token steps of fixed shape.

    prefill   the prompts, each distinct prompt once (RLOO's k samples share it), their KV copied to every row
              that shares it → the logits of each row's last prompt position
    step t    choose token t from the logits (a keyed draw or the argmax) and keep its log-prob as it is drawn;
              a row that has stopped gets padding; feed the B tokens at their positions → the logits for t + 1

The KV cache has room for P + R tokens from the start, and the positions and attention mask of all R steps are
built once. A CPU runs the steps eagerly on a `GrowingCache` (attention over the P + t tokens so far). With
`graphs`, on CUDA, the step is a `torch.compile(mode="reduce-overhead")` CUDA graph over a transformers
`StaticCache` (attention over all P + R slots, the unwritten ones masked): every step has the same shapes and
addresses, so one graph replay replaces the step's hundreds of kernel launches and `generate`'s Python.

Equal to transformers' `generate` with the same draws, token for token (tests/test_decode.py): the same
processors in the same order, the same stop rule (a stopped row is padded; the loop ends when every row has).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicCache, StaticCache, StaticLayer

from rlhf_core import ops
from rlhf_core.kv_cache import CACHE, GrowingCache
from rlhf_core.rollout import distinct_prompts, position_ids, prefill_shared_prompts, reading_last

GRAPH_PROMPT_BUCKET = 64
"""Under `graphs`, prompts are left-padded to a multiple of this: one captured graph per bucket of prompt widths,
not one per width (a left pad is masked and shifts no position)."""


@dataclass(frozen=True)
class TokenChoice:
    """How each next token is chosen from its logits: a draw from softmax(processed logits), by default pure
    sampling from softmax(logits / temperature); `greedy`: the argmax of the logits, nothing applied."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    greedy: bool = False

    def processors(self) -> LogitsProcessorList:
        """What `generate` applies before sampling, in its order: the repetition penalty, then the warpers."""
        out: list[LogitsProcessor] = []
        if self.greedy:
            return LogitsProcessorList(out)
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(self.top_p))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(self.min_p))
        return LogitsProcessorList(out)


@torch.no_grad()
def decode(model: nn.Module, queries: Tensor, query_mask: Tensor, *, response_length: int, pad_token_id: int,
           stop_token_id: int | None, choice: TokenChoice, noise_keys: Tensor | None = None,
           keep_logprobs: bool = False, graphs: bool = False) -> tuple[Tensor, Tensor | None]:
    """(B, R) responses of `model` to left-padded (B, P) prompts, padded after each row's stop token, and with
    `keep_logprobs` the log-prob of each token under softmax(logits / temperature) at its step: (B, R) float32,
    0 from the step after a row stopped. The (B, R, V) logits are never kept.

    noise_keys (B,): each row draws its own keyed uniforms (`ops.keyed_uniform`), so its sample depends on its key
    alone, not on its batch or process; None: the global random stream. The model's weights must be whole on this
    rank (under ZeRO-3: gathered, `runtime.whole_weights`): ranks decode independently, with no collective.
    """
    B, R = len(queries), response_length
    if graphs:
        queries, query_mask = _pad_to_bucket(queries, query_mask, pad_token_id)
    P = queries.shape[1]
    forwards = Forwards(model, queries, query_mask, response_length=R, graphs=graphs)
    processors = choice.processors()
    sequence = torch.cat([queries, queries.new_full((B, R), pad_token_id)], dim=1)  # the penalty reads it
    responses = sequence[:, P:]  # a view: filled in place, step by step
    logprobs = torch.zeros(B, R, device=queries.device) if keep_logprobs else None
    running = torch.ones(B, dtype=torch.bool, device=queries.device)
    check_every = 8 if graphs else 1  # "has every row stopped?" costs a device sync; extra steps only add padding
    logits = forwards.prefill()  # (B, V)
    for t in range(R):
        tokens, logprob = _choose(logits, choice, processors, sequence[:, :P + t], noise_keys, t, keep_logprobs)
        if stop_token_id is not None:
            tokens = torch.where(running, tokens, pad_token_id)
        responses[:, t] = tokens
        if logprobs is not None:
            logprobs[:, t] = logprob * running
        if stop_token_id is not None:
            running &= tokens != stop_token_id
            if (t + 1) % check_every == 0 and not running.any():
                break
        if t + 1 < R:
            logits = forwards.step(tokens, t)
    return responses, logprobs


def _choose(logits: Tensor, choice: TokenChoice, processors: LogitsProcessorList, seen: Tensor,
            noise_keys: Tensor | None, t: int, keep_logprob: bool) -> tuple[Tensor, Tensor | None]:
    """(B,) tokens drawn from the (B, V) `logits` of step `t`, and with `keep_logprob` their log-probs under the
    unprocessed softmax(logits / temperature)."""
    logits = logits.float()  # as `generate`: processors and the draw in fp32 whatever the model's dtype
    if choice.greedy:
        tokens = logits.argmax(-1)
    else:
        scores = processors(seen, logits.clone())  # a processor may write in place; the log-prob needs the logits
        if noise_keys is None:
            uniform = torch.rand(len(logits), dtype=torch.float64, device=logits.device)
        else:
            uniform = ops.keyed_uniform(noise_keys.to(logits.device), t)
        tokens = ops.sample_categorical(scores, uniform)  # (B,)
    if not keep_logprob:
        return tokens, None
    return tokens, (logits / choice.temperature).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)


class Forwards:
    """The model's forwards over one batch of prompts, with everything that does not change between steps built
    once: the KV cache sized for prompt plus response, the (B, P + R) attention mask, each step's positions."""

    def __init__(self, model: nn.Module, queries: Tensor, query_mask: Tensor, *, response_length: int, graphs: bool):
        B, P = queries.shape
        self.model, self.queries, self.query_mask, self.graphs = model, queries, query_mask, graphs
        self.prompt_length = P
        self.mask = torch.cat([query_mask.long(), query_mask.new_ones(B, response_length, dtype=torch.long)], dim=1)
        # response token t sits at position (the row's real prompt tokens) + t, as `cumsum(mask) - 1` gives
        self.positions = query_mask.long().sum(1, keepdim=True) + torch.arange(response_length, device=queries.device)
        capacity = P + response_length
        self.cache = static_cache(model, B, capacity, queries.device) if graphs else GrowingCache(capacity)
        self.forward = compiled_step(model) if graphs else model

    def prefill(self) -> Tensor:
        """The prompts' forward, filling the cache: the (B, V) logits of each row's last prompt position."""
        queries, query_mask = self.queries, self.query_mask
        groups = distinct_prompts(queries, query_mask)
        with reading_last(self.model, 1):  # the last layer's MLP on the one position read
            if groups is None:
                out = self.model(input_ids=queries, attention_mask=query_mask.long(),
                                 position_ids=position_ids(query_mask), use_cache=True, logits_to_keep=1,
                                 **{CACHE: self.cache})
                return out.logits[:, -1]
            if not self.graphs:
                prompts, _ = prefill_shared_prompts(self.model, queries, query_mask, groups, reads=1,
                                                    logits_to_keep=1, **{CACHE: self.cache})
                return prompts.logits[groups[1], -1]
            # a static cache's buffers must keep their addresses (the graph reads them): the distinct prompts go
            # through a dynamic cache, whose rows are then copied into the static buffers
            prompts, dynamic = prefill_shared_prompts(self.model, queries, query_mask, groups, reads=1,
                                                      logits_to_keep=1, **{CACHE: DynamicCache()})
            _fill_static(self.cache, dynamic, self.prompt_length)
            return prompts.logits[groups[1], -1]

    def step(self, tokens: Tensor, t: int) -> Tensor:
        """Feed response token `t` of every row: the (B, V) logits that choose token t + 1."""
        # a static cache attends over all its slots, so the whole mask; a growing one over the tokens so far
        end = self.mask.shape[1] if self.graphs else self.prompt_length + t + 1
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are read: the next may reuse them
        out = self.forward(input_ids=tokens[:, None], attention_mask=self.mask[:, :end],
                           position_ids=self.positions[:, t:t + 1], use_cache=True, logits_to_keep=1,
                           **{CACHE: self.cache})
        # a graph's output lives in memory its next replay overwrites: copied out (B x V, once per step)
        return out.logits[:, -1].to(torch.float32, copy=True) if self.graphs else out.logits[:, -1]


def graphs_available(model: nn.Module) -> bool:
    """Whether the decode steps of `model` can be one captured CUDA graph: on CUDA, every cache layer a plain
    `StaticLayer` (sliding-window and hybrid models keep the eager loop), and no parameter partitioned by
    DeepSpeed ZeRO-3 (whose hooks the graph would freeze)."""
    parameter = next(model.parameters())
    if parameter.device.type != "cuda" or any(hasattr(p, "ds_id") for p in model.parameters()):
        return False
    cache = StaticCache(config=model.config, max_cache_len=1)
    return all(type(layer) is StaticLayer for layer in cache.layers)


_COMPILED: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()
_STATIC_CACHES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, StaticCache]] = weakref.WeakKeyDictionary()


def static_cache(model: nn.Module, batch_size: int, capacity: int, device: torch.device) -> StaticCache:
    """An empty `StaticCache` for `model`, the same object (reset) for the same batch size, capacity and autocast
    state: the compiled step reads its buffers at fixed addresses, so a new cache would compile a new graph."""
    key = (batch_size, capacity, torch.is_autocast_enabled(device.type))
    caches = _STATIC_CACHES.setdefault(model, {})
    if key not in caches:
        caches[key] = StaticCache(config=model.config, max_cache_len=capacity)
    caches[key].reset()
    return caches[key]


def compiled_step(model: nn.Module) -> Callable:
    """`model`'s forward compiled once per model for one-token steps: CUDA graphs on CUDA ("reduce-overhead"),
    fixed shapes (a new prompt-width bucket or batch size compiles one more graph)."""
    if model not in _COMPILED:
        _COMPILED[model] = torch.compile(model, mode="reduce-overhead", dynamic=False, fullgraph=False)
    return _COMPILED[model]


def _fill_static(cache: StaticCache, dynamic: DynamicCache, length: int) -> None:
    """Copy a (B, ...) dynamic cache of `length` tokens into the first slots of a static one."""
    for static_layer, layer in zip(cache.layers, dynamic.layers, strict=True):
        if not static_layer.is_initialized:
            static_layer.lazy_initialization(layer.keys, layer.values)
        static_layer.keys[:, :, :length].copy_(layer.keys)
        static_layer.values[:, :, :length].copy_(layer.values)
        static_layer.cumulative_length.fill_(length)


def _pad_to_bucket(queries: Tensor, query_mask: Tensor, pad_token_id: int) -> tuple[Tensor, Tensor]:
    extra = math.ceil(queries.shape[1] / GRAPH_PROMPT_BUCKET) * GRAPH_PROMPT_BUCKET - queries.shape[1]
    if not extra:
        return queries, query_mask
    return (torch.nn.functional.pad(queries, (extra, 0), value=pad_token_id),
            torch.nn.functional.pad(query_mask, (extra, 0), value=False))
