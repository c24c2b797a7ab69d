"""The demo world: determinism, the gold reward, the datasets' contracts, and the tokenizer."""

import dataclasses
import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from conftest import world_tokenizer
from rlhf_core.world.config import WorldConfig
from rlhf_core.world.generator import build_world, misstated_pairs, reference_draft, sample_post, swap_fact
from rlhf_core.world.gold import gold_breakdown, gold_reward, parse_facts
from rlhf_core.world.vocabulary import Fact, words

SMALL = WorldConfig(sft_train=2000, sft_eval=50, prefs_train=2000, prefs_eval=50, prompts_train=100,
                    prompts_eval=50)
TRAIN_SPLITS = ("sft_train", "prefs_train", "prompts_train")
EVAL_SPLITS = ("sft_eval", "prefs_eval", "prompts_eval")

PROMPT = (
    "SUBREDDIT: r/personalfinance\n\nTITLE: need advice about my sister\n\n"
    "POST: for context i am 24 and live in ohio. last week my sister spent my college fund. "
    "my cousin sam loves fishing. in the end i froze my credit. honestly, should i cut them off?\n\nTL;DR:"
)
REFERENCE = " my sister spent my college fund and i froze my credit, should i cut them off?"


@pytest.fixture(scope="module")
def world():
    return build_world(seed=0, config=SMALL)


@pytest.fixture(scope="module")
def tokenizer(world):
    return world_tokenizer(world)


# ---- determinism and dataset contracts


def test_same_seed_gives_identical_world(world):
    assert json.dumps(build_world(seed=0, config=SMALL)) == json.dumps(world)


def test_different_seeds_give_different_worlds(world):
    other = build_world(seed=1, config=SMALL)
    for split in world:
        assert other[split] != world[split], split


def test_splits_have_the_configured_sizes_and_dataset_formats(world):
    sft, prefs = {"prompt", "completion"}, {"prompt", "chosen", "rejected"}
    keys = {"sft_train": sft, "sft_eval": sft, "prefs_train": prefs, "prefs_eval": prefs,
            "prompts_train": {"prompt"}, "prompts_eval": {"prompt", "reference"}}
    assert world.keys() == keys.keys()
    for split, rows in world.items():
        assert len(rows) == getattr(SMALL, split), split
        assert all(row.keys() == keys[split] for row in rows), split
        assert all(row["prompt"].startswith("SUBREDDIT: r/") and row["prompt"].endswith("\n\nTL;DR:") for row in rows)
        assert all(text.startswith(" ") for row in rows for key, text in row.items() if key != "prompt")


def test_no_eval_prompt_appears_in_a_train_split(world):
    train_prompts = {row["prompt"] for split in TRAIN_SPLITS for row in world[split]}
    eval_prompts = {row["prompt"] for split in EVAL_SPLITS for row in world[split]}
    assert len(eval_prompts) == sum(len(world[split]) for split in EVAL_SPLITS)
    assert not train_prompts & eval_prompts


def test_eval_splits_do_not_depend_on_train_sizes(world):
    bigger = build_world(seed=0, config=WorldConfig(**{**vars(SMALL), "sft_train": 2100}))
    for split in EVAL_SPLITS:
        assert bigger[split] == world[split], split


def test_sft_flaws_and_padding_are_as_configured(world):
    rows = world["sft_train"]
    imperfect = sum(gold_reward(r["prompt"], r["completion"]) < 1.0 for r in rows) / len(rows)
    expected = 1 - (1 - SMALL.sft_flawed_fraction) * (1 - SMALL.sft_padded_fraction)
    assert imperfect == pytest.approx(expected, abs=0.04)
    clean = build_world(seed=0, config=WorldConfig(sft_train=200, sft_flawed_fraction=0.0, sft_padded_fraction=0.0,
                                                   **_no_other_rows()))
    assert all(gold_reward(r["prompt"], r["completion"]) == 1.0 for r in clean["sft_train"])
    padded = build_world(seed=0, config=WorldConfig(sft_train=200, sft_flawed_fraction=0.0, sft_padded_fraction=1.0,
                                                    **_no_other_rows()))
    for row in padded["sft_train"]:  # every fact kept, but the padding costs gold reward
        breakdown = gold_breakdown(row["prompt"], row["completion"])
        assert breakdown.coverage == 1.0 and breakdown.total < 1.0, row


def test_preference_labels_agree_with_gold_up_to_label_noise(world):
    rows = world["prefs_train"]
    assert all(r["chosen"] != r["rejected"] for r in rows)
    agree = sum(gold_reward(r["prompt"], r["chosen"]) > gold_reward(r["prompt"], r["rejected"]) for r in rows)
    assert agree / len(rows) == pytest.approx(1 - SMALL.label_noise, abs=0.03)
    noiseless = build_world(seed=0, config=WorldConfig(prefs_train=200, label_noise=0.0, **_no_other_rows()))
    assert all(gold_reward(r["prompt"], r["chosen"]) > gold_reward(r["prompt"], r["rejected"])
               for r in noiseless["prefs_train"])


def test_config_rejects_out_of_range_values():
    with pytest.raises(AssertionError, match="label_noise"):
        WorldConfig(label_noise=1.5)
    with pytest.raises(AssertionError, match="sft_train"):
        WorldConfig(sft_train=-1)


def _no_other_rows() -> dict[str, int]:
    return {"sft_eval": 0, "prefs_eval": 0, "prompts_train": 0, "prompts_eval": 0}


# ---- facts and the gold reward


def test_facts_are_recovered_from_the_prompt_text_alone():
    rng = random.Random(0)
    for _ in range(2000):
        post = sample_post(rng)
        assert parse_facts(post.prompt) == post.facts, post.prompt


def test_references_of_generated_posts_score_exactly_one():
    rng = random.Random(0)
    for _ in range(2000):
        post = sample_post(rng)
        reference = reference_draft(post, rng).render()
        assert gold_breakdown(post.prompt, reference).total == 1.0, (post.prompt, reference)


def test_hand_written_prompt_parses_to_its_facts():
    assert parse_facts(PROMPT) == (
        Fact("incident", "my sister spent my college fund"),
        Fact("outcome", "i froze my credit"),
        Fact("ask", "should i cut them off"),
    )


@pytest.mark.parametrize(
    ("completion", "penalized"),
    [
        (" my sister spent my college fund and i froze my credit", "coverage"),
        (" my sister and riley spent my college fund and i froze my credit, should i cut them off?", "invented"),
        (" my sister spent my college fund, i froze my credit in boston, should i cut them off?", "invented"),
        (" my brother spent my college fund and i froze my credit, should i cut them off?", "invented"),
        (" my sister sold my old car and i froze my credit, should i cut them off?", "invented"),
        (" my sister spent my college fund and i lost my savings, should i cut them off?", "invented"),
        (" my sister spent my college fund and i froze my credit, should i report them?", "invented"),
        (" my sister spent my college fund, my cousin sam loves fishing, i froze my credit, should i cut them off?",
         "distraction"),
        (" my sister spent my college fund and i froze my credit and i froze my credit, should i cut them off?",
         "repetition"),
        (" my sister spent my college fund and i froze my credit, should i cut them off? it has been a really long "
         "and stressful week for everyone involved here", "brevity"),
    ],
)
def test_each_flaw_lowers_its_component_and_the_total(completion, penalized):
    reference, flawed = gold_breakdown(PROMPT, REFERENCE), gold_breakdown(PROMPT, completion)
    assert reference.total == 1.0
    assert getattr(flawed, penalized) < getattr(reference, penalized)
    assert flawed.total < reference.total - 0.05


def test_an_ask_the_poster_never_asked_is_invented():
    prompt = PROMPT.replace(" honestly, should i cut them off?", "")
    no_ask = " my sister spent my college fund and i froze my credit"
    assert gold_reward(prompt, no_ask) == 1.0
    assert gold_breakdown(prompt, no_ask + ", should i cut them off?").invented == pytest.approx(-0.3)


def test_swapped_facts_are_plausible_but_never_in_the_post():
    rng = random.Random(0)
    for _ in range(500):
        post = sample_post(rng)
        reference = reference_draft(post, rng)
        swapped = swap_fact(post, reference, rng).render()
        assert swapped != reference.render()
        assert gold_breakdown(post.prompt, swapped).invented <= -0.3, (post.prompt, swapped)


def test_misstated_probe_pairs_prefer_the_reference():
    rows = misstated_pairs(seed=0, n=100, exclude={PROMPT})
    assert rows == misstated_pairs(seed=0, n=100)
    assert len({r["prompt"] for r in rows}) == 100
    for row in rows:
        assert gold_reward(row["prompt"], row["chosen"]) == 1.0
        assert gold_breakdown(row["prompt"], row["rejected"]).invented <= -0.3


def test_misstated_pair_fraction_makes_hard_negative_pairs():
    config = WorldConfig(prefs_train=200, label_noise=0.0, misstated_pair_fraction=1.0, **_no_other_rows())
    for row in build_world(seed=0, config=config)["prefs_train"]:
        chosen, rejected = gold_breakdown(row["prompt"], row["chosen"]), gold_breakdown(row["prompt"], row["rejected"])
        assert rejected.invented < chosen.invented, row


def test_a_completion_that_never_stopped_pays_the_missing_eos_penalty_and_nothing_else(world):
    """Over the world's own texts (SFT drafts, flawed ones included, chosen and rejected answers): the same text
    scores lower when generation ran out before EOS, through the breakdown's eos term alone (coverage and every other
    penalty unchanged), by one penalty whatever the text, unless the total already sits at the floor of -1."""
    rows = [(row["prompt"], row[key]) for split, keys in (("sft_eval", ("completion",)),
                                                          ("prefs_eval", ("chosen", "rejected")))
            for row in world[split] for key in keys]
    penalties = set()
    for prompt, completion in rows:
        stopped, ran_on = gold_breakdown(prompt, completion), gold_breakdown(prompt, completion, ended_with_eos=False)
        assert stopped.eos == 0.0 and dataclasses.replace(ran_on, eos=0.0) == stopped, (completion, stopped, ran_on)
        assert gold_reward(prompt, completion, ended_with_eos=False) == ran_on.total
        assert ran_on.total < stopped.total or stopped.total == -1.0, (completion, stopped.total, ran_on.total)
        if ran_on.total > -1.0:
            penalties.add(round(stopped.total - ran_on.total, 9))
    assert len(penalties) == 1 and penalties.pop() > 0, "one penalty, whatever was said"


def test_the_gold_monitor_reads_the_stop_from_the_rollout_not_from_the_text(tokenizer):
    """GoldScorer, the gold reward training logs: two episodes decode to the same reference; one emitted EOS, the
    other ran out of tokens. Only the second pays the missing-EOS penalty."""
    from rlhf_core.rollout import Rollout
    from rlhf_core.scoring import GoldScorer

    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    said = tokenizer(REFERENCE, add_special_tokens=False)["input_ids"]
    responses = torch.tensor([said + [tokenizer.eos_token_id], said + [tokenizer.pad_token_id]])  # (2, R)
    response_mask = torch.ones_like(responses, dtype=torch.bool)
    response_mask[1, -1] = False  # the second ran out at R - 1 tokens: no stop token, pad after
    batch = Rollout(queries=torch.tensor([prompt, prompt]), query_mask=torch.ones(2, len(prompt), dtype=torch.bool),
                    responses=responses, response_mask=response_mask, logprobs=torch.zeros(responses.shape),
                    ref_logprobs=torch.zeros(responses.shape), contains_stop=torch.tensor([True, False]))
    scores = GoldScorer(gold_reward, tokenizer)(batch).tolist()
    assert scores == pytest.approx([gold_reward(PROMPT, REFERENCE), gold_reward(PROMPT, REFERENCE, ended_with_eos=False)])
    assert scores[0] == pytest.approx(1.0) and scores[1] < scores[0]


@pytest.mark.parametrize(
    "completion",
    ["", "   ", "?!.,", "\x00\n\t漢字 ünïcödé", "TL;DR: SUBREDDIT: POST:", "[EOS][PAD]", " the the the the " * 200,
     " " + " ".join(["riley boston aunt"] * 50)],
)
def test_garbage_completions_score_low_without_raising(completion):
    assert -1.0 <= gold_reward(PROMPT, completion, ended_with_eos=False) <= 0.0
    assert gold_reward(PROMPT, completion) <= 0.0


def test_prompts_from_outside_the_world_give_zero_coverage():
    assert parse_facts("not a tldr prompt") == ()
    assert gold_breakdown("", " anything at all").coverage == 0.0


# ---- tokenizer


def test_tokenizer_special_tokens_and_defaults(tokenizer):
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token) == ("[PAD]", "[EOS]", "[UNK]")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "right"
    assert tokenizer.eos_token_id not in tokenizer(REFERENCE).input_ids


def test_tokenizer_round_trips_world_text_without_unknown_tokens(world, tokenizer):
    for row in world["sft_train"][:200] + world["prompts_eval"]:
        for text in row.values():
            ids = tokenizer(text).input_ids
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text
        completion = row.get("completion", row.get("reference"))
        joined = tokenizer(row["prompt"] + completion).input_ids
        assert joined == tokenizer(row["prompt"]).input_ids + tokenizer(completion).input_ids
    assert len(tokenizer) <= 2048
    assert len(tokenizer(REFERENCE).input_ids) <= len(words(REFERENCE)) + 3  # ~ one token per word


def test_tokenizer_save_and_load(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded(PROMPT + REFERENCE).input_ids == tokenizer(PROMPT + REFERENCE).input_ids
    assert loaded.decode(loaded(PROMPT).input_ids) == PROMPT


# ---- the tool task: the outcome is in a case file only `lookup_case` reads

TOOL_WORLD = WorldConfig(sft_train=400, sft_eval=16, prefs_train=400, prefs_eval=16, prompts_train=16, prompts_eval=16,
                         tool_task=True)


@pytest.fixture(scope="module")
def tool_world():
    return build_world(seed=0, config=TOOL_WORLD)


def post_text(row: dict) -> str:
    return row["prompt"][-1]["content"]


def test_a_tool_task_post_names_a_case_file_instead_of_its_outcome():
    """The post never says its outcome; the file it names holds it, `lookup_case` reads it, and the gold reward's
    facts, parsed from the text alone, are still the post's (the directory is the world's, fixed)."""
    from rlhf_core.world.tools import CASE_ID_RE, case_outcome, lookup_case

    rng = random.Random(0)
    for _ in range(500):
        post = sample_post(rng, tool_task=True)
        outcome = next(f.phrase for f in post.facts if f.kind == "outcome")
        assert outcome not in post.prompt and CASE_ID_RE.search(post.prompt)[1] == post.case_id
        assert case_outcome(post.case_id) == outcome and lookup_case(post.case_id) == f" {outcome}"
        assert parse_facts(post.prompt) == post.facts, post.prompt
        reference = reference_draft(post, rng).render()
        assert gold_breakdown(post.prompt, reference).total == 1.0
        unread = gold_breakdown(post.prompt, reference.replace(outcome, ""))
        assert unread.coverage < 1.0, "without the file, a summary misses the outcome"
    assert lookup_case("12") == " no case file 12" and case_outcome("0999") is None


def test_the_tool_task_rows_teach_the_call_in_trl_tool_calling_layout(tool_world):
    """Every row is a conversation with a `tools` column (lookup_case's schema, as the template renders the function
    itself); an SFT completion calls lookup_case on its post's file, gets the file as a tool message, then
    summarizes; a fifth of the demonstrators skip the lookup and leave the outcome out."""
    from transformers.utils import get_json_schema

    from rlhf_core import chat
    from rlhf_core.world.tools import CASE_ID_RE, lookup_case, tool_schemas

    assert tool_schemas() == [get_json_schema(lookup_case)]
    for split, rows in tool_world.items():
        assert all(chat.is_conversation(r["prompt"]) and r["tools"] == tool_schemas() for r in rows), split
    called = 0
    for row in tool_world["sft_train"]:
        messages, case_id = row["completion"], CASE_ID_RE.search(post_text(row))[1]
        if len(messages) == 3:
            called += 1
            [call] = messages[0]["tool_calls"]
            assert call == {"type": "function", "function": {"name": "lookup_case", "arguments": {"case_id": case_id}}}
            assert messages[1] == {"role": "tool", "name": "lookup_case", "content": lookup_case(case_id)}
        outcome = next(f.phrase for f in parse_facts(post_text(row)) if f.kind == "outcome")
        assert chat.roles(messages[-1:]) == "assistant"
        assert len(messages) == 3 or outcome not in messages[-1]["content"]
    assert called / len(tool_world["sft_train"]) == pytest.approx(0.8, abs=0.05)
    chosen_better = sum(gold_reward(post_text(r), r["chosen"][-1]["content"])
                        > gold_reward(post_text(r), r["rejected"][-1]["content"]) for r in tool_world["prefs_train"])
    assert chosen_better / len(tool_world["prefs_train"]) == pytest.approx(1 - TOOL_WORLD.label_noise, abs=0.04)


def test_the_tool_task_leaves_the_default_world_as_it_was(world):
    """Same seed, tool task off: the rows are those of a world built without knowing the task (and the tool world's
    own rows differ)."""
    assert build_world(seed=0, config=dataclasses.replace(SMALL, tool_task=False)) == world
    assert all(r["prompt"].startswith("SUBREDDIT: r/") for r in world["prompts_eval"])


def test_gold_scores_the_answer_after_the_last_tool_call():
    """The file's words are the tool's, not the model's: a completion is scored on what follows its last call, in the
    text the chat template renders (role headers in it) and in what the policy wrote (tool results left out)."""
    from rlhf_core.world.gold import final_answer

    call = '<tool_call>{"name": "lookup_case", "arguments": {"case_id": "4811"}}</tool_call>'
    rendered = f"{call}[EOS]<|tool|> i froze my credit<|assistant|>{REFERENCE}"
    assert final_answer(rendered) == final_answer(call + REFERENCE) == REFERENCE
    assert final_answer(REFERENCE) == REFERENCE
    assert gold_reward(PROMPT, rendered) == gold_reward(PROMPT, call + REFERENCE) == 1.0
    assert gold_breakdown(PROMPT, f"{call}[EOS]<|tool|> i froze my credit<|assistant|> my sister").coverage < 0.5


def test_the_gold_monitor_leaves_tool_results_out(tokenizer):
    """GoldScorer on a multi-turn rollout: the tool's result (tool mask 0) is not read, so the file's words give no
    coverage; the reward-model side (`decode_texts` as it is) still reads them."""
    from rlhf_core.rollout import Rollout
    from rlhf_core.scoring import GoldScorer, decode_texts

    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    result = tokenizer(" i froze my credit", add_special_tokens=False)["input_ids"]
    unread = " my sister spent my college fund, should i cut them off?"  # the answer, without the file's outcome
    answer = tokenizer(unread, add_special_tokens=False)["input_ids"]
    responses = torch.tensor([result + answer + [tokenizer.eos_token_id]])  # (1, R): the result, then the answer
    tool_mask = torch.tensor([[False] * len(result) + [True] * (len(answer) + 1)])
    batch = Rollout(queries=torch.tensor([prompt]), query_mask=torch.ones(1, len(prompt), dtype=torch.bool),
                    responses=responses, response_mask=torch.ones_like(responses, dtype=torch.bool),
                    logprobs=torch.zeros(responses.shape), ref_logprobs=torch.zeros(responses.shape),
                    contains_stop=torch.tensor([True]), tool_mask=tool_mask)
    [score] = GoldScorer(gold_reward, tokenizer)(batch).tolist()
    assert score == pytest.approx(gold_reward(PROMPT, unread))
    assert score < gold_reward(PROMPT, REFERENCE)
    assert "i froze my credit" in decode_texts(tokenizer, batch)[1][0]


def test_every_tool_task_answer_says_something(tool_world):
    """An answer that skips the lookup after a dropped fact still states something (validation refuses blank
    messages)."""
    answers = [m for split in ("sft_train", "prefs_train") for row in tool_world[split]
               for column in ("completion", "chosen", "rejected") if column in row for m in row[column]]
    assert all(m.get("tool_calls") or m["content"].strip() for m in answers)
