"""The demo world: synthetic TL;DR data with a known gold reward, and a tokenizer trained on it."""

from rlhf_core.world.tldr import (
    ENTITY_WORDS,
    Fact,
    GoldBreakdown,
    Post,
    WorldConfig,
    build_world,
    gold_breakdown,
    gold_reward,
    misstated_pairs,
    parse_facts,
    sample_post,
)
from rlhf_core.world.tokenizer import EOS, PAD, UNK, train_tokenizer

__all__ = [
    "ENTITY_WORDS",
    "EOS",
    "PAD",
    "UNK",
    "Fact",
    "GoldBreakdown",
    "Post",
    "WorldConfig",
    "build_world",
    "gold_breakdown",
    "gold_reward",
    "misstated_pairs",
    "parse_facts",
    "sample_post",
    "train_tokenizer",
]
