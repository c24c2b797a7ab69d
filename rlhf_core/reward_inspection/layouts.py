"""Padded probe batches in the layouts the pipeline uses, and the perturbations the checks apply to them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rlhf_core.batching import Example, pad


@dataclass(frozen=True)
class Padded:
    """A padded batch in one of the layouts below; `last_index` is each row's last real token."""

    input_ids: Tensor  # (B, T)
    attention_mask: Tensor  # (B, T) bool
    prompt_width: int  # P: the columns before the completions (rollout layout; the scorer splits here)
    last_index: Tensor  # (B,)



def rollout_layout(examples: Sequence[Example], pad_id: int, left_extra: int = 0, right_extra: int = 0) -> Padded:
    """The trainer's layout: prompts left-padded, completions right-padded (+ extra pad columns)."""
    prompts, prompt_mask = pad([p for p, _ in examples], pad_id, "left", max(len(p) for p, _ in examples) + left_extra)
    completions, completion_mask = pad([c for _, c in examples], pad_id, "right",
                                       max(len(c) for _, c in examples) + right_extra)
    P = prompts.shape[1]
    last = P + torch.tensor([len(c) for _, c in examples]) - 1
    return Padded(torch.cat([prompts, completions], 1), torch.cat([prompt_mask, completion_mask], 1), P, last)


def sequence_layout(examples: Sequence[Example], pad_id: int, side: str, extra: int = 0) -> Padded:
    """Whole sequences padded on one side: 'right' as reward training collates, 'left' as generation does."""
    sequences = [p + c for p, c in examples]
    ids, mask = pad(sequences, pad_id, side, max(len(s) for s in sequences) + extra)
    T = ids.shape[1]
    last = torch.tensor([len(s) - 1 if side == "right" else T - 1 for s in sequences])
    return Padded(ids, mask, 0, last)


def path_layout(path: str, examples: Sequence[Example], pad_id: int, extra: int = 0) -> Padded:
    """The padded layout each path is used with: right padding (forward) or the rollout layout (scorer)."""
    if path == "forward":
        return sequence_layout(examples, pad_id, "right", extra)
    return rollout_layout(examples, pad_id, extra, extra)


def alone(path: str, example: Example, pad_id: int) -> Padded:
    """One example, no padding at all: the reference every padded score must reproduce."""
    return path_layout(path, [example], pad_id)


def other_token(token: int, vocab_size: int, avoid: set[int]) -> int:
    """A deterministic id different from `token` and from the special ids in `avoid`."""
    for step in range(1, vocab_size):
        candidate = (token + step * 7919) % vocab_size  # a stride prime to most vocabularies: not a neighbour
        if candidate != token and candidate not in avoid:
            return candidate
    raise ValueError(f"vocabulary of {vocab_size} ids has no token to substitute")


def with_last_token_changed(batch: Padded, vocab_size: int, avoid: set[int]) -> Padded:
    ids = batch.input_ids.clone()
    rows = torch.arange(len(ids))
    ids[rows, batch.last_index] = torch.tensor(
        [other_token(int(t), vocab_size, avoid) for t in ids[rows, batch.last_index]])
    return replace(batch, input_ids=ids)


def with_padding_content_changed(batch: Padded, vocab_size: int, avoid: set[int], seed: int = 0) -> Padded:
    """Every masked-out id replaced by a random ordinary token: padding must be invisible by its mask."""
    ordinary = torch.tensor([t for t in range(vocab_size) if t not in avoid])
    generator = torch.Generator().manual_seed(seed)
    noise = ordinary[torch.randint(len(ordinary), batch.input_ids.shape, generator=generator)]
    return replace(batch, input_ids=torch.where(batch.attention_mask, batch.input_ids, noise))


def synthetic_examples(vocab_size: int, avoid: set[int], eos_id: int, n: int, seed: int = 0) -> list[Example]:
    """Random ordinary tokens + EOS, of varied lengths: probes for a model given without data."""
    ordinary = torch.tensor([t for t in range(vocab_size) if t not in avoid])
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = ordinary[torch.randint(len(ordinary), (6 + 3 * (i % 5),), generator=generator)].tolist()
        out.append((ids[:4], ids[4:] + [eos_id]))
    return out

