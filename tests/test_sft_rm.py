"""SFT and reward-model training on tiny real GPT-NeoX models: masks, scoring, losses, learning, seeds."""

import math

import pytest
import torch

from conftest import world_tokenizer
from rlhf_core.batching import pad
from rlhf_core.config import RewardConfig, SFTConfig
from rlhf_core.models import (
    init_causal_lm,
    init_sequence_scorer,
    reward_model_from_policy,
    tiny_gpt_neox_config,
)
from rlhf_core.reward_trainer import (
    encode_pairs,
    evaluate_reward_model,
    pair_collate,
    pair_scores,
    pairwise_loss,
    train_reward_model,
)
from rlhf_core.rollout import Rollout, backbone_hidden, distinct_prompts, position_ids
from rlhf_core.scoring import CompletionScores, RewardModelScorer
from rlhf_core.sft_trainer import (
    IGNORE_INDEX,
    encode_sft,
    evaluate_sft,
    greedy_completions,
    sft_collate,
    sft_loss,
    token_losses,
    train_sft,
)
from rlhf_core.world.config import WorldConfig
from rlhf_core.world.generator import build_world
from rlhf_core.world.gold import gold_reward

SLICE = WorldConfig(sft_train=256, sft_eval=32, prefs_train=256, prefs_eval=64, prompts_train=8,
                    prompts_eval=16)
FAST = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "logging_steps": 8}
RAMBLE = " anyway thanks for reading all of this, sorry that it turned into such a long story"


@pytest.fixture(scope="module")
def world():
    return build_world(seed=0, config=SLICE)


@pytest.fixture(scope="module")
def tokenizer(world):
    return world_tokenizer(world)


@pytest.fixture(scope="module")
def model_config(tokenizer):
    return tiny_gpt_neox_config(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=2,
                                intermediate_size=64)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ---------------------------------------------------------------------------------------- SFT


def test_sft_labels_are_the_completion_and_eos_only(world, tokenizer):
    row = world["sft_train"][0]
    (input_ids, labels), = encode_sft(tokenizer, [row], SFTConfig())
    prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
    completion = completion + [tokenizer.eos_token_id]
    assert input_ids == prompt + completion
    assert labels == [IGNORE_INDEX] * len(prompt) + completion


def test_sft_loss_is_the_cross_entropy_of_completion_tokens_only(world, tokenizer, model_config):
    model = init_causal_lm(model_config, seed=0).eval()
    rows = world["sft_train"][:2]
    batch = sft_collate(encode_sft(tokenizer, rows, SFTConfig()), tokenizer.pad_token_id)
    with torch.no_grad():
        losses = token_losses(model, batch)["loss"]
        expected = []
        for row in rows:  # by hand, one unpadded sequence at a time
            prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            target = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
            target = target + [tokenizer.eos_token_id]
            logits = model(input_ids=torch.tensor([prompt + target])).logits[0]  # (T, V)
            log_probs = logits[len(prompt) - 1:-1].log_softmax(-1)  # positions that predict the completion
            expected.append(-log_probs[torch.arange(len(target)), torch.tensor(target)])
    torch.testing.assert_close(losses, torch.cat(expected), atol=1e-5, rtol=1e-5)


class KeepLogits(torch.nn.Module):
    """A model whose output logits keep their gradient, to see which positions the loss reaches."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        out = self.model(**inputs)
        out.logits.retain_grad()
        self.logits = out.logits
        return out


def test_sft_loss_gets_no_gradient_from_prompt_or_padding_positions(world, tokenizer, model_config):
    model = KeepLogits(init_causal_lm(model_config, seed=0))
    batch = sft_collate(encode_sft(tokenizer, world["sft_train"][:2], SFTConfig()), tokenizer.pad_token_id)
    token_losses(model, batch)["loss"].sum().backward()
    touched = model.logits.grad.abs().sum(-1) > 0  # (B, N): the last N positions, those the LM head ran on
    predicts_completion = torch.zeros_like(batch["attention_mask"])  # (B, T)
    predicts_completion[:, :-1] = batch["labels"][:, 1:] != IGNORE_INDEX  # position t predicts token t+1
    N = touched.shape[1]
    assert N < batch["input_ids"].shape[1] / 2, "the LM head skips the prompt positions before the first completion"
    assert not predicts_completion[:, :-N].any()
    assert torch.equal(touched, predicts_completion[:, -N:])
    assert predicts_completion.sum() < batch["attention_mask"].sum() / 3  # most positions are prompt


def test_sft_token_losses_equal_the_cross_entropy_of_the_full_logits(world, tokenizer, model_config):
    model = init_causal_lm(model_config, seed=0)
    batch = sft_collate(encode_sft(tokenizer, world["sft_train"][:8], SFTConfig()), tokenizer.pad_token_id)
    with torch.no_grad():
        losses = token_losses(model, batch)["loss"]
        mask = batch["attention_mask"]
        logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask)).logits
    labels = batch["labels"][:, 1:].flatten()
    full = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels, ignore_index=IGNORE_INDEX,
                                             reduction="none")
    torch.testing.assert_close(losses, full[labels != IGNORE_INDEX], rtol=0, atol=1e-5)


def test_sft_lowers_held_out_loss(world, tokenizer, model_config):
    model = init_causal_lm(model_config, seed=0)
    cfg = SFTConfig(epochs=2, learning_rate=3e-3, **FAST)
    before = sft_loss(model, tokenizer, world["sft_eval"], cfg)
    result = train_sft(cfg, model, tokenizer, world["sft_train"], world["sft_eval"])
    assert result.metrics["eval/loss"] < before - 1.0
    assert [h["step"] for h in result.history if "eval/loss" in h] == [32, 64]
    assert result.history[0]["train/loss"] > result.history[-2]["train/loss"]


def test_sft_is_deterministic_in_the_seed(world, tokenizer, model_config):
    def run(seed):
        cfg = SFTConfig(epochs=1, seed=seed, **FAST)
        return train_sft(cfg, init_causal_lm(model_config, seed=0), tokenizer, world["sft_train"][:64],
                         world["sft_eval"][:8])

    first, again, other = run(0), run(0), run(1)
    assert torch.equal(params(first.model), params(again.model))
    assert first.history == again.history
    assert not torch.equal(params(first.model), params(other.model))  # the seed sets the data order


def test_gradient_accumulation_gives_the_same_update(world, tokenizer, model_config):
    """One optimizer step on 16 rows: 16 x 1 and 4 x 4 micro-batches accumulate the same gradient.

    The gradient norm is compared as well as the parameters: Adam's first step is nearly lr * sign(grad),
    blind to a mis-weighted mean.
    """
    def step(micro, accumulation):
        cfg = SFTConfig(epochs=1, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                        warmup_ratio=0.0, lr_scheduler="constant_with_warmup", max_grad_norm=1e9)
        return train_sft(cfg, init_causal_lm(model_config, seed=0), tokenizer, world["sft_train"][:16],
                         world["sft_eval"][:4])

    whole, split = step(16, 1), step(4, 4)
    assert split.history[0]["train/grad_norm"] == pytest.approx(whole.history[0]["train/grad_norm"], rel=1e-5)
    assert split.history[0]["train/loss"] == pytest.approx(whole.history[0]["train/loss"], rel=1e-5)
    torch.testing.assert_close(params(split.model), params(whole.model), atol=1e-5, rtol=1e-5)


def test_greedy_completions_do_not_depend_on_batch_padding(world, tokenizer, model_config):
    model = init_causal_lm(model_config, seed=0)
    prompts = [row["prompt"] for row in world["prompts_eval"][:6]]
    batched = greedy_completions(model, tokenizer, prompts, max_new_tokens=8, batch_size=6,
                                 max_prompt_length=256)
    alone = [greedy_completions(model, tokenizer, [p], max_new_tokens=8, batch_size=1,
                                 max_prompt_length=256)[0] for p in prompts]
    assert batched == alone


def test_evaluate_sft_reports_loss_eos_rate_and_optional_gold(world, tokenizer, model_config):
    model = init_causal_lm(model_config, seed=0)
    rows = world["prompts_eval"][:8]
    plain = evaluate_sft(model, tokenizer, rows, 4, 8)
    assert plain.keys() == {"eval/eos_rate", "eval/response_words"}
    full = evaluate_sft(model, tokenizer, rows, 4, 8, eval_rows=world["sft_eval"][:4], gold=gold_reward)
    assert 0.0 <= full["eval/eos_rate"] <= 1.0 and -1.0 <= full["eval/gold_reward"] <= 1.0
    assert full["eval/loss"] > 0


# ---------------------------------------------------------------------------------------- reward model


def easy_pairs(rows):
    """The preferred completion is the concise one; the rejected one rambles on."""
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"] + RAMBLE}
            for r in rows]


def test_pairwise_loss_matches_the_formula():
    chosen, rejected = torch.tensor([1.5, -0.3, 2.0]), torch.tensor([0.5, 0.7, 2.0])
    expected = [-math.log(1 / (1 + math.exp(-(c - r))))
                for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True)]
    torch.testing.assert_close(pairwise_loss(chosen, rejected), torch.tensor(expected))


def test_reward_is_read_at_the_last_real_token_whatever_the_padding(world, tokenizer, model_config):
    model = init_sequence_scorer(model_config, seed=0).eval()
    rows = easy_pairs(world["sft_train"][:4])
    examples = encode_pairs(tokenizer, rows, max_length=320)
    with torch.no_grad():
        together = pair_scores(model, pair_collate(examples, tokenizer.pad_token_id))
        alone = [pair_scores(model, pair_collate([ex], tokenizer.pad_token_id)) for ex in examples]
        chosen_ids = torch.tensor([sum(examples[0][0], [])])  # prompt + completion, unpadded, ends with EOS
        hidden = backbone_hidden(model, chosen_ids, torch.ones_like(chosen_ids))  # (1, T, H)
        by_hand = model.score(hidden[:, -1]).squeeze()
    torch.testing.assert_close(together[0], torch.cat([c for c, _ in alone]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[1], torch.cat([r for _, r in alone]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[0][0], by_hand, atol=1e-5, rtol=1e-5)
    assert examples[0][0][1][-1] == tokenizer.eos_token_id


def test_a_pairs_prompt_runs_once_with_the_full_forwards_scores_and_gradients(world, tokenizer, model_config):
    """Reward training runs a pair's prompt once for its two completions (a KV cache): the same scores and
    parameter gradients as a forward over each full sequence, also where max_length cut one side's prompt
    more than the other's (those rows then run their own prompts)."""
    rows = world["prefs_train"][:6]
    examples = encode_pairs(tokenizer, rows[:5], max_length=320) + encode_pairs(tokenizer, rows[5:], max_length=40)
    (cut_prompt, _), (other_prompt, _) = examples[-1]
    assert cut_prompt != other_prompt, "the last pair's prompts differ: its longer completion cut more prompt"
    batch = pair_collate(examples, tokenizer.pad_token_id)
    groups = distinct_prompts(batch["queries"], batch["query_mask"])
    assert groups is not None and len(groups[0]) == 7, "5 shared prompts + the cut pair's 2"
    results = []
    for share in (False, True):
        model = init_sequence_scorer(model_config, seed=0)
        chosen, rejected = pair_scores(CompletionScores(model, share_prompts=share), batch)
        pairwise_loss(chosen, rejected).sum().backward()
        results.append((torch.cat([chosen, rejected]).detach(), {n: p.grad for n, p in model.named_parameters()}))
    (full, full_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_reward_training_shares_prompts_unless_gradient_checkpointing_drops_the_cache(world, tokenizer, model_config,
                                                                                     monkeypatch):
    seen = []  # (checkpointing, shares prompts) of every training forward
    forward = CompletionScores.forward

    def recording(self, *args, **kwargs):
        if self.model.training:
            seen.append((self.model.is_gradient_checkpointing, self.share_prompts))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CompletionScores, "forward", recording)
    for checkpointing in (False, True):
        model = init_sequence_scorer(model_config, seed=0)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        train_reward_model(RewardConfig(**FAST), model, tokenizer, world["prefs_train"][:8], world["prefs_eval"][:4])
    assert set(seen) == {(False, True), (True, False)}


def test_training_scores_match_the_rl_scorer(world, tokenizer, model_config):
    """Training scores a pair as RewardModelScorer scores the same text as a rollout (left-padded prompt)."""
    model = init_sequence_scorer(model_config, seed=0).eval()
    rows = easy_pairs(world["sft_train"][:3])
    eos, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    completions = [tokenizer(r["chosen"], add_special_tokens=False)["input_ids"] + [eos] for r in rows]
    queries, query_mask = pad(prompts, pad_id, "left")  # (B, P)
    responses, response_mask = pad(completions, pad_id, "right")  # (B, R)
    zeros, stopped = torch.zeros(responses.shape), torch.ones(len(rows), dtype=torch.bool)
    rollout = Rollout(queries=queries, query_mask=query_mask, responses=responses,
                      response_mask=response_mask,
                      logprobs=zeros, ref_logprobs=zeros, contains_stop=stopped)
    with torch.no_grad():
        chosen, _ = pair_scores(model, pair_collate(encode_pairs(tokenizer, rows, 320), pad_id))
    torch.testing.assert_close(chosen, RewardModelScorer(model)(rollout), atol=1e-5, rtol=1e-5)


def test_reward_model_learns_an_easy_preference(world, tokenizer, model_config):
    model = init_sequence_scorer(model_config, seed=0)
    cfg = RewardConfig(epochs=1, learning_rate=1e-3, **FAST)
    eval_rows = easy_pairs(world["sft_eval"])
    before = evaluate_reward_model(model, tokenizer, eval_rows)
    result = train_reward_model(cfg, model, tokenizer, easy_pairs(world["sft_train"][:128]), eval_rows)
    assert result.metrics["eval/accuracy"] >= 0.9, (before, result.metrics)
    assert result.metrics["eval/margin"] > before["eval/margin"]


def test_reward_training_is_deterministic_in_the_seed(world, tokenizer, model_config):
    def run():
        cfg = RewardConfig(**FAST)
        return train_reward_model(cfg, init_sequence_scorer(model_config, seed=0), tokenizer,
                                  world["prefs_train"][:32], world["prefs_eval"][:8]).model

    assert torch.equal(params(run()), params(run()))


def test_gold_accuracy_compares_with_the_gold_ordering_and_skips_ties(world, tokenizer, model_config):
    model = init_sequence_scorer(model_config, seed=0)
    rows = world["prefs_eval"][:32]
    chosen = {row["prompt"]: row["chosen"] for row in rows}
    agrees = evaluate_reward_model(model, tokenizer, rows, gold=lambda p, c, ended: float(c == chosen[p]))
    reverse = evaluate_reward_model(model, tokenizer, rows, gold=lambda p, c, ended: float(c != chosen[p]))
    assert agrees["eval/gold_accuracy"] == agrees["eval/accuracy"]
    assert reverse["eval/gold_accuracy"] == pytest.approx(1 - agrees["eval/accuracy"])
    first = rows[0]  # the only pair whose gold rewards differ
    ties = evaluate_reward_model(model, tokenizer, rows,
                                 gold=lambda p, c, ended: float(p == first["prompt"] and c == first["chosen"]))
    with torch.no_grad():
        c, r = pair_scores(model, pair_collate(encode_pairs(tokenizer, [first], 320), tokenizer.pad_token_id))
    assert ties["eval/gold_accuracy"] == float(c.item() > r.item())


def test_reward_model_from_policy_shares_the_policy_backbone(tokenizer, model_config):
    policy = init_causal_lm(model_config, seed=0)
    scorer = reward_model_from_policy(policy, seed=3)
    ids = torch.tensor([tokenizer("TL;DR: my sister", add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    assert scorer.config.num_labels == 1
    with torch.no_grad():
        torch.testing.assert_close(backbone_hidden(scorer, ids, mask), backbone_hidden(policy, ids, mask))
    assert torch.equal(params(reward_model_from_policy(policy, seed=3)), params(scorer))  # seeded head
