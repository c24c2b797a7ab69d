"""The demo world's closed vocabularies: subreddits with their relations, events, outcomes and asks, and the
words of distractors. The generator draws from them and the gold reward parses facts back out of them.

Event / outcome / ask phrases never occur in distractors (tests check it), and entity words (relations,
names, places) never occur inside events, outcomes, asks or rambles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Domain:
    """One subreddit: whom the poster writes about, what they did, how it ended, what the poster asks."""

    subreddit: str
    relations: tuple[str, ...]
    events: tuple[str, ...]
    outcomes: tuple[str, ...]
    asks: tuple[str, ...]


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
# A tool-task post's outcome sentence: the outcome itself is only in the case file (rlhf_core/world/tools.py)
CASE_SENTENCES = ("what happened next is in case file {case}.", "how it ended is in case file {case}.",
                  "the rest is in case file {case}.")
DISTRACTORS = ("my {relation} {name} {hobby}", "for context i am {age} and live in {place}",
               "{name} from work says this happens a lot", "my {relation} {name} visited from {place}",
               "{name} and i went to the movies on {day}", "it rained all week here in {place}",
               "my {relation} thinks i should move to {place}")
RAMBLES = ("it has been a really long and stressful week for everyone involved here",
           "anyway thanks for reading all of this, sorry that it turned into such a long story",
           "i just needed to get this off my chest because nobody else would listen to me")

STOPWORDS = frozenset("a an the my i me we our them their it to of in on for and is am are do how should "
                      "can what this".split())


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


def listed_phrase(fact: Fact) -> str:
    """The fact's phrase from the closed lists: an incident's event (``my sister`` + event), else the phrase."""
    return fact.phrase.split(" ", 2)[2] if fact.kind == "incident" else fact.phrase
