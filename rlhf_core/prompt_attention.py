"""Decode-step attention that reads a shared prompt's keys and values once per prompt, not once per completion.

RLOO and GRPO sample k completions of each prompt. The decode loop prefills each distinct prompt once, and a
plain KV cache then copies the prompt's keys and values to all k rows: every step's attention reads them k times.
On a CPU that read is the step's cost: bench-tiny's GRPO (8 completions of 48-token prompts, 64 rows, 4 layers)
holds 4.7 MB of K and V per layer, and its decode attention took a third of the rollout, memory-bound.

Here the cache keeps only the completions' tokens (B rows), and the prompts' keys and values stay as the
prefill made them (n rows, one per distinct prompt). A step's queries are laid out by prompt, (n, heads, k, D),
so one matmul per prompt scores them against its keys; the completion part is per row; one softmax over both
joins them (the prompt's left padding masked). The same attention to rounding: the sums run in another order
than SDPA's kernel, so a sampled token moves only where a draw falls within rounding of a boundary.

The model's attention modules reach this function through transformers' attention interface, switched to it
for the step (`attending_shared_prompts`), with the prompts handed down as the `shared_prompts` keyword, which
transformers passes to each layer's attention. Used for the model types in `SHARED_PROMPT_MODELS` (checked
against `generate` in tests/test_decode.py), with SDPA attention and no sliding window.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache

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


@dataclass
class SharedPrompts:
    """The distinct prompts' keys and values and how the B completion rows map onto them.

    keys, values: one (n, kv_heads, P, D) tensor per layer, as the prefill's cache holds them.
    mask: (n, 1, 1, P) additive, the prompts' left padding at the dtype's lowest.
    slots: (B,) each row's place in an (n x width) grid, prompt by prompt; None where the rows already are that
           grid (the k samples of each prompt next to each other, every prompt with `width` of them).
    """

    keys: list[Tensor]
    values: list[Tensor]
    mask: Tensor
    slots: Tensor | None
    width: int
    attended: set[int] = field(default_factory=set)  # the layers that attended through us in the last step

    @classmethod
    def from_prefill(cls, cache: DynamicCache, prompt_mask: Tensor, prompt_of_row: Tensor,
                     dtype: torch.dtype) -> SharedPrompts:
        """From the prefill's cache of the n distinct prompts (`prompt_mask` (n, P)) and the distinct prompt of
        each row (B,)."""
        n, rows = len(prompt_mask), len(prompt_of_row)
        counts = torch.bincount(prompt_of_row, minlength=n)
        width = int(counts.max())
        grouped = n * width == rows and torch.equal(prompt_of_row, torch.arange(n, device=prompt_of_row.device).repeat_interleave(width))
        slots = None
        if not grouped:  # the j-th row of prompt p goes to slot p * width + j
            order = torch.argsort(prompt_of_row, stable=True)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.empty_like(prompt_of_row)
            rank[order] = torch.arange(rows, device=order.device) - starts[prompt_of_row[order]]
            slots = prompt_of_row * width + rank
        mask = torch.zeros(prompt_mask.shape, dtype=dtype, device=prompt_mask.device)
        mask = mask.masked_fill_(~prompt_mask.bool(), torch.finfo(dtype).min)[:, None, None, :]
        return cls([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], mask,
                   slots, width)

    def to_grid(self, rows: Tensor) -> Tensor:
        """(B, ...) per row → (n * width, ...) per slot (empty slots zero)."""
        if self.slots is None:
            return rows
        grid = rows.new_zeros((len(self.mask) * self.width, *rows.shape[1:]))
        grid[self.slots] = rows
        return grid

    def to_rows(self, grid: Tensor) -> Tensor:
        return grid if self.slots is None else grid[self.slots]


def in_order_of_appearance(groups: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """`rollout.distinct_prompts`' (first row of each prompt, prompt of each row) with the prompts numbered as
    they first appear (`torch.unique` sorts them by content): a rollout's k samples side by side then need no
    regrouping."""
    first, inverse = groups
    order = torch.argsort(first)
    number = torch.empty_like(order)
    number[order] = torch.arange(len(order), device=order.device)
    return first[order], number[inverse]


def _by_prompt(x: Tensor, n: int) -> Tensor:
    """(n * k, kv_heads, g, X) by row → (n, kv_heads, k * g, X): each prompt's queries side by side."""
    _, heads, g, width = x.shape
    return x.view(n, -1, heads, g, width).transpose(1, 2).reshape(n, heads, -1, width)


def _by_row(x: Tensor, kv_heads: int, g: int) -> Tensor:
    """The inverse of `_by_prompt`."""
    n, _, _, width = x.shape
    return x.view(n, kv_heads, -1, g, width).transpose(1, 2).reshape(-1, kv_heads, g, width)


def shared_prompt_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            shared_prompts: SharedPrompts | None = None, **kwargs) -> tuple[Tensor, None]:
    """One decode step's attention: `query` (B, heads, 1, D) over its prompt's keys and values (`shared_prompts`)
    and over `key`/`value` (B, kv_heads, T, D), the completion tokens so far, this step's included. Returns
    (B, 1, heads, D) as transformers' attention functions do."""
    if shared_prompts is None:
        raise RuntimeError(f"attention '{ATTENTION}' is only for the decode steps of rlhf_core.decode, which pass "
                           "`shared_prompts`")
    unsupported = {name for name in ("softcap", "position_bias", "s_aux", "sinks") if kwargs.get(name) is not None}
    if unsupported or kwargs.get("sliding_window") is not None or dropout or query.shape[2] != 1:
        raise ValueError(f"shared-prompt attention: unsupported for this model's attention ({sorted(unsupported)}, "
                         f"sliding_window={kwargs.get('sliding_window')}, dropout={dropout}, "
                         f"{query.shape[2]} query tokens)")
    layer = module.layer_idx
    prompt_keys, prompt_values = shared_prompts.keys[layer], shared_prompts.values[layer]  # (n, kv_heads, P, D)
    n, kv_heads, P, D = prompt_keys.shape
    B, heads = query.shape[:2]
    g = heads // kv_heads  # query heads per key/value head
    scale = D ** -0.5 if scaling is None else scaling
    query = query.reshape(B, kv_heads, g, D) * scale
    prompt_scores = _by_prompt(shared_prompts.to_grid(query), n) @ prompt_keys.transpose(-1, -2)
    prompt_scores = shared_prompts.to_rows(_by_row(prompt_scores + shared_prompts.mask, kv_heads, g))
    scores = torch.cat([prompt_scores, query @ key.transpose(-1, -2)], dim=-1)  # (B, kv_heads, g, P + T)
    weights = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    on_prompt = _by_prompt(shared_prompts.to_grid(weights[..., :P].contiguous()), n) @ prompt_values
    out = shared_prompts.to_rows(_by_row(on_prompt, kv_heads, g)) + weights[..., P:] @ value  # (B, kv_heads, g, D)
    shared_prompts.attended.add(layer)
    return out.reshape(B, 1, heads, D), None


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
