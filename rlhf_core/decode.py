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
import warnings
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
from rlhf_core.kv_cache import CACHE, GrowingCache, empty_layer
from rlhf_core.prompt_attention import (
    SharedPromptCache,
    SharedPrompts,
    attending_shared_prompts,
    in_order_of_appearance,
    supports_shared_prompts,
)
from rlhf_core.rollout import (
    distinct_prompts,
    position_ids,
    prefill_distinct_prompts,
    prefill_shared_prompts,
    reading_last,
)

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
           keep_logprobs: bool = False, graphs: bool = False,
           compile_options: dict | None = None) -> tuple[Tensor, Tensor | None]:
    """(B, R) responses of `model` to left-padded (B, P) prompts, padded after each row's stop token, and with
    `keep_logprobs` the log-prob of each token under softmax(logits / temperature) at its step: (B, R) float32,
    0 from the step after a row stopped. The (B, R, V) logits are never kept.

    noise_keys (B,): each row draws its own keyed uniforms (`ops.keyed_uniform`), so its sample depends on its key
    alone, not on its batch or process; None: the global random stream. The model's weights must be whole on this
    rank (under ZeRO-3: gathered, `runtime.whole_weights`): ranks decode independently, with no collective.
    compile_options: `torch.compile` options of the `graphs` step (default: inductor, "reduce-overhead").
    """
    B, R = len(queries), response_length
    if graphs:
        queries, query_mask = _pad_to_bucket(queries, query_mask, pad_token_id)
    P = queries.shape[1]
    forwards = Forwards(model, queries, query_mask, response_length=R, graphs=graphs,
                        compile_options=compile_options)
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
    scaled = None  # logits / temperature, where the processors compute nothing else (pure sampling)
    if choice.greedy:
        tokens = logits.argmax(-1)
    else:
        if len(processors) == 1 and type(processors[0]) is TemperatureLogitsWarper:
            scores = scaled = logits / choice.temperature  # the warper's own arithmetic, once for both uses
        else:  # a processor may write in place; the log-prob needs the logits
            scores = processors(seen, logits.clone())
        if noise_keys is None:
            uniform = torch.rand(len(logits), dtype=torch.float64, device=logits.device)
        else:
            uniform = ops.keyed_uniform(noise_keys.to(logits.device), t)
        tokens = ops.sample_categorical(scores, uniform)  # (B,)
    if not keep_logprob:
        return tokens, None
    scaled = logits / choice.temperature if scaled is None else scaled
    return tokens, scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)


class Forwards:
    """The model's forwards over one batch of prompts, with everything that does not change between steps built
    once: the KV cache sized for prompt plus response, each step's attention mask and positions.

    A step is capture-ready: one token per row, fixed shapes, no host sync, no data-dependent Python, so with
    `graphs` it compiles with `fullgraph=True` into one graph that every step replays without recompiling
    (tests/test_decode.py). For SDPA attention the (B, 1, 1, P + R) boolean mask is built here once and handed
    over in its 4-D form, which transformers uses as it is: no per-step mask building and no `padding_mask.all()`
    (a device sync) inside the step. A step that fails to compile or capture at run time warns once and runs
    eagerly on the same static cache from then on."""

    def __init__(self, model: nn.Module, queries: Tensor, query_mask: Tensor, *, response_length: int, graphs: bool,
                 compile_options: dict | None = None):
        B, P = queries.shape
        self.model, self.queries, self.query_mask = model, queries, query_mask
        self.prompt_length, self.response_length = P, response_length
        capacity = P + response_length
        self.groups = distinct_prompts(queries, query_mask)
        self.graphs = graphs and model not in _EAGER_AFTER_FAILURE
        self.shared: SharedPrompts | None = None  # set by the prefill where rows attend to shared prompts
        self.sharing = not graphs and self.groups is not None and supports_shared_prompts(model, capacity)
        # response token t sits at position (the row's real prompt tokens) + t, as `cumsum(mask) - 1` gives
        self.positions = query_mask.long().sum(1, keepdim=True) + torch.arange(response_length, device=queries.device)
        if self.sharing:  # the prefill makes the cache: each prompt once, its completions beside it
            self.forward = model
            return
        mask = torch.cat([query_mask.bool(), query_mask.new_ones(B, response_length, dtype=torch.bool)], dim=1)
        if getattr(model.config, "_attn_implementation", None) != "sdpa":
            self.masks = mask.long()  # (B, P + R): transformers builds each step's mask from it
        else:
            if graphs:  # (R, B, P + R): step t sees the prompt's real tokens and the responses through t
                seen = torch.arange(capacity, device=mask.device) <= P + torch.arange(response_length,
                                                                                     device=mask.device)[:, None]
                mask = mask[None] & seen[:, None]
            # additive (0 or the dtype's lowest): SDPA adds it as it is, where a boolean one costs a `where` per
            # layer per step to convert; (..., B, 1, 1, P + R), a growing cache reading its first P + t + 1
            self.masks = torch.zeros(mask.shape, dtype=_attention_dtype(model, queries.device), device=mask.device)
            self.masks = self.masks.masked_fill_(~mask, torch.finfo(self.masks.dtype).min)[..., None, None, :]
        self.cache = static_cache(model, B, capacity, queries.device) if graphs else GrowingCache(capacity)
        self.forward = compiled_step(model, **(compile_options or {})) if self.graphs else model

    def prefill(self) -> Tensor:
        """The prompts' forward, filling the cache: the (B, V) logits of each row's last prompt position."""
        queries, query_mask, groups = self.queries, self.query_mask, self.groups
        with reading_last(self.model, 1):  # the last layer's MLP on the one position read
            if self.sharing:
                first, inverse = in_order_of_appearance(groups)
                prompts = prefill_distinct_prompts(self.model, queries, query_mask, first, reads=1, logits_to_keep=1,
                                                   **{CACHE: DynamicCache()})
                self.shared = SharedPrompts.of(query_mask[first], inverse, self.response_length,
                                               _attention_dtype(self.model, queries.device))
                self.cache = SharedPromptCache(getattr(prompts, CACHE), self.shared, self.response_length)
                return prompts.logits[inverse, -1]
            if groups is None:
                out = self.model(input_ids=queries, attention_mask=query_mask.long(),
                                 position_ids=position_ids(query_mask), use_cache=True, logits_to_keep=1,
                                 **{CACHE: self.cache})
                return out.logits[:, -1]
            if isinstance(self.cache, GrowingCache):
                prompts, _ = prefill_shared_prompts(self.model, queries, query_mask, groups, reads=1,
                                                    logits_to_keep=1, **{CACHE: self.cache})
                return prompts.logits[groups[1], -1]
            # a static cache's buffers must keep their addresses (the graph reads them): the distinct prompts go
            # through a dynamic cache, whose rows are then copied into the static buffers, each to its rows
            prompts = prefill_distinct_prompts(self.model, queries, query_mask, groups[0], reads=1, logits_to_keep=1,
                                               **{CACHE: DynamicCache()})
            _fill_static(self.cache, getattr(prompts, CACHE), self.prompt_length, rows=groups[1])
            return prompts.logits[groups[1], -1]

    def step(self, tokens: Tensor, t: int) -> Tensor:
        """Feed response token `t` of every row: the (B, V) logits that choose token t + 1."""
        if self.graphs:
            try:
                return self._step(self.forward, tokens, t)
            except Exception as error:  # noqa: BLE001 - any failure to compile or capture: eager from here on
                self._fall_back(error, t)
        return self._step(self.model, tokens, t)

    def _step(self, forward: Callable, tokens: Tensor, t: int) -> Tensor:
        if self.shared is not None:
            return self._shared_step(tokens, t)
        static = not isinstance(self.cache, GrowingCache)
        if self.masks.dim() == 5:
            mask = self.masks[t]  # (B, 1, 1, P + R)
        else:  # a static cache attends over all its slots, a growing one over the tokens so far
            mask = self.masks if static else self.masks[..., :self.prompt_length + t + 1]
        if forward is not self.model:
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs are read: the next may reuse them
        out = forward(input_ids=tokens[:, None], attention_mask=mask, position_ids=self.positions[:, t:t + 1],
                      use_cache=True, logits_to_keep=1, **{CACHE: self.cache})
        # a graph's output lives in memory its next replay overwrites: copied out (B x V, once per step)
        return out.logits[:, -1].to(torch.float32, copy=True) if forward is not self.model else out.logits[:, -1]

    def _shared_step(self, tokens: Tensor, t: int) -> Tensor:
        """A step whose attention reads each prompt's K and V once (rlhf_core/prompt_attention.py); the mask handed
        to the model is only there to be passed on as it is (a 4-D one), the attention reads the layout's."""
        shared = self.shared
        shared.attended.clear()
        with attending_shared_prompts(self.model):
            out = self.model(input_ids=tokens[:, None], attention_mask=shared.mask,
                             position_ids=self.positions[:, t:t + 1], use_cache=True, logits_to_keep=1,
                             shared_prompts=shared, **{CACHE: self.cache})
        layers = len(self.cache.layers)
        if t == 0 and len(shared.attended) != layers:  # a layer that attended otherwise read another layout
            raise RuntimeError(f"decode: {len(shared.attended)} of the {layers} layers of "
                               f"{type(self.model).__name__} attended through the shared-prompt attention")
        return out.logits[:, -1]

    def _fall_back(self, error: Exception, t: int) -> None:
        """The compiled step failed: one warning per model, then eager steps on the same static cache, rewound to
        the P + t tokens written before step t (a failed call may have advanced it)."""
        warnings.warn(f"decode: the compiled decode step failed ({type(error).__name__}: {str(error)[:300]}); "
                      "decoding eagerly on the static cache instead", RuntimeWarning, stacklevel=3)
        _EAGER_AFTER_FAILURE[self.model] = True
        self.graphs = False
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self.prompt_length + t)


def _attention_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype of the queries in `model`'s attention: autocast's where it is on, else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def graphs_available(model: nn.Module) -> bool:
    """Whether the decode steps of `model` can be one captured CUDA graph: on CUDA, every cache layer a plain
    `StaticLayer` (sliding-window and hybrid models keep the eager loop), and no parameter partitioned by
    DeepSpeed ZeRO-3 (whose hooks the graph would freeze)."""
    parameter = next(model.parameters())
    if parameter.device.type != "cuda" or any(hasattr(p, "ds_id") for p in model.parameters()):
        return False
    cache = StaticCache(config=model.config, max_cache_len=1)
    return all(type(layer) is StaticLayer for layer in cache.layers)


_COMPILED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Callable]] = weakref.WeakKeyDictionary()
_EAGER_AFTER_FAILURE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
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


def compiled_step(model: nn.Module, **options) -> Callable:
    """`model`'s forward compiled once per model (and options) for one-token steps: one whole graph
    (`fullgraph=True`: a graph break is an error, not a silent split) with fixed shapes, by default CUDA graphs
    on CUDA (inductor, "reduce-overhead"). A new prompt-width bucket or batch size compiles one more graph."""
    options = {"mode": "reduce-overhead", **options} if "backend" not in options else options
    compiled = _COMPILED.setdefault(model, {})
    key = tuple(sorted(options.items(), key=lambda item: item[0]))
    if key not in compiled:
        compiled[key] = torch.compile(model, dynamic=False, fullgraph=True, **options)
    return compiled[key]


def _fill_static(cache: StaticCache, dynamic: DynamicCache, length: int, rows: Tensor | None = None) -> None:
    """Copy a dynamic cache of `length` tokens into the first slots of a static one, its row `rows[i]` into row i
    (None: row for row). A layer at a time, each layer of `dynamic` emptied once copied: the prompts' keys and values
    are never held twice, nor all their rows beside the static buffers."""
    for static_layer, layer in zip(cache.layers, dynamic.layers, strict=True):
        keys, values = layer.keys, layer.values
        if rows is not None:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        if not static_layer.is_initialized:
            static_layer.lazy_initialization(keys, values)
        static_layer.keys[:, :, :length].copy_(keys)
        static_layer.values[:, :, :length].copy_(values)
        static_layer.cumulative_length.fill_(length)
        empty_layer(layer)


def _pad_to_bucket(queries: Tensor, query_mask: Tensor, pad_token_id: int) -> tuple[Tensor, Tensor]:
    extra = math.ceil(queries.shape[1] / GRAPH_PROMPT_BUCKET) * GRAPH_PROMPT_BUCKET - queries.shape[1]
    if not extra:
        return queries, query_mask
    return (torch.nn.functional.pad(queries, (extra, 0), value=pad_token_id),
            torch.nn.functional.pad(query_mask, (extra, 0), value=False))
