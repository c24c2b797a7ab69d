"""Text to token tensors: the one prompt + completion encoder and the one padding function of the library.

Every trainer, scorer and probe encodes an example the same way (SFT's labels, the reward model's pairs, the
inspection's probes), so the token a reward model learned to score is the token RL and evaluation score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Example = tuple[list[int], list[int]]
"""(prompt ids, completion ids ending with EOS unless the completion was cut)."""


def encode_examples(tokenizer, texts: Sequence[tuple[str, str]], *, max_prompt_tokens: int | None = None,
                    max_completion_tokens: int | None = None, max_tokens: int | None = None) -> list[Example]:
    """(prompt, completion) texts -> [tokens(prompt), tokens(completion) + [EOS]]; each text tokenized alone,
    without special tokens (all prompts in one batched call, all completions in another: a call per text cost
    the reward-model stage ~2 s).

    - `max_completion_tokens`: completion + EOS keeps its first tokens; a longer completion loses its EOS,
      as in TRL's SFT (the policy is not taught to stop where the data did not).
    - `max_prompt_tokens`: the prompt keeps its last tokens, where the TL;DR-style cue is.
    - `max_tokens`: the whole fits; the completion keeps its EOS (the token a reward model scores) and the
      prompt keeps its last tokens beside it, at least one.
    """
    eos = tokenizer.eos_token_id
    assert eos is not None, "the tokenizer needs an EOS token: models learn to stop on it"
    assert max_tokens is None or max_tokens >= 2, "max_tokens must leave room for a prompt token and the EOS"
    prompts, completions = (token_ids(tokenizer, [pair[i] for pair in texts]) for i in (0, 1))
    examples = []
    for prompt_ids, completion_ids in zip(prompts, completions, strict=True):
        completion_ids = completion_ids + [eos]
        if max_completion_tokens is not None:
            completion_ids = completion_ids[:max_completion_tokens]
        if max_prompt_tokens is not None:
            prompt_ids = prompt_ids[-max_prompt_tokens:]
        if max_tokens is not None:
            if len(completion_ids) > max_tokens - 1:
                completion_ids = completion_ids[:max_tokens - 2] + [eos]
            prompt_ids = prompt_ids[-(max_tokens - len(completion_ids)):]
        examples.append((prompt_ids, completion_ids))
    return examples


def token_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each text's tokens, without special tokens, in one batched call."""
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []


def pad(sequences: Sequence[Sequence[int]], pad_value: int, side: Literal["left", "right"],
        width: int | None = None) -> tuple[Tensor, Tensor]:
    """Token lists -> (ids, mask), both (B, W): W the longest sequence (or `width`, if larger), padded on
    `side` with `pad_value`; mask (bool) is True on real tokens.

    Generation and RL prompts pad on the left, so every prompt ends where its response starts; supervised
    batches pad on the right, so every sequence starts at position 0.
    """
    assert side in ("left", "right"), f"side must be 'left' or 'right', got {side!r}"
    W = max([len(s) for s in sequences] + [width or 0])
    ids = torch.full((len(sequences), W), pad_value, dtype=torch.long)  # (B, W)
    mask = torch.zeros((len(sequences), W), dtype=torch.bool)  # (B, W)
    for row, seq in enumerate(sequences):
        cols = slice(W - len(seq), W) if side == "left" else slice(0, len(seq))
        ids[row, cols] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, cols] = True
    return ids, mask
