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

The gold reward (`gold_breakdown`) scores a completion against those facts; weights and reasons:

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

Datasets are lists of plain dicts in the formats of the real datasets, so the same loaders read both.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True)
class Domain:
    """One subreddit: whom the poster writes about, what they did, how it ended, what the poster asks."""

    subreddit: str
    relations: tuple[str, ...]
    events: tuple[str, ...]
    outcomes: tuple[str, ...]
    asks: tuple[str, ...]


# Closed vocabularies. Event / outcome / ask phrases never occur in distractors (tests check it), and
# entity words (relations, names, places) never occur inside events, outcomes, asks or rambles.
DOMAINS = (
    Domain("relationships", ("boyfriend", "girlfriend", "husband", "wife", "partner", "fiance"),
           ("forgot my birthday", "read my private messages", "cancelled our vacation",
            "lied about their salary", "skipped my graduation", "invited their ex to dinner"),
           ("we broke up", "we started couples therapy", "we stopped talking for a week", "i moved out"),
           ("should i end it", "am i overreacting", "how do i rebuild trust", "should i forgive them")),
    Domain("legaladvice", ("landlord", "neighbor", "employer", "contractor", "mechanic"),
           ("kept my security deposit", "parked in my driveway", "withheld my last paycheck",
            "cut down my fence", "never finished the roof", "scratched my car"),
           ("i filed a small claims case", "i hired a lawyer", "i got half the money back",
            "the police took a report"),
           ("can i sue", "is this even legal", "what are my rights", "should i go to court")),
    Domain("personalfinance", ("brother", "sister", "uncle", "dad", "mom", "stepdad"),
           ("borrowed two thousand dollars", "opened a credit card in my name", "spent my college fund",
            "stopped paying rent", "sold my old car", "emptied our joint account"),
           ("i froze my credit", "we set up a payment plan", "i lost my savings", "i paid off the debt"),
           ("should i report them", "how do i get it repaid", "should i cut them off",
            "is it worth a lawsuit")),
    Domain("roommates", ("roommate", "flatmate", "housemate"),
           ("ate all my groceries", "threw a party while i slept", "broke my gaming chair",
            "adopted a puppy without asking", "never pays the utilities", "locked me out"),
           ("i changed the locks", "i found a new place", "we split the bills evenly",
            "i put up a chore chart"),
           ("how do i confront them", "should i report this to the lease office", "am i the jerk")),
    Domain("work", ("boss", "manager", "coworker", "intern", "client"),
           ("took credit for my project", "scheduled me on my day off", "yelled at me in a meeting",
            "read my emails", "cut my hours", "missed every deadline"),
           ("i reported it to hr", "i quit on the spot", "i got a raise", "i got a written warning"),
           ("should i look for a new job", "should i go over their head", "how do i handle this")),
    Domain("pets", ("dogsitter", "vet", "groomer", "neighbor"),
           ("fed my dog chocolate", "let my cat outside", "lost my parrot", "shaved my poodle bald",
            "forgot to give the insulin"),
           ("we rushed to the emergency clinic", "we found it two streets away",
            "i found a new sitter", "the bill was huge"),
           ("should i ask them to pay for it", "should i leave a review", "was i too harsh")),
)
# The people of distractor sentences: family and friends, never the subject of the post's facts.
DISTRACTOR_RELATIONS = ("cousin", "aunt", "grandma", "friend", "stepmom", "brother", "sister", "dad", "mom",
                        "coworker", "roommate")
NAMES = ("alex", "sam", "jordan", "taylor", "chris", "casey", "riley", "morgan", "jamie", "drew", "robin",
         "avery", "quinn", "blake", "reese", "parker")  # unisex, so "my aunt sam" never reads wrong
PLACES = ("ohio", "texas", "london", "toronto", "chicago", "denver", "seattle", "boston")
RELATIONS = tuple(sorted({r for d in DOMAINS for r in d.relations} | set(DISTRACTOR_RELATIONS)))
ENTITY_WORDS = frozenset(RELATIONS + NAMES + PLACES)

TIMES = ("last week", "yesterday", "two days ago", "on friday", "this morning", "a month ago")
HOBBIES = ("loves fishing", "plays guitar on weekends", "is training for a marathon", "collects old coins",
           "bakes bread every sunday", "just adopted a kitten")
DAYS = ("monday", "saturday", "sunday")
TITLES = ("need advice about my {relation}", "my {relation} situation, long post",
          "am i wrong to be upset with my {relation}", "{relation} drama, not sure what to do",
          "update on my {relation}")
INCIDENT_SENTENCES = ("{time} {fact}.", "so {time} {fact}.", "long story short, {fact}.")
OUTCOME_SENTENCES = ("in the end {fact}.", "after a long talk {fact}.", "eventually {fact}.",
                     "the next morning {fact}.")
ASK_SENTENCES = ("{fact}?", "honestly, {fact}?", "so reddit, {fact}?", "my question is, {fact}?")
DISTRACTORS = ("my {relation} {name} {hobby}", "for context i am {age} and live in {place}",
               "{name} from work says this happens a lot", "my {relation} {name} visited from {place}",
               "{name} and i went to the movies on {day}", "it rained all week here in {place}",
               "my {relation} thinks i should move to {place}")
RAMBLES = ("it has been a really long and stressful week for everyone involved here",
           "anyway thanks for reading all of this, sorry that it turned into such a long story",
           "i just needed to get this off my chest because nobody else would listen to me")

STOPWORDS = frozenset("a an the my i me we our them their it to of in on for and is am are do how should "
                      "can what this".split())
ASK_PROBABILITY = 0.6
BREVITY_SLACK = 4
WEIGHTS = {"brevity": 0.05, "invented": 0.3, "distraction": 0.1, "repetition": 0.1, "eos": 0.5}


def words(text: str) -> list[str]:
    """Lowercase word tokens of `text`; punctuation and anything non-alphanumeric is a separator."""
    return re.findall(r"[a-z0-9]+", text.lower())


@dataclass(frozen=True)
class Fact:
    """One key fact, worded as a summary states it (``my sister spent my college fund``)."""

    kind: str  # "incident" | "outcome" | "ask"
    phrase: str

    @property
    def keywords(self) -> tuple[str, ...]:
        return tuple(w for w in words(self.phrase) if w not in STOPWORDS)


@dataclass(frozen=True)
class Post:
    """A generated post, with the facts and distractors it was built from (`parse_facts` recovers the facts)."""

    subreddit: str
    title: str
    body: tuple[str, ...]  # sentences: the fact sentences in order, distractors interleaved
    facts: tuple[Fact, ...]
    distractors: tuple[str, ...]  # distractor clauses as a summary would quote them

    @property
    def prompt(self) -> str:
        return f"SUBREDDIT: r/{self.subreddit}\n\nTITLE: {self.title}\n\nPOST: {' '.join(self.body)}\n\nTL;DR:"


def _fill(template: str, rng: random.Random, **slots: str) -> str:
    """Fill `template`, drawing each slot not given from its closed vocabulary."""
    pools = {"time": TIMES, "name": NAMES, "place": PLACES, "hobby": HOBBIES, "day": DAYS,
             "age": tuple(str(a) for a in range(19, 41))}
    fields = re.findall(r"{(\w+)}", template)
    return template.format(**{f: slots[f] if f in slots else rng.choice(pools[f]) for f in fields})


def sample_post(rng: random.Random) -> Post:
    """Draw one post: 2-3 facts about one relation, 3-5 distractors about other people, shuffled in."""
    domain = rng.choice(DOMAINS)
    relation = rng.choice(domain.relations)
    facts = [Fact("incident", f"my {relation} {rng.choice(domain.events)}"),
             Fact("outcome", rng.choice(domain.outcomes))]
    if rng.random() < ASK_PROBABILITY:
        facts.append(Fact("ask", rng.choice(domain.asks)))
    templates = {"incident": INCIDENT_SENTENCES, "outcome": OUTCOME_SENTENCES, "ask": ASK_SENTENCES}
    fact_sentences = [_fill(rng.choice(templates[f.kind]), rng, fact=f.phrase) for f in facts]
    others = [r for r in DISTRACTOR_RELATIONS if r != relation]
    distractors = [_fill(rng.choice(DISTRACTORS), rng, relation=rng.choice(others))
                   for _ in range(rng.randint(3, 5))]
    # Facts keep their order (incident, outcome, ask); distractors fill the remaining slots.
    slots = set(rng.sample(range(len(facts) + len(distractors)), len(facts)))
    fact_iter, distractor_iter = iter(fact_sentences), iter(d + "." for d in distractors)
    body = tuple(next(fact_iter) if i in slots else next(distractor_iter)
                 for i in range(len(facts) + len(distractors)))
    title = rng.choice(TITLES).format(relation=relation)
    return Post(domain.subreddit, title, body, tuple(facts), tuple(distractors))


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
    if match := _ASK_RE.search(body):
        facts.append(Fact("ask", match[1]))
    return tuple(facts)


def _listed_phrase(fact: Fact) -> str:
    """The fact's phrase from the closed lists: an incident's event (``my sister`` + event), else the phrase."""
    return fact.phrase.split(" ", 2)[2] if fact.kind == "incident" else fact.phrase


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


def gold_breakdown(prompt: str, completion: str, ended_with_eos: bool = True) -> GoldBreakdown:
    """Score `completion` as a summary of `prompt` against the facts parsed from the prompt."""
    facts = parse_facts(prompt)
    said = words(completion)
    said_set = set(said)
    coverage = sum(sum(w in said_set for w in f.keywords) / len(f.keywords) for f in facts) / max(len(facts), 1)
    budget = BREVITY_SLACK + sum(len(words(f.phrase)) for f in facts)
    relevant = {w for f in facts for w in f.keywords}
    entities = (said_set & ENTITY_WORDS) - relevant
    invented = entities - set(words(prompt))
    # Fact phrases are matched on the word sequence, so punctuation never hides one.
    invented_facts = set(_ANY_FACT_RE.findall(" ".join(said))) - {_listed_phrase(f) for f in facts}
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

    def unsaid(pool: tuple[str, ...]) -> list[str]:
        return [p for p in pool if f" {p} " not in said]

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
        new = old.replace(_listed_phrase(post.facts[0]), rng.choice(unsaid(domain.events)), 1)
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


@dataclass(frozen=True)
class WorldConfig:
    """Sizes and noise of the demo world's splits; defaults train each tiny model in about a CPU minute."""

    sft_train: int = 4096
    """SFT rows {prompt, completion} for training the policy."""
    sft_eval: int = 256
    """SFT rows for the SFT validation loss."""
    prefs_train: int = 4096
    """preference pairs {prompt, chosen, rejected} for training the reward model."""
    prefs_eval: int = 512
    """preference pairs for the reward model's held-out accuracy."""
    prompts_train: int = 1024
    """prompts {prompt} for RL rollouts."""
    prompts_eval: int = 256
    """held-out prompts {prompt, reference} for evaluation with the proxy and the gold reward."""
    sft_flawed_fraction: float = 0.2
    """fraction of SFT completions with a content error (a dropped fact or an invented name)."""
    sft_padded_fraction: float = 0.8
    """fraction of SFT completions padded with an extra clause (small talk from the post or a ramble), as
    human-written TL;DRs often are. Imitation learns the habit (greedy decoding follows the majority); the
    reward model learns from pairs that padding loses, so RL has a real, gold-visible flaw to unlearn."""
    label_noise: float = 0.1
    """probability that a preference pair's labels are swapped, like disagreeing human raters."""
    misstated_pair_fraction: float = 0.0
    """fraction of preference pairs that differ only in one misstated fact (`swap_fact`): hard negatives that
    teach the reward model to check a summary against its post, the check an RL policy otherwise exploits.
    Off by default: at 0.25 the demo's tiny reward model does not learn the check and its gold accuracy falls
    to ~0.71; its `eval/misstated_accuracy` reports the blind spot instead."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, float):
                assert 0.0 <= value <= 1.0, f"world.{f.name} must be in [0, 1], got {value}"
            else:
                assert value >= 0, f"world.{f.name} must be >= 0, got {value}"


# Eval splits come first, so they stay the same when only the train sizes change.
SPLITS = ("prompts_eval", "sft_eval", "prefs_eval", "prompts_train", "sft_train", "prefs_train")


def _fresh_post(rng: random.Random, seen: set[str]) -> Post:
    """A post whose prompt no split has used yet, so that splits share no prompt."""
    post = sample_post(rng)
    while post.prompt in seen:
        post = sample_post(rng)
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


def build_world(seed: int, config: WorldConfig | None = None) -> dict[str, list[dict[str, str]]]:
    """All splits of the demo world; the same seed and config give identical rows.

    Every split draws from its own generator (seeded by seed and split name) and no two rows of any
    splits share a prompt.
    """
    config = config or WorldConfig()
    seen: set[str] = set()
    world = {}
    for split in SPLITS:
        rng = random.Random(f"tldr-world/{seed}/{split}")
        rows: list[dict[str, str]] = []
        while len(rows) < getattr(config, split):
            row = _ROW_BUILDERS[split](_fresh_post(rng, seen), rng, config)
            if row is not None:
                rows.append(row)
        world[split] = rows
    return world


def misstated_pairs(seed: int, n: int, exclude: set[str] = frozenset()) -> list[dict[str, str]]:
    """`n` probe pairs {prompt, chosen: the reference, rejected: it with one misstated fact (`swap_fact`)}.

    They measure whether a reward model checks a summary against its post, the check an RL policy
    exploits when it is missing. Posts are fresh (prompts in `exclude`, e.g. the training splits', are skipped).
    """
    rng, seen = random.Random(f"tldr-world/{seed}/misstated"), set(exclude)
    rows = []
    for _ in range(n):
        post = _fresh_post(rng, seen)
        reference = reference_draft(post, rng)
        rows.append({"prompt": post.prompt, "chosen": reference.render(),
                     "rejected": swap_fact(post, reference, rng).render()})
    return rows
