"""Rollout sampling, log-prob consistency, scoring conventions, config and data plumbing."""

from __future__ import annotations

import pydantic
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DynamicCache,
    GenerationConfig,
)

from conftest import TINY_VOCAB, target_fraction
from rlhf_core import ops
from rlhf_core.batching import pad
from rlhf_core.config import BatchPlan, RLConfig
from rlhf_core.data import PromptSampler
from rlhf_core.decode import TokenChoice, decode
from rlhf_core.greedy_eval import greedy_rollout
from rlhf_core.kv_cache import CACHE, GrowingCache
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.rollout import (
    POSITIONWISE_MLP_MODELS,
    Rollout,
    distinct_prompts,
    position_ids,
    response_logits,
    stop_mask,
    token_values,
)
from rlhf_core.rollout_maker import logprobs_of, sampling_logprobs_exact
from rlhf_core.scoring import FunctionScorer, RewardModelScorer, WeightedScorer, completion_scores


def make_batch(queries, query_mask, responses, stop_token_id=1):
    response_mask, contains_stop = stop_mask(responses, stop_token_id)
    zeros = torch.zeros(responses.shape)
    return Rollout(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask,
                   logprobs=zeros, ref_logprobs=zeros, contains_stop=contains_stop)


def test_pad_both_sides_and_positions():
    ids, mask = pad([[5, 6, 7], [8]], 0, "left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
    ids, mask = pad([[5, 6, 7], [8]], -100, "right", width=4)
    assert ids.tolist() == [[5, 6, 7, -100], [8, -100, -100, -100]]
    assert mask.tolist() == [[True, True, True, False], [True, False, False, False]]


def test_stop_mask_keeps_through_first_stop():
    responses = torch.tensor([[4, 1, 0, 0], [1, 0, 0, 0], [4, 5, 6, 7]])
    mask, contains = stop_mask(responses, stop_token_id=1)
    assert mask.long().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert contains.tolist() == [True, True, False]
    mask, contains = stop_mask(responses, stop_token_id=None)
    assert mask.all() and not contains.any()


def test_sampled_responses_are_padded_after_stop(make_policy, prompts):
    queries, query_mask = pad(prompts[:32], 0, "left")
    responses, _ = decode(make_policy(), queries, query_mask, response_length=10,
                          choice=TokenChoice(temperature=1.0), pad_token_id=0, stop_token_id=1)
    assert responses.shape == (32, 10)
    mask, contains = stop_mask(responses, 1)
    assert (responses[~mask] == 0).all(), "everything after the stop token is padding"
    assert contains.any(), "a random 16-token policy emits EOS within 10 tokens in some rows"


def test_without_a_stop_token_sampling_never_stops_at_the_models_own_eos(make_policy, prompts):
    """stop_token_id None: every completion runs to R tokens, although the model's generation config names an EOS
    and the model emits it (transformers would otherwise stop there and pad)."""
    policy = make_policy()
    assert policy.generation_config.eos_token_id == 1
    eos_bias = torch.zeros(policy.config.vocab_size)
    eos_bias[1], eos_bias[0] = 3.0, float("-inf")  # the pad id is never sampled: a 0 in a response is padding
    policy.get_output_embeddings().register_forward_hook(lambda module, args, out: out + eos_bias)
    queries, query_mask = pad(prompts[:8], 0, "left")
    responses, logprobs = decode(policy, queries, query_mask, response_length=10,
                                 choice=TokenChoice(temperature=1.0), pad_token_id=0, stop_token_id=None, keep_logprobs=True)
    assert (responses[:, :-1] == 1).any(), "EOS is sampled before the last token"
    assert (responses != 0).all(), "nothing is padded"
    parts = (queries, query_mask, responses, torch.ones_like(responses, dtype=torch.bool))
    torch.testing.assert_close(logprobs, ops.selective_log_softmax(response_logits(policy, parts, 1.0), responses),
                               rtol=0, atol=1e-5)
    greedy = greedy_rollout(policy, prompts[:8], response_length=10, pad_token_id=0, stop_token_id=None)
    assert greedy.responses.shape == (8, 10) and (greedy.responses == 1).all(), "greedy: EOS after EOS, no padding"


def test_sampling_and_greedy_decoding_ignore_the_models_own_generation_config(make_policy, prompts):
    """A hub model's generation_config.json may set repetition penalties, n-gram blocking or sampling options:
    generate would add them to any call that leaves them unset. Sampling must draw from softmax(logits / T) alone
    (the log-probs kept at the sampling steps then equal a forward's), and greedy evaluation must be plain argmax."""
    policy = make_policy()
    policy.generation_config.update(repetition_penalty=3.0, no_repeat_ngram_size=1, do_sample=True, top_k=2,
                                    temperature=0.1, suppress_tokens=[1])
    eos_bias = torch.zeros(policy.config.vocab_size)
    eos_bias[1] = 4.0  # EOS after EOS: what the model's n-gram blocking and suppress_tokens would forbid
    policy.get_output_embeddings().register_forward_hook(lambda module, args, out: out + eos_bias)
    queries, query_mask = pad(prompts[:8], 0, "left")
    responses, logprobs = decode(policy, queries, query_mask, response_length=10,
                                 choice=TokenChoice(temperature=1.0), pad_token_id=0, stop_token_id=None, keep_logprobs=True)
    assert ((responses[:, 1:] == 1) & (responses[:, :-1] == 1)).any(), "a token repeats: no n-gram blocking"
    parts = (queries, query_mask, responses, torch.ones_like(responses, dtype=torch.bool))
    torch.testing.assert_close(logprobs, ops.selective_log_softmax(response_logits(policy, parts, 1.0), responses),
                               rtol=0, atol=1e-5)
    greedy = greedy_rollout(policy, prompts[:8], response_length=10, pad_token_id=0, stop_token_id=None)
    assert (greedy.responses == 1).all(), "plain argmax: EOS at every step"
    assert policy.generation_config.repetition_penalty == 3.0, "the model keeps its own generation config"


def test_rollout_logprobs_match_the_sampling_distribution(make_policy, make_scorer_model, tokenizer, prompts):
    """Log-probs recomputed by a forward pass equal those of the distribution generate() sampled from."""
    torch.manual_seed(3)
    policy = make_policy()
    cfg = RLConfig(algo="rloo", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                   local_rollout_forward_batch_size=8, response_length=6, temperature=0.7, num_epochs=1,
                   stop_token=None)
    trainer = RLTrainer(cfg, policy, FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                        stop_token_id=1)
    queries, query_mask = pad(prompts[:8], 0, "left")
    out = policy.generate(input_ids=queries, attention_mask=query_mask.long(), return_dict_in_generate=True,
                          output_scores=True, generation_config=GenerationConfig(
                              max_new_tokens=6, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                              pad_token_id=0, eos_token_id=None))
    responses = out.sequences[:, queries.shape[1]:]
    expected = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)
    parts = (queries, query_mask, responses, torch.ones_like(responses, dtype=torch.bool))
    torch.testing.assert_close(logprobs_of(policy, parts, trainer.cfg.temperature), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("response_length", [12, 40])  # 40: every row stops before R, the logits are padded
def test_fp32_rollout_logprobs_from_the_sampling_logits_equal_a_forward(response_length, make_policy, tokenizer,
                                                                          prompts):
    """In fp32 the rollout reads the policy's log-probs from the sampling steps' logits (no second forward):
    they equal what the forward pass the training step repeats computes, padding and early stops included."""
    cfg = RLConfig(algo="rloo", per_device_train_batch_size=8, gradient_accumulation_steps=1,
                   local_rollout_forward_batch_size=8, response_length=response_length, temperature=0.7,
                   num_epochs=1, rloo={"rloo_k": 2})
    policy = make_policy()
    if response_length == 40:  # an EOS-prone head: P(EOS) ~ 0.4 per step, so every row stops early
        eos_bias = torch.zeros(policy.config.vocab_size)
        eos_bias[1] = 2.0
        policy.get_output_embeddings().register_forward_hook(lambda module, args, out: out + eos_bias)
    trainer = RLTrainer(cfg, policy, FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                        stop_token_id=1)
    assert sampling_logprobs_exact(trainer.accelerator, trainer.unwrapped.policy)
    batch = trainer.rollout(range(4))
    assert batch.contains_stop.any() and (batch.response_lengths < response_length).any()
    if response_length == 40:
        assert batch.contains_stop.all(), "every row stopped: generate returned fewer than R steps"
    parts = (batch.queries, batch.query_mask, batch.responses, batch.response_mask)
    torch.testing.assert_close(batch.logprobs, logprobs_of(trainer.unwrapped.policy, parts, trainer.cfg.temperature), rtol=0,
                               atol=1e-5)
    assert (batch.logprobs[~batch.response_mask] == 0).all()


def test_the_rollouts_forwards_run_a_micro_batch_at_a_time_and_give_each_row_the_whole_chunks_numbers(
        make_policy, make_scorer_model, tokenizer, prompts):
    """The reference's log-probs and PPO's values are computed `per_device_train_batch_size` rows at a time (the
    peak memory is then the update's, not the rollout's): each row's numbers are those of one forward over the
    whole rollout chunk."""
    cfg = RLConfig(algo="ppo", per_device_train_batch_size=3, gradient_accumulation_steps=4,
                   local_rollout_forward_batch_size=12, response_length=6, temperature=0.7, num_epochs=1,
                   stop_token="eos", kl_coef=0.05)
    value, reference = make_scorer_model(1), make_policy(2).requires_grad_(False)
    trainer = RLTrainer(cfg, make_policy(), FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                        stop_token_id=1, value_model=value, ref_policy=reference)
    pieces = []
    original = reference.forward
    reference.forward = lambda *args, **kwargs: pieces.append(len(kwargs["input_ids"])) or original(*args, **kwargs)
    batch = trainer.rollout(range(12))
    reference.forward = original
    assert pieces == [3, 3, 3, 3], "the reference ran a micro-batch of rows at a time"
    parts = (batch.queries, batch.query_mask, batch.responses, batch.response_mask)
    with torch.no_grad():
        whole_ref = logprobs_of(reference, parts, cfg.temperature, share_prompts=True) * batch.response_mask
        whole_values = token_values(trainer.unwrapped.value, parts) * batch.response_mask
    torch.testing.assert_close(batch.ref_logprobs, whole_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.values, whole_values, rtol=0, atol=1e-6)


def shared_prompt_batch(prompts, k=3, response_length=6):
    """k samples of 4 prompts of different lengths (left padding differs), stop tokens at various places,
    and a prompt that is a left-padded copy of another's tail: the masks tell them apart."""
    rows = [prompts[0], prompts[1], prompts[2], [0, *prompts[2][1:]]]
    queries, query_mask = pad([p for p in rows for _ in range(k)], 0, "left")
    responses = torch.randint(2, TINY_VOCAB, (len(queries), response_length), generator=torch.Generator().manual_seed(1))
    responses[0, 2] = responses[4, 0] = responses[7, -1] = 1
    response_mask, contains_stop = stop_mask(responses, 1)
    responses = responses.masked_fill(~response_mask, 0)
    zeros = torch.zeros(responses.shape)
    return Rollout(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask,
                   logprobs=zeros, ref_logprobs=zeros, contains_stop=contains_stop)


def test_frozen_forwards_over_shared_prompts_equal_the_full_forwards(make_policy, make_scorer_model, prompts):
    """The reference log-probs and the reward of RLOO's k samples computed with each prompt once (a KV cache
    copied to its samples) equal the forwards over every full sequence."""
    batch = shared_prompt_batch(prompts)
    groups = distinct_prompts(batch.queries, batch.query_mask)
    assert groups is not None and len(groups[0]) == 4, "4 distinct prompts (one differs from another by its mask)"
    assert distinct_prompts(batch.queries[::3], batch.query_mask[::3]) is None
    policy, scorer = make_policy(), make_scorer_model()
    with torch.no_grad():
        torch.testing.assert_close(response_logits(policy, batch, 0.7, share_prompts=True),
                                   response_logits(policy, batch, 0.7), rtol=0, atol=1e-5)
    one_by_one = torch.cat([RewardModelScorer(scorer, batch_size=1)(batch[i:i + 1]) for i in range(len(batch))])
    torch.testing.assert_close(RewardModelScorer(scorer)(batch), one_by_one, rtol=0, atol=1e-5)


def test_training_forward_over_shared_prompts_has_the_full_forwards_gradients(make_policy, prompts):
    """The shared prompt's KV cache carries the gradient of all its samples: the same log-probs and parameter
    gradients as a forward over every full sequence."""
    batch = shared_prompt_batch(prompts)
    grads = []
    for share in (False, True):
        policy = make_policy()
        logprobs = ops.selective_log_softmax(response_logits(policy, batch, 0.7, share_prompts=share), batch.responses)
        (logprobs * batch.response_mask * torch.linspace(-1, 1, len(batch))[:, None]).sum().backward()
        grads.append((logprobs.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (full, full_grads), (shared, shared_grads) = grads
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def tiny_decoder_config(model_type: str):
    """A 2-layer model of `model_type` over the tiny vocabulary, random weights."""
    if model_type == "gpt2":
        config = AutoConfig.for_model("gpt2", vocab_size=TINY_VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=64)
    else:
        heads = {} if model_type == "gpt_neox" else {"num_key_value_heads": 2, "head_dim": 8}
        config = AutoConfig.for_model(model_type, vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, **heads)
    config.pad_token_id, config.bos_token_id, config.eos_token_id, config.num_labels = 0, None, 1, 1
    return config


def last_mlp_positions(model) -> list[int]:
    """The sequence length of every input the last decoder layer's MLP runs on, as they happen."""
    seen: list[int] = []
    mlp = [module for name, module in model.named_modules() if name.endswith("mlp")][-1]
    mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    return seen


@pytest.mark.parametrize("model_type", sorted(POSITIONWISE_MLP_MODELS))
def test_the_last_layers_mlp_runs_on_the_read_positions_only_and_every_read_value_is_the_models_own(model_type,
                                                                                                      prompts):
    """Log-probs, values and reward scores, over whole sequences and over shared prompts, equal the model's own
    full forward, while the last layer's MLP runs on the positions they read: the R + 1 last for logits and
    values, the R completion positions for a score, the prompt's last for generation, none for a prompt pass
    that only fills a KV cache."""
    torch.manual_seed(0)
    config = tiny_decoder_config(model_type)
    policy = AutoModelForCausalLM.from_config(config).eval()
    scorer = AutoModelForSequenceClassification.from_config(config).eval()
    batch = shared_prompt_batch(prompts)
    P, R = batch.queries.shape[1], batch.responses.shape[1]
    ids = torch.cat([batch.queries, batch.responses], dim=1)
    mask = torch.cat([batch.query_mask, batch.response_mask], dim=1)
    policy_seen, scorer_seen = last_mlp_positions(policy), last_mlp_positions(scorer)
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        hidden = getattr(scorer, scorer.base_model_prefix)(input_ids=ids, attention_mask=mask,
                                                           position_ids=position_ids(mask)).last_hidden_state
        values = scorer.score(hidden).squeeze(-1)
        assert policy_seen == scorer_seen == [P + R]
        for share in (False, True):
            torch.testing.assert_close(response_logits(policy, batch, 0.7, share_prompts=share),
                                       logits[:, P - 1:-1] / 0.7, rtol=0, atol=1e-5)
        torch.testing.assert_close(token_values(scorer, batch), values[:, P - 1:-1], rtol=0, atol=1e-5)
        last = batch.response_lengths - 1
        for share in (False, True):
            torch.testing.assert_close(completion_scores(scorer, batch_parts(batch), last, share_prompts=share),
                                       values[torch.arange(len(batch)), P + last], rtol=0, atol=1e-5)
    assert policy_seen[1:] == [R + 1, 1, R - 1], "whole sequences, then a shared prompt's last and the responses"
    assert scorer_seen[1:] == [R + 1, R, 0, R]

    del policy_seen[:]
    decode(policy, batch.queries, batch.query_mask, response_length=3, choice=TokenChoice(temperature=0.7),
           pad_token_id=0, stop_token_id=None)
    assert policy_seen == [1, 1, 1], "each shared prompt's prefill read at its last position, then one per step"


def batch_parts(batch: Rollout):
    return batch.queries, batch.query_mask, batch.responses, batch.response_mask


def test_the_mlp_cut_keeps_the_gradients_and_stays_off_where_it_cannot_hold(prompts):
    """Training through the cut gives the full forward's gradients; under gradient checkpointing (whose backward
    recomputes the layer) and for an architecture not known to have a position-wise MLP, the MLP runs whole."""
    batch = shared_prompt_batch(prompts)
    P, R = batch.queries.shape[1], batch.responses.shape[1]
    ids = torch.cat([batch.queries, batch.responses], dim=1)
    mask = torch.cat([batch.query_mask, batch.response_mask], dim=1)
    weights = torch.linspace(-1, 1, len(batch))[:, None]

    def gradients(model, logits):
        logprobs = ops.selective_log_softmax(logits, batch.responses)
        (logprobs * batch.response_mask * weights).sum().backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        model.zero_grad()
        return grads

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(tiny_decoder_config("llama"))
    seen = last_mlp_positions(policy)
    full = gradients(policy, policy(input_ids=ids, attention_mask=mask,
                                    position_ids=position_ids(mask)).logits[:, P - 1:-1] / 0.7)
    cut = gradients(policy, response_logits(policy, batch, 0.7))
    policy.gradient_checkpointing_enable()
    policy.train()
    checkpointed = gradients(policy, response_logits(policy, batch, 0.7))
    assert seen == [P + R, R + 1, P + R, P + R], "the checkpointed backward recomputes the whole layer"
    for name, grad in full.items():
        torch.testing.assert_close(cut[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    unknown = AutoModelForCausalLM.from_config(tiny_decoder_config("starcoder2"))
    assert "starcoder2" not in POSITIONWISE_MLP_MODELS
    seen = last_mlp_positions(unknown)
    response_logits(unknown, batch, 0.7)
    assert seen == [P + R]


def test_generation_prefills_each_shared_prompt_once_with_the_same_samples(make_policy, prompts):
    batch = shared_prompt_batch(prompts)
    keys = ops.episode_keys(0, 0, torch.arange(len(batch)), torch.zeros(len(batch), dtype=torch.long))
    kwargs = dict(response_length=8, choice=TokenChoice(temperature=0.7), pad_token_id=0, stop_token_id=1,
                  keep_logprobs=True)
    policy = make_policy()
    shared, shared_logprobs = decode(policy, batch.queries, batch.query_mask, noise_keys=keys, **kwargs)
    alone = [decode(policy, batch.queries[i:i + 1], batch.query_mask[i:i + 1], noise_keys=keys[i:i + 1], **kwargs)
             for i in range(len(batch))]  # one row per call: nothing shared
    assert torch.equal(shared, torch.cat([responses for responses, _ in alone]))
    lengths = stop_mask(shared, 1)[0].sum(1)  # after its stop token a row's log-probs are of no use
    for i, (_, logprobs) in enumerate(alone):
        torch.testing.assert_close(shared_logprobs[i, :lengths[i]], logprobs[0, :lengths[i]], rtol=0, atol=1e-5)


def test_growing_cache_decodes_as_the_dynamic_cache(make_policy, prompts):
    """GrowingCache appends in place into spare room: the same greedy tokens and logits as transformers' own
    DynamicCache, from an empty cache and from a prefilled one whose rows were reordered (RLOO's shared prompts)
    so that its first append must reallocate; its keys stay views of one buffer while there is room."""
    policy = make_policy()
    queries, query_mask = pad(prompts[:6], 0, "left")
    kwargs = dict(input_ids=queries, attention_mask=query_mask.long(), do_sample=False, max_new_tokens=9,
                  pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    expected = policy.generate(**kwargs, **{CACHE: DynamicCache()})
    cache = GrowingCache(queries.shape[1] + 9)
    got = policy.generate(**kwargs, **{CACHE: cache})
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-6)
    layer = cache.layers[0]
    assert layer.keys._base is layer._buffers[0] and layer._buffers[0].shape[2] == queries.shape[1] + 9

    small = GrowingCache(capacity=1)  # too small: grows by doubling, still exact
    policy(input_ids=queries, attention_mask=query_mask, position_ids=position_ids(query_mask), use_cache=True,
           **{CACHE: small})
    reordered = torch.tensor([2, 2, 0, 5, 1, 1])
    small.reorder_cache(reordered)  # a new tensor: the next append reallocates
    ids, mask = queries[reordered], query_mask[reordered]
    for token in (7, 8, 9):  # three appends into the cache; each step's logits as a full forward's
        ids = torch.cat([ids, torch.full((6, 1), token)], dim=1)
        mask = torch.cat([mask, torch.ones(6, 1, dtype=torch.bool)], dim=1)
        step = policy(input_ids=ids[:, -1:], attention_mask=mask, position_ids=position_ids(mask)[:, -1:],
                      use_cache=True, **{CACHE: small}).logits
        full = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -1:]
        torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
    assert small.layers[0].keys.shape[2] == queries.shape[1] + 3


def test_reward_model_scores_the_last_real_token(make_scorer_model):
    scorer = RewardModelScorer(make_scorer_model(5))
    queries, query_mask = pad([[3, 4, 5], [6, 7]], 0, "left")
    responses = torch.tensor([[8, 9, 1, 0, 0], [10, 1, 0, 0, 0]])
    base = scorer(make_batch(queries, query_mask, responses))

    changed_last = responses.clone()
    changed_last[0, 1] = 11  # the token before EOS ...
    changed_last[0, 2] = 1
    assert not torch.allclose(scorer(make_batch(queries, query_mask, changed_last))[0], base[0])

    garbage_after_stop = responses.clone()
    garbage_after_stop[:, 3:] = 12  # ids past the stop token never reach the score
    batch = make_batch(queries, query_mask, garbage_after_stop)
    torch.testing.assert_close(scorer(batch), base)

    more_left_padding = make_batch(torch.cat([torch.zeros(2, 3, dtype=torch.long), queries], 1),
                                   torch.cat([torch.zeros(2, 3, dtype=torch.bool), query_mask], 1), responses)
    torch.testing.assert_close(scorer(more_left_padding), base, rtol=1e-4, atol=1e-5)
    alone = scorer(make_batch(queries[1:], query_mask[1:], responses[1:]))
    torch.testing.assert_close(alone, base[1:], rtol=1e-4, atol=1e-5)


def test_reward_model_must_have_one_label(tiny_config):
    from transformers import GPTNeoXForSequenceClassification
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModelScorer(GPTNeoXForSequenceClassification(tiny_config))  # default num_labels=2


def test_function_and_weighted_scorers(tokenizer):
    queries, query_mask = pad([[3, 4], [5]], 0, "left")
    responses = torch.tensor([[7, 7, 1, 0], [7, 8, 9, 10]])
    batch = make_batch(queries, query_mask, responses)
    scorer = FunctionScorer(target_fraction, tokenizer)
    torch.testing.assert_close(scorer(batch), torch.tensor([1.0, 0.25]))  # EOS is a special token, skipped
    weighted = WeightedScorer([(2.0, scorer), (-1.0, FunctionScorer(lambda p, c: [len(x) for x in c], tokenizer))])
    torch.testing.assert_close(weighted(batch), torch.tensor([2.0 - 5, 0.5 - 12]))  # lengths of "w7 w7", "w7 w8 w9 w10"
    with pytest.raises(ValueError, match="returned 1 scores for 2"):
        FunctionScorer(lambda p, c: [0.0], tokenizer)(batch)


def test_missing_eos_penalty(tokenizer, prompts, make_policy):
    cfg = RLConfig(algo="rloo", per_device_train_batch_size=2, gradient_accumulation_steps=1, num_epochs=1,
                   local_rollout_forward_batch_size=2, missing_eos_penalty=1.5)
    trainer = RLTrainer(cfg, make_policy(), FunctionScorer(target_fraction, tokenizer), prompts,
                        pad_token_id=0, stop_token_id=1)
    queries, query_mask = pad([[3, 4], [5]], 0, "left")
    batch = trainer.score(make_batch(queries, query_mask, torch.tensor([[7, 7, 1, 0], [7, 8, 9, 10]])))
    torch.testing.assert_close(batch.scores, torch.tensor([1.0, 0.25 - 1.5]))


def test_config_is_validated_once_with_named_errors():
    with pytest.raises(pydantic.ValidationError, match="kl_estimator"):
        RLConfig(kl_estimator="k2")
    with pytest.raises(pydantic.ValidationError, match="extra_forbidden"):
        RLConfig(learning_rat=1e-5)
    cfg = RLConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.learning_rate = 1.0  # frozen
    with pytest.raises(ValueError, match="rloo.rloo_k: 48 is not divisible by 5"):
        BatchPlan.derive(RLConfig(algo="rloo", per_device_train_batch_size=12, rloo={"rloo_k": 5}))


def test_batch_plan_derivation():
    plan = BatchPlan.derive(RLConfig(algo="rloo", total_episodes=1000, per_device_train_batch_size=8,
                                     gradient_accumulation_steps=2, num_mini_batches=2, num_epochs=1,
                                     local_rollout_forward_batch_size=16, rloo={"rloo_k": 4}), num_processes=2)
    assert (plan.batch_size, plan.local_batch_size, plan.local_mini_batch_size, plan.local_prompts) == (64, 32, 16, 8)
    assert plan.num_updates == 16 and plan.num_optimizer_steps == 32


def test_prompt_sampler_shards_reshuffles_and_resumes():
    ranks = [PromptSampler(10, 2, seed=0, rank=r, num_processes=2) for r in range(2)]
    first = [s.next_indices() for s in ranks]
    assert not set(first[0]) & set(first[1]), "ranks draw disjoint prompts"
    second = [s.next_indices() for s in ranks]
    epoch = first[0] + first[1] + second[0] + second[1]
    assert len(set(epoch)) == 8, "no prompt repeats within an epoch"
    state = ranks[0].state_dict()
    expected = [ranks[0].next_indices() for _ in range(3)]
    restored = PromptSampler(10, 2, seed=0, rank=0, num_processes=2)
    restored.load_state_dict(state)
    assert [restored.next_indices() for _ in range(3)] == expected
    with pytest.raises(ValueError, match="cannot fill one update"):
        PromptSampler(3, 2, seed=0, num_processes=2)


def test_metric_accumulator_means_and_totals():
    metrics = MetricAccumulator()
    metrics.add("loss", torch.tensor(1.0))
    metrics.add("loss", torch.tensor(3.0))
    metrics.add_mean("score", torch.tensor([1.0, 2.0, 6.0]))
    metrics.add_total("eos", torch.tensor(5))
    assert metrics.reduce() == {"loss": 2.0, "score": 3.0, "eos": 5.0}
