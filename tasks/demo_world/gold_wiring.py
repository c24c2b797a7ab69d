"""The one place that decides whether a run has a gold reward: the built-in world does, real data has none."""

from __future__ import annotations

from rlhf_core.scoring import GoldFn
from rlhf_core.world.gold import gold_reward
from tasks.parameters.params import Params


def gold_fn(params: Params) -> GoldFn | None:
    """The world's gold reward (prompt, completion, ended_with_eos) -> float, or None for real data."""
    return gold_reward if params.prepare.source == "world" else None
