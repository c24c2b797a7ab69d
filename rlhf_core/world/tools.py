"""The demo world's tool: the case files that hold what a tool-task post leaves out (`WorldConfig.tool_task`).

A tool-task post does not say how its story ended; its last sentence names a case file (``what happened next is in
case file 4821.``), and only `lookup_case` reads it. The files are a fixed directory over every four-digit number: the
number's hash picks one outcome of the world's closed list (rlhf_core/world/vocabulary.py), so the directory is the same
in every process and on every machine, needs no data file, and cannot be memorized from a few thousand posts (9000
numbers, ~24 outcomes). The generator draws a number whose file holds the post's outcome; the gold reward reads the
same file to know the fact the summary must state (rlhf_core/world/gold.py).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import random
import re

from rlhf_core.world.vocabulary import DOMAINS

OUTCOMES = tuple(sorted({o for d in DOMAINS for o in d.outcomes}))
CASE_IDS = range(1000, 10000)
CASE_ID_RE = re.compile(r"\bcase file (\d{4})\b")  # how a post names its file (vocabulary.CASE_SENTENCES)


def case_outcome(case_id: str) -> str | None:
    """The outcome filed under `case_id` (four digits), or None for anything else."""
    if not re.fullmatch(r"\d{4}", case_id) or int(case_id) not in CASE_IDS:
        return None
    digest = hashlib.sha256(f"tldr-world/case/{case_id}".encode()).digest()
    return OUTCOMES[int.from_bytes(digest[:8], "big") % len(OUTCOMES)]


def draw_case_id(outcome: str, rng: random.Random) -> str:
    """A case number whose file holds `outcome` (one of OUTCOMES): uniform among them, ~24 draws on average."""
    assert outcome in OUTCOMES, f"not a world outcome: {outcome!r}"
    while (case_id := str(rng.choice(CASE_IDS))) and case_outcome(case_id) != outcome:
        pass
    return case_id


def lookup_case(case_id: str) -> str:
    """Read a case file: how the story ended.

    Args:
        case_id: The case file number.
    """
    outcome = case_outcome(str(case_id).strip())
    # a leading space, as a summary's words have: the file's words are the very tokens the summary copies
    return f" {outcome}" if outcome is not None else f" no case file {case_id}"


TOOL_PATH = f"{__name__}:lookup_case"  # how params name it (train.tools; trust.tool_modules allows this module)


def tool_schemas() -> list[dict]:
    """The `tools` column of tool-task rows: lookup_case's JSON schema, exactly what the chat template renders for
    the function itself at rollout time (so SFT data and rollouts show the model the same prompt)."""
    return [copy.deepcopy(_lookup_schema())]


@functools.cache
def _lookup_schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(lookup_case)
