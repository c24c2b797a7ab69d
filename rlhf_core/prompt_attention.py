"""Decode steps whose attention reads a shared prompt's keys and values once per prompt, not once per completion.

RLOO and GRPO sample k completions of each prompt. A plain KV cache copies the prompt's keys and values to all k
rows, and every decode step's attention reads them k times. On a CPU that read is the step's cost: bench-tiny's
GRPO (8 completions of 48-token prompts, 64 rows, 4 layers) held 4.7 MB of K and V per layer, and its decode
attention took a third of the rollout, memory-bound.

Here the cache keeps one buffer per layer and prompt, (n, kv_heads, P + R·k, D): the prompt's K and V as the
prefill made them, then the k completions' tokens side by side, step after step (token t of completion j at
P + t·k + j). A step writes one slab, and its attention is one SDPA call per layer with the k queries of each
prompt together, (n, heads, k, D), over the first P + (t+1)·k positions: the prompt once, and each completion's
tokens, a mask hiding the other completions' (and the prompt's left padding). The same attention to rounding
(SDPA sums in another order over another layout), checked step by step against the model's own forward.

The model's attention modules reach `shared_prompt_attention` through transformers' attention interface,
switched to it for the step (`attending_shared_prompts`), with the layout handed down as the `shared_prompts`
keyword, which transformers passes to each layer's attention. Used for the model types in
`SHARED_PROMPT_MODELS` (checked against `generate` in tests/test_decode.py), with SDPA attention and no sliding
window shorter than prompt plus completion.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from rlhf_core.kv_cache import empty_layer

ATTENTION = "rlhf_shared_prompts"
SHARED_PROMPT_MODELS = frozenset({"gpt2", "gpt_neox", "llama", "qwen2"})
"""Architectures whose attention is plain scaled dot-product attention (absolute or rotary positions, grouped
query heads) through transformers' attention interface."""


def supports_shared_prompts(model: nn.Module, capacity: int) -> bool:
    """Whether `model`'s decode steps over `capacity` tokens (prompt and completion) can attend this way."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SHARED_PROMPT_MODELS:
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return window is None or window >= capacity


def in_order_of_appearance(groups: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """`rollout.distinct_prompts`' (first row of each prompt, prompt of each row) with the prompts numbered as
    they first appear (`torch.unique` sorts them by content): a rollout's k samples side by side then need no
    regrouping."""
    first, inverse = groups
    order = torch.argsort(first)
    number = torch.empty_like(order)
    number[order] = torch.arange(len(order), device=order.device)
    return first[order], number[inverse]


@dataclass
class SharedPrompts:
    """Where each of the B rows sits among the n prompts' completions, and what each step may see.

    slots: (B,) each row's place p·width + j (its prompt p, its rank j among that prompt's rows); None where the
           rows already are in that order (the k samples of each prompt side by side, each prompt with `width`).
    mask: (n, 1, width, P + R·width) additive: completion j of a prompt sees the prompt's real tokens and its own
          tokens; the dtype's lowest elsewhere (the other completions, the left padding, an empty slot's tokens).
    """

    slots: Tensor | None
    width: int
    prompt_length: int
    mask: Tensor
    attended: set[int] = field(default_factory=set)  # the layers that attended through us in the last step

    @classmethod
    def of(cls, prompt_mask: Tensor, prompt_of_row: Tensor, response_length: int, dtype: torch.dtype) -> SharedPrompts:
        """For the n distinct prompts (`prompt_mask` (n, P)) and the distinct prompt of each row (B,)."""
        (n, P), rows, device = prompt_mask.shape, len(prompt_of_row), prompt_of_row.device
        counts = torch.bincount(prompt_of_row, minlength=n)
        width = int(counts.max())
        grouped = n * width == rows and torch.equal(prompt_of_row,
                                                    torch.arange(n, device=device).repeat_interleave(width))
        slots = None
        if not grouped:  # the j-th row of prompt p goes to slot p * width + j
            order = torch.argsort(prompt_of_row, stable=True)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.empty_like(prompt_of_row)
            rank[order] = torch.arange(rows, device=device) - starts[prompt_of_row[order]]
            slots = prompt_of_row * width + rank
        own = torch.eye(width, dtype=torch.bool, device=device).repeat(1, response_length)  # (width, R·width)
        seen = torch.cat([prompt_mask.bool()[:, None, :].expand(n, width, P), own.expand(n, -1, -1)], dim=2)
        mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)
        return cls(slots, width, P, mask[:, None])

    def to_grid(self, rows: Tensor) -> Tensor:
        """(B, ...) per row → (n · width, ...) per slot (empty slots zero)."""
        if self.slots is None:
            return rows
        grid = rows.new_zeros((len(self.mask) * self.width, *rows.shape[1:]))
        grid[self.slots] = rows
        return grid

    def to_rows(self, grid: Tensor) -> Tensor:
        return grid if self.slots is None else grid[self.slots]


class SharedPromptLayer(DynamicLayer):
    """One layer's keys and values: (n, kv_heads, P + R·width, D) buffers holding each prompt once, then its
    completions' tokens side by side, step after step. `keys`/`values` are views of the positions written."""

    def __init__(self, prompt_keys: Tensor, prompt_values: Tensor, layout: SharedPrompts, response_length: int):
        super().__init__()
        n, heads, P, D = prompt_keys.shape
        # zeros, not empty: an empty slot's positions are masked, and a masked NaN would still poison the sum
        self._buffers = tuple(prompt.new_zeros(n, heads, P + response_length * layout.width, D)
                              for prompt in (prompt_keys, prompt_values))
        self._buffers[0][:, :, :P].copy_(prompt_keys)
        self._buffers[1][:, :, :P].copy_(prompt_values)
        self.layout, self.steps = layout, 0
        self.lazy_initialization(prompt_keys, prompt_values)
        self.keys, self.values = (buffer[:, :, :P] for buffer in self._buffers)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write one step's (B, kv_heads, 1, D) keys and values as the slab of step `steps`."""
        layout, n = self.layout, len(self.layout.mask)
        start = layout.prompt_length + self.steps * layout.width
        end = start + layout.width
        for buffer, states in zip(self._buffers, (key_states, value_states), strict=True):
            grid = layout.to_grid(states[:, :, 0])  # (n · width, kv_heads, D)
            buffer[:, :, start:end].copy_(grid.view(n, layout.width, *grid.shape[1:]).transpose(1, 2))
        self.steps += 1
        self.keys, self.values = (buffer[:, :, :end] for buffer in self._buffers)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.layout.prompt_length + self.steps  # each row's own tokens


class SharedPromptCache(Cache):
    """The decode steps' cache, made from the prefill's cache of the n distinct prompts."""

    def __init__(self, prefill: DynamicCache, layout: SharedPrompts, response_length: int):
        """Takes `prefill`'s keys and values a layer at a time, emptying each layer once copied: the prompts' cache
        is never held twice (for a 1B model's 64 prompts of 512 tokens in bf16, 4 GiB twice)."""
        layers = []
        for layer in prefill.layers:
            layers.append(SharedPromptLayer(layer.keys, layer.values, layout, response_length))
            empty_layer(layer)
        super().__init__(layers=layers)


def shared_prompt_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            shared_prompts: SharedPrompts | None = None, **kwargs) -> tuple[Tensor, None]:
    """One decode step's attention: `query` (B, heads, 1, D) over `key`/`value` (n, kv_heads, L, D), a
    `SharedPromptLayer`'s positions so far. Returns (B, 1, heads, D) as transformers' attention functions do."""
    if shared_prompts is None:
        raise RuntimeError(f"attention '{ATTENTION}' is only for the decode steps of rlhf_core.decode, which pass "
                           "`shared_prompts`")
    unsupported = {name for name in ("softcap", "position_bias", "s_aux", "sinks") if kwargs.get(name) is not None}
    if unsupported or kwargs.get("sliding_window") is not None or dropout or query.shape[2] != 1:
        raise ValueError(f"shared-prompt attention: unsupported for this model's attention ({sorted(unsupported)}, "
                         f"sliding_window={kwargs.get('sliding_window')}, dropout={dropout}, "
                         f"{query.shape[2]} query tokens)")
    layout = shared_prompts
    n, kv_heads, length, D = key.shape
    heads = query.shape[1]
    if heads != kv_heads:  # grouped-query attention: each key/value head serves heads // kv_heads query heads
        key, value = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (key, value))
    grid = layout.to_grid(query[:, :, 0])  # (n · width, heads, D)
    queries = grid.view(n, layout.width, heads, D).transpose(1, 2)  # (n, heads, width, D): a prompt's together
    out = F.scaled_dot_product_attention(queries, key, value, attn_mask=layout.mask[..., :length], scale=scaling)
    layout.attended.add(module.layer_idx)
    return layout.to_rows(out.transpose(1, 2).reshape(n * layout.width, heads, D))[:, None], None


AttentionInterface.register(ATTENTION, shared_prompt_attention)


@contextmanager
def attending_shared_prompts(model: nn.Module) -> Iterator[None]:
    """Inside the block `model`'s attention modules call `shared_prompt_attention`."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
