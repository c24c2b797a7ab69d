"""Greedy evaluation: win rates, exact KL, EOS rate, per-example rows."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_core.greedy_eval import evaluate, greedy_rollout, sequence_kl
from rlhf_core.scoring import FunctionScorer

PROMPTS = ["w3 w4 w5", "w6", "w2 w9 w9 w2", "w11 w12"]


def word_count_gold(prompt: str, completion: str, ended_with_eos: bool) -> float:
    return len(completion.split()) - (0.0 if ended_with_eos else 1.0)


def test_policy_against_itself_ties_with_zero_kl(make_policy, tokenizer):
    policy = make_policy()
    scorer = FunctionScorer(lambda p, c: [float(c.count("w7")) for c in c], tokenizer)
    report = evaluate(policy, copy.deepcopy(policy), tokenizer, PROMPTS, scorer=scorer, response_length=6,
                      temperature=0.7, gold=word_count_gold, batch_size=3)
    s = report.summary
    assert s["win_rate_rm"] == 0.5 and s["win_rate_gold"] == 0.5
    assert s["mean_kl"] == pytest.approx(0.0, abs=1e-6)
    assert s["mean_score_rm"] == s["ref_mean_score_rm"] and s["eos_rate"] == s["ref_eos_rate"]
    assert len(report.rows) == len(PROMPTS)
    assert all(r["completion"] == r["ref_completion"] for r in report.rows)


def test_different_policy_has_positive_kl_and_consistent_rows(make_policy, tokenizer):
    policy, reference = make_policy(0), make_policy(7)
    scorer = FunctionScorer(lambda p, c: [float(len(c.split())) for c in c], tokenizer)
    report = evaluate(policy, reference, tokenizer, PROMPTS, scorer=scorer, response_length=6, temperature=1.0,
                      gold=word_count_gold)
    assert report.summary["mean_kl"] > 0
    wins = [(r["score_rm"] > r["ref_score_rm"]) + 0.5 * (r["score_rm"] == r["ref_score_rm"]) for r in report.rows]
    assert report.summary["win_rate_rm"] == pytest.approx(sum(wins) / len(wins))
    eos = [r["eos"] for r in report.rows]
    assert report.summary["eos_rate"] == pytest.approx(sum(eos) / len(eos))


def test_greedy_rollout_is_deterministic_and_batch_independent(make_policy, tokenizer):
    policy = make_policy()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    a = greedy_rollout(policy, ids, response_length=6, pad_token_id=0, stop_token_id=1, batch_size=4)
    b = greedy_rollout(policy, ids, response_length=6, pad_token_id=0, stop_token_id=1, batch_size=1)
    assert torch.equal(a.responses, b.responses)
    kl = sequence_kl(policy, make_policy(3), a, temperature=1.0)
    assert kl.shape == (len(PROMPTS),) and (kl >= 0).all()
