"""Reward functions by import path (TRL's reward_funcs given as strings): resolving one costs importlib only,
so the pipeline's params can check a path when they are read, before any stage runs or any model loads."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
"""(prompts, completions) -> one reward per completion: what `scoring.FunctionScorer` wraps."""


def import_reward_function(path: str) -> RewardFn:
    """The function at `path`, "package.module:function" (TRL's reward functions by import path), checked to
    be callable; every failure names the path and what was expected."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"reward function {path!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward function {path!r}: cannot import module {module_name!r} ({error})") from None
    fn = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {path!r}: module {module_name!r} has no {attribute!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {attribute!r} is a {type(fn).__name__}, not callable "
                         "(expected fn(prompts, completions) -> floats)")
    return fn
