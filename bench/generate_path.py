"""The rollout's sampling as it was before `rlhf_core.decode`: transformers' `generate` driven greedily over scores
that single out a draw made by a logits processor (`TokenSampler`), log-probs taken through a processor that
watches the logits. Kept as the reference the decode loop is tested against token for token
(tests/test_decode.py) and measured against side by side (bench/decode_loop.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rlhf_core import ops
from rlhf_core.decode import TokenChoice
from rlhf_core.kv_cache import CACHE, GrowingCache
from rlhf_core.rollout import distinct_prompts, prefill_shared_prompts, reading_last


@torch.no_grad()
def generate_responses(policy: nn.Module, queries: Tensor, query_mask: Tensor, *, response_length: int,
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
        sampler.observer, *TokenChoice(temperature, top_k, top_p, min_p, repetition_penalty).processors(), sampler])
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
