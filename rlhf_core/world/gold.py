"""The demo world's gold reward: the key facts parsed from a prompt's text, and a completion scored against them.

`gold_breakdown` scores a completion against those facts; weights and reasons:

- coverage      +1.0 x mean over facts of the fraction of the fact's content words present. The job of
                a summary; partial credit gives RL a smooth signal.
- brevity       -0.05 per word beyond a budget of the facts' own words + 4 (room for connectives), so
                length hacking shows up in the gold score while a plain reference never pays.
- invented      -0.3 per distinct entity word (person, relation, place) absent from the post, and per
                stated event, outcome or ask that is not one of the post's facts (``my sister sold my
                old car`` when she spent the college fund, an ask the poster never asked): a
                hallucination is about as bad as missing a fact.
- distraction   -0.1 per distinct entity word taken from a distractor: true but irrelevant detail.
- repetition    -0.1 per repeated word bigram, the classic degeneration of RL-tuned policies.
- eos           -0.5 if generation stopped without EOS (the TRL TL;DR recipe's missing-EOS penalty).

The total is clipped to [-1, 1]; a reference summary scores exactly 1.0.

A completion that calls tools (the tool task, `WorldConfig.tool_task`) is scored on its final answer alone: what the
model wrote after its last tool call (`final_answer`). A tool result is the tool's words, not the model's: a summary
gets the looked-up outcome's coverage only by stating it.


Facts are recoverable from the prompt text alone, without any metadata: events, outcomes and asks come from
closed phrase lists that distractor templates never use (rlhf_core/world/vocabulary.py); a tool-task post's outcome
is in the case file it names, which the world's fixed directory holds (rlhf_core/world/tools.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

from rlhf_core.world.tokenizer import ROLE_TOKENS, TOOL_CALL_TOKENS
from rlhf_core.world.tools import CASE_ID_RE, case_outcome
from rlhf_core.world.vocabulary import DOMAINS, ENTITY_WORDS, Fact, listed_phrase, words

BREVITY_SLACK = 4
WEIGHTS = {"brevity": 0.05, "invented": 0.3, "distraction": 0.1, "repetition": 0.1, "eos": 0.5}


def _alternation(phrases: list[str]) -> str:
    return "|".join(re.escape(p) for p in sorted(set(phrases), key=lambda p: (-len(p), p)))


_INCIDENT_RE = re.compile(rf"\bmy (\w+) ({_alternation([e for d in DOMAINS for e in d.events])})\b")
_OUTCOME_RE = re.compile(rf"\b({_alternation([o for d in DOMAINS for o in d.outcomes])})\b")
_ASK_RE = re.compile(rf"\b({_alternation([a for d in DOMAINS for a in d.asks])})\b")
_ANY_FACT_RE = re.compile(
    rf"\b({_alternation([p for d in DOMAINS for p in d.events + d.outcomes + d.asks])})\b")


@functools.lru_cache(maxsize=4096)  # RL scores many completions per prompt
def parse_facts(prompt: str) -> tuple[Fact, ...]:
    """The key facts of a world prompt, from its text alone (first match of each kind in the POST body).

    A prompt from outside the world has no facts; every completion then gets zero coverage.
    """
    body = prompt.partition("POST:")[2].lower()
    facts = []
    if match := _INCIDENT_RE.search(body):
        facts.append(Fact("incident", f"my {match[1]} {match[2]}"))
    if match := _OUTCOME_RE.search(body):
        facts.append(Fact("outcome", match[1]))
    elif (match := CASE_ID_RE.search(body)) and (outcome := case_outcome(match[1])):
        facts.append(Fact("outcome", outcome))  # the tool task: the outcome is in the case file
    if match := _ASK_RE.search(body):
        facts.append(Fact("ask", match[1]))
    return tuple(facts)


@dataclass(frozen=True)
class GoldBreakdown:
    """Weighted components of the gold reward: coverage in [0, 1], each penalty <= 0."""

    coverage: float
    brevity: float
    invented: float
    distraction: float
    repetition: float
    eos: float

    @property
    def total(self) -> float:
        return max(-1.0, min(1.0, sum(dataclasses.astuple(self))))


def final_answer(completion: str) -> str:
    """What the model wrote after its last tool call: the text after the last </tool_call> and, in text rendered by
    the chat template, after the assistant header that follows the tool's result. Without calls, all of it."""
    _, called, after = completion.rpartition(TOOL_CALL_TOKENS[1])
    return after.rpartition(ROLE_TOKENS[2])[2] if called else completion


def gold_breakdown(prompt: str, completion: str, ended_with_eos: bool = True) -> GoldBreakdown:
    """Score `completion` as a summary of `prompt` against the facts parsed from the prompt."""
    facts = parse_facts(prompt)
    said = words(final_answer(completion))
    said_set = set(said)
    coverage = sum(sum(w in said_set for w in f.keywords) / len(f.keywords) for f in facts) / max(len(facts), 1)
    budget = BREVITY_SLACK + sum(len(words(f.phrase)) for f in facts)
    relevant = {w for f in facts for w in f.keywords}
    entities = (said_set & ENTITY_WORDS) - relevant
    invented = entities - set(words(prompt))
    # Fact phrases are matched on the word sequence, so punctuation never hides one.
    invented_facts = set(_ANY_FACT_RE.findall(" ".join(said))) - {listed_phrase(f) for f in facts}
    repeats = sum(n - 1 for n in Counter(pairwise(said)).values())
    return GoldBreakdown(
        coverage=coverage,
        brevity=-WEIGHTS["brevity"] * max(0, len(said) - budget),
        invented=-WEIGHTS["invented"] * (len(invented) + len(invented_facts)),
        distraction=-WEIGHTS["distraction"] * len(entities - invented),
        repetition=-WEIGHTS["repetition"] * repeats,
        eos=0.0 if ended_with_eos else -WEIGHTS["eos"],
    )


def gold_reward(prompt: str, completion: str, ended_with_eos: bool = True) -> float:
    """The gold reward in [-1, 1]; see the module docstring for its components."""
    return gold_breakdown(prompt, completion, ended_with_eos).total
