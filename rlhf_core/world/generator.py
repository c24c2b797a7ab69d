"""The demo world: synthetic Reddit TL;DR posts whose gold reward we know.

A post is rendered exactly like the prompts of `trl-lib/tldr` and the cleanrl TL;DR datasets
(``SUBREDDIT: r/<x>\\n\\nTITLE: <title>\\n\\nPOST: <body>\\n\\nTL;DR:``) and a summary is a completion that
starts with a space. Each post is about one person in the poster's life and carries 2-3 KEY FACTS:

- incident (always):  who did what, ``my sister spent my college fund``
- outcome (always):   how it ended, ``i froze my credit``
- ask (60% of posts): what the poster asks, ``should i cut them off``

hidden among 3-5 DISTRACTOR sentences (small talk that mentions other people and places).

Facts are recoverable from the prompt text alone, without any metadata: events, outcomes and asks come
from closed phrase lists that distractor templates never use, so `parse_facts` finds each fact by exact
phrase match in the POST body, and the incident's subject is the word between ``my`` and the event.

The gold reward of a summary is in rlhf_core/world/gold.py. Datasets are lists of plain dicts in the formats of
the real datasets, so the same loaders read both.

The tool task (`WorldConfig.tool_task`): a post names a case file instead of telling its outcome, and only the
`lookup_case` tool reads the file (rlhf_core/world/tools.py). Rows are conversations with TRL's `tools` column; an
answer is the call, the tool's message and the summary (`tool_answer`), or, for the demonstrators and candidates that
skip the lookup (SKIP_LOOKUP_PROBABILITY), the summary alone without the outcome it could not know.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from rlhf_core.world.config import WorldConfig
from rlhf_core.world.gold import gold_reward
from rlhf_core.world.tools import draw_case_id, lookup_case, tool_schemas
from rlhf_core.world.vocabulary import (
    ASK_SENTENCES,
    CASE_SENTENCES,
    DAYS,
    DISTRACTOR_RELATIONS,
    DISTRACTORS,
    DOMAINS,
    HOBBIES,
    INCIDENT_SENTENCES,
    NAMES,
    OUTCOME_SENTENCES,
    PLACES,
    RAMBLES,
    TIMES,
    TITLES,
    Fact,
    listed_phrase,
    words,
)

ASK_PROBABILITY = 0.6
SKIP_LOOKUP_PROBABILITY = 0.2  # tool task: SFT demonstrations and preference candidates that answer unlooked-up
SYSTEM_PROMPT = "Summarize the post in one line."  # the conversational variant's system message


@dataclass(frozen=True)
class Post:
    """A generated post, with the facts and distractors it was built from (`parse_facts` recovers the facts)."""

    subreddit: str
    title: str
    body: tuple[str, ...]  # sentences: the fact sentences in order, distractors interleaved
    facts: tuple[Fact, ...]
    distractors: tuple[str, ...]  # distractor clauses as a summary would quote them
    case_id: str | None = None  # the tool task: the case file holding the outcome, which the post does not tell

    @property
    def prompt(self) -> str:
        return f"SUBREDDIT: r/{self.subreddit}\n\nTITLE: {self.title}\n\nPOST: {' '.join(self.body)}\n\nTL;DR:"


def _fill(template: str, rng: random.Random, **slots: str) -> str:
    """Fill `template`, drawing each slot not given from its closed vocabulary."""
    pools = {"time": TIMES, "name": NAMES, "place": PLACES, "hobby": HOBBIES, "day": DAYS,
             "age": tuple(str(a) for a in range(19, 41))}
    fields = re.findall(r"{(\w+)}", template)
    return template.format(**{f: slots[f] if f in slots else rng.choice(pools[f]) for f in fields})


def sample_post(rng: random.Random, tool_task: bool = False) -> Post:
    """Draw one post: 2-3 facts about one relation, 3-5 distractors about other people, shuffled in. With
    `tool_task`, the outcome is not told: the post's last sentence names the case file that holds it."""
    domain = rng.choice(DOMAINS)
    relation = rng.choice(domain.relations)
    facts = [Fact("incident", f"my {relation} {rng.choice(domain.events)}"),
             Fact("outcome", rng.choice(domain.outcomes))]
    if rng.random() < ASK_PROBABILITY:
        facts.append(Fact("ask", rng.choice(domain.asks)))
    templates = {"incident": INCIDENT_SENTENCES, "outcome": OUTCOME_SENTENCES, "ask": ASK_SENTENCES}
    case_id = draw_case_id(facts[1].phrase, rng) if tool_task else None
    told = [f for f in facts if case_id is None or f.kind != "outcome"]  # the tool task's outcome is in the file
    fact_sentences = [_fill(rng.choice(templates[f.kind]), rng, fact=f.phrase) for f in told]
    others = [r for r in DISTRACTOR_RELATIONS if r != relation]
    distractors = [_fill(rng.choice(DISTRACTORS), rng, relation=rng.choice(others))
                   for _ in range(rng.randint(3, 5))]
    # Facts keep their order (incident, outcome, ask); distractors fill the remaining slots.
    slots = set(rng.sample(range(len(told) + len(distractors)), len(told)))
    fact_iter, distractor_iter = iter(fact_sentences), iter(d + "." for d in distractors)
    body = tuple(next(fact_iter) if i in slots else next(distractor_iter)
                 for i in range(len(told) + len(distractors)))
    if case_id is not None:  # last, where a post would point at more: the number sits just before the answer
        body += (_fill(rng.choice(CASE_SENTENCES), rng, case=case_id),)
    title = rng.choice(TITLES).format(relation=relation)
    return Post(domain.subreddit, title, body, tuple(facts), tuple(distractors), case_id)


# ----------------------------------------------------------------------------------------------------
# Summaries: the reference, and perturbations of it. A draft is the summary's statements (incident,
# outcome, extra clauses) plus the ask, rendered as ``" s1 and s2, ask?"``.


@dataclass(frozen=True)
class Draft:
    """A summary before rendering, so that perturbations compose."""

    statements: tuple[str, ...]
    ask: str | None
    joiner: str  # between statements: " and " or ", "

    def render(self) -> str:
        text = self.joiner.join(self.statements)
        if self.ask:
            text = f"{text}, {self.ask}?" if text else f"{self.ask}?"
        return " " + text


def reference_draft(post: Post, rng: random.Random) -> Draft:
    asks = [f.phrase for f in post.facts if f.kind == "ask"]
    statements = tuple(f.phrase for f in post.facts if f.kind != "ask")
    return Draft(statements, asks[0] if asks else None, rng.choice((" and ", ", ")))


def drop_fact(post: Post, draft: Draft, rng: random.Random) -> Draft:
    if draft.ask and rng.random() < 0.5:
        return dataclasses.replace(draft, ask=None)
    drop = rng.randrange(len(draft.statements))
    return dataclasses.replace(draft, statements=draft.statements[:drop] + draft.statements[drop + 1:])


def swap_fact(post: Post, draft: Draft, rng: random.Random) -> Draft:
    """Misstate one fact with a plausible one of the same subreddit that the post does not say: another
    person (``my brother`` for ``my sister``), event, outcome or ask, or an ask the poster never asked."""
    domain = next(d for d in DOMAINS if d.subreddit == post.subreddit)
    said = f" {' '.join(words(post.prompt))} "
    true = {f.phrase for f in post.facts}  # a tool-task post does not say its outcome: still no misstatement

    def unsaid(pool: tuple[str, ...]) -> list[str]:
        return [p for p in pool if f" {p} " not in said and p not in true]

    kind = rng.choice(("incident", "outcome", "ask"))
    if kind == "ask":
        return dataclasses.replace(draft, ask=rng.choice(unsaid(domain.asks)))
    old = next(f.phrase for f in post.facts if f.kind == kind)
    if old not in draft.statements:  # dropped already: state a wrong ask instead
        return dataclasses.replace(draft, ask=rng.choice(unsaid(domain.asks)))
    if kind == "outcome":
        new = rng.choice(unsaid(domain.outcomes))
    elif rng.random() < 0.5:
        relation = old.split()[1]
        new = old.replace(f"my {relation}", f"my {rng.choice(unsaid(domain.relations))}", 1)
    else:
        new = old.replace(listed_phrase(post.facts[0]), rng.choice(unsaid(domain.events)), 1)
    return dataclasses.replace(draft, statements=tuple(new if s == old else s for s in draft.statements))


def add_distractor(post: Post, draft: Draft, rng: random.Random) -> Draft:
    return dataclasses.replace(draft, statements=(*draft.statements, rng.choice(post.distractors)))


def invent_entity(post: Post, draft: Draft, rng: random.Random) -> Draft:
    """Name someone the post never mentions: ``my sister and riley spent ...``."""
    name = rng.choice([n for n in NAMES if n not in words(post.prompt)])
    incident = post.facts[0].phrase
    if incident not in draft.statements:
        return dataclasses.replace(draft, statements=(*draft.statements, f"{name} was there too"))
    relation = incident.split()[1]
    named = incident.replace(f"my {relation}", f"my {relation} and {name}", 1)
    return dataclasses.replace(draft, statements=tuple(named if s == incident else s for s in draft.statements))


def repeat(post: Post, draft: Draft, rng: random.Random) -> Draft:
    return dataclasses.replace(draft, statements=(*draft.statements, rng.choice(draft.statements)))


def ramble(post: Post, draft: Draft, rng: random.Random) -> Draft:
    return dataclasses.replace(draft, statements=(*draft.statements, rng.choice(RAMBLES)))


Perturbation = Callable[[Post, Draft, random.Random], Draft]
# Applied in this order when combined, so a named entity is never dropped by a later perturbation.
PERTURBATIONS: tuple[Perturbation, ...] = (drop_fact, invent_entity, add_distractor, repeat, ramble)
# Content errors of some SFT demonstrations; SFT data never repeats itself: degenerate repetition is what RL,
# not imitation, tends to produce.
SFT_FLAWS: tuple[Perturbation, ...] = (drop_fact, invent_entity)
# How demonstrators pad a summary: small talk from the post, or a ramble.
SFT_PADDING: tuple[Perturbation, ...] = (add_distractor, ramble)


def perturbed_draft(post: Post, rng: random.Random, perturbations: tuple[Perturbation, ...]) -> Draft:
    draft = reference_draft(post, rng)
    for perturb in perturbations:
        draft = perturb(post, draft, rng)
    return draft


def candidate_draft(post: Post, rng: random.Random) -> Draft:
    """A summary of varying quality for preference data: the reference with 0-2 perturbations."""
    k = rng.choice((0, 1, 1, 2))
    chosen = sorted(rng.sample(range(len(PERTURBATIONS)), k))
    return perturbed_draft(post, rng, tuple(PERTURBATIONS[i] for i in chosen))


# ----------------------------------------------------------------------------------------------------
# Datasets


# Eval splits come first, so they stay the same when only the train sizes change.
SPLITS = ("prompts_eval", "sft_eval", "prefs_eval", "prompts_train", "sft_train", "prefs_train")


def _fresh_post(rng: random.Random, seen: set[str], tool_task: bool = False) -> Post:
    """A post whose prompt no split has used yet, so that splits share no prompt."""
    post = sample_post(rng, tool_task)
    while post.prompt in seen:
        post = sample_post(rng, tool_task)
    seen.add(post.prompt)
    return post


def _sft_row(post: Post, rng: random.Random, config: WorldConfig) -> dict[str, str]:
    flaws = (rng.choice(SFT_FLAWS),) if rng.random() < config.sft_flawed_fraction else ()
    padding = (rng.choice(SFT_PADDING),) if rng.random() < config.sft_padded_fraction else ()
    return {"prompt": post.prompt, "completion": perturbed_draft(post, rng, flaws + padding).render()}


def _preference_row(post: Post, rng: random.Random, config: WorldConfig) -> dict[str, str] | None:
    """Two candidates ordered by gold reward, swapped with probability `label_noise`; None on a tie."""
    draft = candidate_draft(post, rng)
    misstated = rng.random() < config.misstated_pair_fraction
    a, b = draft.render(), (swap_fact(post, draft, rng) if misstated else candidate_draft(post, rng)).render()
    gold_a, gold_b = gold_reward(post.prompt, a), gold_reward(post.prompt, b)
    if gold_a == gold_b:
        return None
    chosen, rejected = (a, b) if gold_a > gold_b else (b, a)
    if rng.random() < config.label_noise:
        chosen, rejected = rejected, chosen
    return {"prompt": post.prompt, "chosen": chosen, "rejected": rejected}


def _prompt_row(post: Post, rng: random.Random, config: WorldConfig) -> dict[str, str]:
    return {"prompt": post.prompt}


def _eval_row(post: Post, rng: random.Random, config: WorldConfig) -> dict[str, str]:
    return {"prompt": post.prompt, "reference": reference_draft(post, rng).render()}


_ROW_BUILDERS = {"prompts_eval": _eval_row, "sft_eval": _sft_row, "prefs_eval": _preference_row,
                 "prompts_train": _prompt_row, "sft_train": _sft_row, "prefs_train": _preference_row}


# The tool task's rows: conversations with TRL's `tools` column, answers that look the outcome up.


def lookup_exchange(post: Post) -> list[dict]:
    """The assistant's call of lookup_case on the post's case file, and the tool's message with the file."""
    call = {"type": "function", "function": {"name": "lookup_case", "arguments": {"case_id": post.case_id}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "lookup_case", "content": lookup_case(post.case_id)}]


def without_outcome(post: Post, draft: Draft) -> Draft:
    """The draft of someone who did not read the case file: the outcome is not stated (the incident is, when nothing
    else would be left)."""
    outcome = next(f.phrase for f in post.facts if f.kind == "outcome")
    statements = tuple(s for s in draft.statements if s != outcome)
    return dataclasses.replace(draft, statements=statements or (() if draft.ask else (post.facts[0].phrase,)))


def tool_answer(post: Post, draft: Draft, looked_up: bool) -> list[dict]:
    """An answer of the tool task as messages: the lookup and the summary, or (not looked up) the summary alone,
    its outcome left out."""
    if not looked_up:
        return [{"role": "assistant", "content": without_outcome(post, draft).render()}]
    return [*lookup_exchange(post), {"role": "assistant", "content": draft.render()}]


def _tool_row(post: Post, **answers: list[dict]) -> dict:
    return {**as_conversation({"prompt": post.prompt}), **answers, "tools": tool_schemas()}


def _looks_up(rng: random.Random) -> bool:
    return rng.random() >= SKIP_LOOKUP_PROBABILITY


def _tool_sft_row(post: Post, rng: random.Random, config: WorldConfig) -> dict:
    flaws = (rng.choice(SFT_FLAWS),) if rng.random() < config.sft_flawed_fraction else ()
    padding = (rng.choice(SFT_PADDING),) if rng.random() < config.sft_padded_fraction else ()
    return _tool_row(post, completion=tool_answer(post, perturbed_draft(post, rng, flaws + padding), _looks_up(rng)))


def _tool_preference_row(post: Post, rng: random.Random, config: WorldConfig) -> dict | None:
    """Two candidates (each looked up or not) ordered by the gold reward of their summaries, as `_preference_row`."""
    draft = candidate_draft(post, rng)
    misstated = rng.random() < config.misstated_pair_fraction
    other = swap_fact(post, draft, rng) if misstated else candidate_draft(post, rng)
    a, b = tool_answer(post, draft, _looks_up(rng)), tool_answer(post, other, _looks_up(rng))
    gold_a, gold_b = (gold_reward(post.prompt, answer[-1]["content"]) for answer in (a, b))
    if gold_a == gold_b:
        return None
    chosen, rejected = (a, b) if gold_a > gold_b else (b, a)
    if rng.random() < config.label_noise:
        chosen, rejected = rejected, chosen
    return _tool_row(post, chosen=chosen, rejected=rejected)


def _tool_prompt_row(post: Post, rng: random.Random, config: WorldConfig) -> dict:
    return _tool_row(post)


def _tool_eval_row(post: Post, rng: random.Random, config: WorldConfig) -> dict:
    return _tool_row(post, reference=tool_answer(post, reference_draft(post, rng), looked_up=True))


_TOOL_ROW_BUILDERS = {"prompts_eval": _tool_eval_row, "sft_eval": _tool_sft_row, "prefs_eval": _tool_preference_row,
                      "prompts_train": _tool_prompt_row, "sft_train": _tool_sft_row,
                      "prefs_train": _tool_preference_row}


def build_world(seed: int, config: WorldConfig | None = None) -> dict[str, list[dict]]:
    """All splits of the demo world; the same seed and config give identical rows.

    Every split draws from its own generator (seeded by seed and split name) and no two rows of any
    splits share a prompt. The tool task's rows are conversations whatever `config.conversational` says.
    """
    config = config or WorldConfig()
    builders = _TOOL_ROW_BUILDERS if config.tool_task else _ROW_BUILDERS
    seen: set[str] = set()
    world = {}
    for split in SPLITS:
        rng = random.Random(f"tldr-world/{seed}/{split}")
        rows: list[dict] = []
        while len(rows) < getattr(config, split):
            row = builders[split](_fresh_post(rng, seen, config.tool_task), rng, config)
            if row is not None:
                rows.append(row)
        world[split] = [as_conversation(row) for row in rows] if config.conversational and not config.tool_task \
            else rows
    return world


def as_conversation(row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    """A row in TRL's conversational format: the prompt as system + user messages, each answer as an
    assistant message (its text unchanged, leading space included)."""
    out = {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["prompt"]}]}
    out.update({k: [{"role": "assistant", "content": v}] for k, v in row.items() if k != "prompt"})
    return out


def misstated_pairs(seed: int, n: int, exclude: set[str] = frozenset(), conversational: bool = False,
                    tool_task: bool = False) -> list[dict]:
    """`n` probe pairs {prompt, chosen: the reference, rejected: it with one misstated fact (`swap_fact`)}.

    They measure whether a reward model checks a summary against its post, the check an RL policy
    exploits when it is missing. Posts are fresh (prompts in `exclude`, e.g. the training splits' post texts, are
    skipped); `conversational` gives them in the conversational variant's format, `tool_task` in the tool task's
    (both answers look the outcome up).
    """
    rng, seen = random.Random(f"tldr-world/{seed}/misstated"), set(exclude)
    rows = []
    for _ in range(n):
        post = _fresh_post(rng, seen, tool_task)
        reference = reference_draft(post, rng)
        misstated = swap_fact(post, reference, rng)
        if tool_task:
            rows.append(_tool_row(post, chosen=tool_answer(post, reference, True),
                                  rejected=tool_answer(post, misstated, True)))
        else:
            rows.append({"prompt": post.prompt, "chosen": reference.render(), "rejected": misstated.render()})
    return [as_conversation(row) for row in rows] if conversational and not tool_task else rows
