"""The rollout's own decode loop (rlhf_core.decode) against transformers' `generate` with the same draws.

The reference is the sampling path the decode loop replaced (bench/generate_path.py): `generate` driven greedily
over scores that single out a keyed draw. Same draws, same processors, same stop rule: the same tokens, and the
same log-prob for every token through each row's stop token.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_rollout_scoring import tiny_decoder_config
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, StaticCache

from conftest import TINY_VOCAB
from rlhf_core import ops
from rlhf_core.batching import pad
from rlhf_core.decode import (
    GRAPH_PROMPT_BUCKET,
    Forwards,
    TokenChoice,
    _fill_static,
    decode,
    graphs_available,
)
from rlhf_core.prompt_attention import (
    SHARED_PROMPT_MODELS,
    SharedPromptCache,
    SharedPrompts,
    supports_shared_prompts,
)
from rlhf_core.rollout import position_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from generate_path import generate_responses  # noqa: E402

PAD, EOS, R = 0, 1, 10


def left_padded_prompts(n: int = 12, shared: int = 0, seed: int = 0):
    """n prompts of 2..8 tokens, left-padded; the first `shared` rows repeat prompt 0 (RLOO's samples)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (n,), generator=generator).tolist()
    prompts = [torch.randint(2, TINY_VOCAB, (length,), generator=generator).tolist() for length in lengths]
    for i in range(1, shared):
        prompts[i] = list(prompts[0])
    return pad(prompts, PAD, "left")


def biased(model, eos_bias: float):
    """`model` with `eos_bias` added to EOS's logit and the pad id never drawn: rows stop at different steps."""
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS], bias[PAD] = eos_bias, float("-inf")
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + bias)
    return model


def tiny(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_decoder_config(model_type)).eval()


def assert_same_draws(ours, theirs):
    (tokens, logprobs), (ref_tokens, ref_logprobs) = ours, theirs
    assert torch.equal(tokens, ref_tokens)
    through_stop = ops.truncate_after_stop(ref_tokens, EOS, -1) != -1  # (B, R) each row's tokens through its stop
    torch.testing.assert_close(logprobs[through_stop], ref_logprobs[through_stop], rtol=0, atol=1e-5)
    assert (logprobs[~through_stop] == 0).all(), "after a row's stop its log-probs are 0"


def sample_both(model, queries, query_mask, *, keys=None, seed=None, **choice):
    """(decode's draws, generate's draws) with the same keys, or from the same global stream (`seed`)."""
    kwargs = dict(response_length=R, pad_token_id=PAD, stop_token_id=EOS, noise_keys=keys, keep_logprobs=True)
    if seed is not None:
        torch.manual_seed(seed)
    ours = decode(model, queries, query_mask, choice=TokenChoice(**choice), **kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    theirs = generate_responses(model, queries, query_mask, **choice, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "llama", "qwen2"])
def test_sampling_draws_what_generate_draws_with_the_same_keys(model_type):
    """Left-padded prompts of 2–8 tokens, rows stopping at different steps, some never: the same tokens and
    log-probs across architectures (absolute positions, rotary, grouped-query attention)."""
    model = biased(tiny(model_type), eos_bias=0.0)
    queries, query_mask = left_padded_prompts()
    keys = ops.episode_keys(0, 0, torch.arange(len(queries)), torch.zeros(len(queries), dtype=torch.long))
    ours, theirs = sample_both(model, queries, query_mask, keys=keys, temperature=0.7)
    assert_same_draws(ours, theirs)
    stopped_at = ops.first_true_indices(ours[0] == EOS)
    assert (stopped_at < R - 1).any() and (stopped_at == R).any(), "some rows stop early, some run to the end"
    assert (~query_mask).any(), "some prompts are left-padded"


def test_shared_prompts_processors_and_the_global_stream_draw_what_generate_draws():
    """RLOO's rows sharing a prompt (prefilled once), the repetition penalty and the truncations applied in
    `generate`'s order, and draws from the global random stream instead of keys."""
    model = biased(tiny("llama", seed=1), eos_bias=1.0)
    queries, query_mask = left_padded_prompts(n=8, shared=4)
    keys = torch.arange(len(queries)) * 7919
    for choice in ({"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8, "repetition_penalty": 1.4},
                   {"temperature": 1.0, "min_p": 0.05}):
        assert_same_draws(*sample_both(model, queries, query_mask, keys=keys, **choice))
    assert_same_draws(*sample_both(model, queries, query_mask, seed=5, temperature=0.9))


def test_the_loop_ends_when_every_row_has_stopped():
    """A policy that emits EOS almost surely: every row stops within a few tokens, the rest is padding, and no
    forward runs after the step where the last row stopped (what generate does too)."""
    model = biased(tiny("gpt_neox"), eos_bias=6.0)
    queries, query_mask = left_padded_prompts(n=6)
    keys = torch.arange(6)
    assert_same_draws(*sample_both(model, queries, query_mask, keys=keys, temperature=1.0))
    forwards = []
    model.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    tokens, _ = decode(model, queries, query_mask, response_length=R, pad_token_id=PAD, stop_token_id=EOS,
                       choice=TokenChoice(), noise_keys=keys)
    last_stop = ops.first_true_indices(tokens == EOS).max().item()
    assert last_stop < R - 2, "every row stopped early"
    assert (tokens[:, last_stop + 1:] == PAD).all()
    assert forwards == [queries.shape[1]] + [1] * last_stop, "the prefill, then a step per token until the last stop"


def shared_prompt_rows(layout: str):
    """"grouped": 3 prompts x 4 samples side by side, as a rollout lays them out; "scattered": 4 rows of one
    prompt among 6 others, in shuffled order (groups of unequal size, not side by side)."""
    if layout == "grouped":
        queries, query_mask = left_padded_prompts(n=3, seed=7)
        return queries.repeat_interleave(4, dim=0), query_mask.repeat_interleave(4, dim=0)
    queries, query_mask = left_padded_prompts(n=10, shared=4, seed=8)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    return queries[order], query_mask[order]


@pytest.mark.parametrize("layout", ["grouped", "scattered"])
@pytest.mark.parametrize("model_type", sorted(SHARED_PROMPT_MODELS))
def test_completions_of_a_shared_prompt_read_its_keys_and_values_once(model_type, layout):
    """Rows that share a prompt: the KV cache holds each prompt once, every layer attends through the shared-prompt
    attention (rlhf_core/prompt_attention.py), and each step's logits are the model's own forward over
    [prompt | completion so far], without a cache, to rounding."""
    model = tiny(model_type)
    queries, query_mask = shared_prompt_rows(layout)
    forwards = Forwards(model, queries, query_mask, response_length=R, graphs=False)
    assert forwards.sharing
    keys = torch.arange(len(queries)) * 13
    logits, tokens = forwards.prefill(), []
    for t in range(R):
        tokens.append(ops.sample_categorical(logits.float() / 0.7, ops.keyed_uniform(keys, t)))
        sequence = torch.cat([queries, torch.stack(tokens, dim=1)], dim=1)
        mask = torch.cat([query_mask, torch.ones(len(queries), t + 1, dtype=torch.bool)], dim=1)
        logits = forwards.step(tokens[-1], t)
        with torch.no_grad():
            reference = model(input_ids=sequence, attention_mask=mask.long(), position_ids=position_ids(mask)).logits
        torch.testing.assert_close(logits, reference[:, -1], rtol=0, atol=1e-5)
    keys = forwards.cache.layers[0].keys  # (n, kv_heads, P + R x width, D): each prompt once
    distinct = len(torch.unique(torch.cat([queries, query_mask], dim=1), dim=0))
    assert keys.shape[0] == distinct < len(queries)
    assert keys.shape[2] == queries.shape[1] + R * forwards.shared.width
    assert len(forwards.shared.attended) == model.config.num_hidden_layers
    assert (forwards.shared.slots is None) == (layout == "grouped")
    assert model.config._attn_implementation == "sdpa", "the model's own attention is back after each step"


@pytest.mark.parametrize("cache", ["shared-prompt", "static"])
def test_the_decode_cache_takes_the_prefills_keys_and_values_instead_of_holding_them_twice(cache):
    """The decode's cache is made from the distinct prompts' prefill cache a layer at a time, each layer of the
    prefill emptied once copied: the prompts' keys and values are never held twice (for a 1B model's 64 prompts of
    512 tokens in bf16, 4 GiB twice). The shared-prompt cache holds each prompt once; the static cache of the
    compiled step (CUDA graphs) holds each row's prompt."""
    model = tiny("gpt_neox")
    queries, query_mask = left_padded_prompts(n=3, seed=7)
    P, rows = queries.shape[1], torch.tensor([0, 0, 2, 1, 2, 1])  # each row's distinct prompt
    prefill = DynamicCache()
    with torch.no_grad():
        model(input_ids=queries, attention_mask=query_mask.long(), position_ids=position_ids(query_mask),
              use_cache=True, past_key_values=prefill)
    held = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.layers]
    if cache == "shared-prompt":
        layout = SharedPrompts.of(query_mask, rows, R, torch.float32)
        made, expected = SharedPromptCache(prefill, layout, R), held
    else:
        made = StaticCache(config=model.config, max_cache_len=P + R)
        _fill_static(made, prefill, P, rows=rows)
        expected = [(keys[rows], values[rows]) for keys, values in held]
    assert len(made.layers) == len(held) == model.config.num_hidden_layers
    for layer, kept, (keys, values) in zip(prefill.layers, made.layers, expected, strict=True):
        assert layer.keys.numel() == layer.values.numel() == 0, "the prefill's layer still holds its tensors"
        assert torch.equal(kept.keys[:, :, :P], keys) and torch.equal(kept.values[:, :, :P], values)


def test_shared_prompt_attention_is_left_to_the_models_it_fits():
    """Other attention implementations, a sliding window shorter than prompt plus completion, and architectures
    not checked against `generate` keep the plain cache."""
    assert supports_shared_prompts(tiny("llama"), 64)
    eager = AutoModelForCausalLM.from_config(tiny_decoder_config("llama"), attn_implementation="eager")
    assert not supports_shared_prompts(eager, 64)
    windowed = tiny_decoder_config("qwen2")
    windowed.use_sliding_window, windowed.sliding_window = True, 16
    assert not supports_shared_prompts(AutoModelForCausalLM.from_config(windowed), 64)
    assert supports_shared_prompts(AutoModelForCausalLM.from_config(windowed), 16)
    assert not supports_shared_prompts(AutoModelForCausalLM.from_config(tiny_decoder_config("gemma")), 64)
    queries, query_mask = left_padded_prompts(n=4)
    assert not Forwards(tiny("llama"), queries, query_mask, response_length=R, graphs=False).sharing, \
        "no two rows share a prompt"


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_greedy_decoding_is_generates_greedy_search(model_type):
    """Evaluation's greedy completions: transformers' own greedy search, token for token, with its stop and
    padding (the model's generation config left out on both sides)."""
    model = biased(tiny(model_type), eos_bias=0.2)
    queries, query_mask = left_padded_prompts(n=10)
    ours, none = decode(model, queries, query_mask, response_length=R, pad_token_id=PAD, stop_token_id=EOS,
                        choice=TokenChoice(greedy=True))
    config = GenerationConfig(max_new_tokens=R, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    theirs = model.generate(input_ids=queries, attention_mask=query_mask.long(), generation_config=config)
    theirs = theirs[:, queries.shape[1]:]
    theirs = torch.cat([theirs, theirs.new_full((len(theirs), R - theirs.shape[1]), PAD)], dim=1)
    assert none is None and torch.equal(ours, theirs)
    assert (ours == EOS).any(1).any() and not (ours == EOS).any(1).all(), "some rows stop, some do not"


def test_a_lora_policy_draws_what_generate_draws():
    """The policy as PEFT wraps it for LoRA training (adapter weights nonzero), and with the adapter off (the
    reference): both decode as `generate` does."""
    model = tiny("llama")
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              init_lora_weights=False))
    biased(policy.get_base_model(), eos_bias=1.0)
    queries, query_mask = left_padded_prompts(n=8, shared=2)
    keys = torch.arange(8) + 3
    adapted = sample_both(policy, queries, query_mask, keys=keys, temperature=0.8)
    assert_same_draws(*adapted)
    with policy.disable_adapter():
        base = sample_both(policy, queries, query_mask, keys=keys, temperature=0.8)
    assert_same_draws(*base)
    assert not torch.equal(adapted[0][0], base[0][0]), "the adapter changes what is drawn"


def test_the_static_cache_compiled_step_draws_what_the_eager_loop_draws():
    """The CUDA-graph configuration (a static KV cache over all P + R slots, prompts left-padded to a width bucket,
    shared prompts copied into the static buffers, the step compiled with fixed shapes) run on the CPU, where
    torch.compile has no CUDA graphs but traces and compiles the same step: the same tokens and log-probs. A second
    rollout of other prompts in the same bucket reuses the compiled step and its cache (no new graph)."""
    from torch._dynamo.utils import counters

    model = biased(tiny("llama", seed=2), eos_bias=1.0)
    kwargs = dict(response_length=R, pad_token_id=PAD, stop_token_id=EOS, choice=TokenChoice(temperature=0.7),
                  keep_logprobs=True)
    graphs = []
    for seed, shared in ((0, 3), (1, 0)):
        queries, query_mask = left_padded_prompts(n=8, shared=shared, seed=seed)
        assert queries.shape[1] % GRAPH_PROMPT_BUCKET, "the prompts get left-padded to the bucket"
        keys = torch.arange(8) * 31 + seed
        eager = decode(model, queries, query_mask, noise_keys=keys, **kwargs)
        compiled = decode(model, queries, query_mask, graphs=True, noise_keys=keys, **kwargs)
        assert torch.equal(compiled[0], eager[0])
        torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0] > 0, "the second rollout compiled nothing new"
    assert not graphs_available(model), "the trainer captures graphs on CUDA only"


def test_cuda_graphs_asked_for_where_there_are_none_are_refused_by_name(tokenizer, prompts, make_policy,
                                                                      make_scorer_model):
    """`train.decode_graphs: on` on a CPU: the first rollout says why it cannot, naming the key; `auto` decodes
    eagerly there."""
    from test_trainer import make_trainer, tiny_config

    refused = make_trainer(tiny_config("rloo", total_episodes=32, decode_graphs="on"), tokenizer, prompts,
                           make_policy, make_scorer_model)
    with pytest.raises(ValueError, match="train.decode_graphs=on: CUDA graphs need a CUDA device"):
        refused.rollout([0, 1])
    auto = make_trainer(tiny_config("rloo", total_episodes=32, decode_graphs="auto"), tokenizer, prompts,
                        make_policy, make_scorer_model)
    assert len(auto.rollout([0, 1])) == 2 * auto.cfg.samples_per_prompt


def _step_by_step(forwards, steps: int, keys) -> list[torch.Tensor]:
    """The logits of the prefill and of each of `steps` decode steps, feeding keyed draws."""
    logits = [forwards.prefill()]
    for t in range(steps):
        tokens = ops.sample_categorical(logits[-1].float() / 0.7, ops.keyed_uniform(keys, t))
        logits.append(forwards.step(tokens, t).clone())
    return logits


def test_the_decode_step_is_one_graph_that_every_step_replays_without_recompiling():
    """Capture-ready before any GPU sees it: the one-token step over the static KV cache compiles with
    `fullgraph=True` (a graph break would raise) into one graph, and no later step, nor a second rollout of other
    prompts of the same bucket, recompiles (dynamo's `error_on_recompile`); its logits are the eager step's.
    Dynamo's tracing is what a CUDA capture needs; backend "eager" checks it without inductor's codegen."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from rlhf_core.decode import Forwards, _pad_to_bucket

    model = tiny("gpt_neox")
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fall-back to the eager step fails the test
        for seed in (0, 1):  # two rollouts: other prompts, same shapes
            queries, query_mask = _pad_to_bucket(*left_padded_prompts(n=6, seed=seed), PAD)  # as `decode` does
            keys = torch.arange(6) + 10 * seed
            eager = _step_by_step(Forwards(model, queries, query_mask, response_length=R, graphs=False), R - 1, keys)
            forwards = Forwards(model, queries, query_mask, response_length=R, graphs=True,
                                compile_options={"backend": "eager"})
            compiled = _step_by_step(forwards, R - 1, keys)
            assert forwards.graphs, "the compiled step did not fall back"
            for ours, reference in zip(compiled, eager, strict=True):
                torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_step_that_fails_to_compile_decodes_eagerly_after_one_warning():
    """A model whose forward cannot be one graph (here a hook that breaks it): `graphs` warns once, decodes the
    same tokens as the eager loop on the static cache it had begun, and the next rollout neither warns nor tries
    again."""
    import torch._dynamo

    model = biased(tiny("gpt_neox", seed=3), eos_bias=1.0)
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    kwargs = dict(response_length=R, pad_token_id=PAD, stop_token_id=EOS, choice=TokenChoice(temperature=0.7),
                  keep_logprobs=True, compile_options={"backend": "eager"})
    queries, query_mask = left_padded_prompts(n=6, seed=4)
    keys = torch.arange(6) * 3
    eager = decode(model, queries, query_mask, noise_keys=keys, **kwargs)
    torch._dynamo.reset()
    for attempt in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = decode(model, queries, query_mask, noise_keys=keys, graphs=True, **kwargs)
        messages = [str(w.message) for w in caught if "compiled decode step failed" in str(w.message)]
        assert len(messages) == (1 if attempt == 0 else 0), messages
        assert torch.equal(compiled[0], eager[0])
        torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)

