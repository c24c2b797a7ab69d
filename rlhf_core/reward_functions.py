"""Reward functions by import path (TRL's reward_funcs given as strings): resolving one costs importlib only,
so the pipeline's params can check a path when they are read, before any stage runs or any model loads.

A path names a function defined at module level in the module it names ("package.module:function"): the object
found must say so itself (its `__module__` and `__qualname__`). So a module allowed by `trust.reward_modules`
lends no name it merely imported (`launcher:subprocess` is the module subprocess, `m:run` after
`from subprocess import run` is subprocess's run) and no attribute reached through one (docs/security.md).
Tools and environments (rlhf_core/tools.py) are resolved by the same rules (`import_defined`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
"""(prompts, completions) -> one reward per completion: what `scoring.FunctionScorer` wraps."""


def split_import_path(path: str, kind: str = "reward function", noun: str = "function") -> tuple[str, str]:
    """'package.module:name' -> (module, name); ValueError naming the path unless the module is a dotted name and the
    name one identifier (no attribute path through what the module imported)."""
    module_name, sep, name = path.partition(":")
    if not sep or not all(part.isidentifier() for part in module_name.split(".")) or not name.isidentifier():
        raise ValueError(f"{kind} {path!r}: expected 'package.module:{noun}', a {noun} defined at module level "
                         "(one name after the colon, no attribute path)")
    return module_name, name


def import_defined(path: str, kind: str, noun: str, expected: str) -> Callable:
    """The callable at `path`, "package.module:name", defined at module level in that module (its own `__module__`
    and `__qualname__` say so); every failure names the `kind` ("reward function", "tool"), the path and what was
    `expected` of it."""
    module_name, name = split_import_path(path, kind, noun)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{kind} {path!r}: cannot import module {module_name!r} ({error})") from None
    if name not in vars(module):  # the module's own namespace: no module __getattr__, nothing looked up elsewhere
        raise ValueError(f"{kind} {path!r}: module {module_name!r} has no {name!r}")
    fn = vars(module)[name]
    if not callable(fn):
        raise ValueError(f"{kind} {path!r}: {name!r} is a {type(fn).__name__}, not callable (expected {expected})")
    defined_in, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if (defined_in, qualname) != (module_name, name):
        where = f"{defined_in}:{qualname}" if isinstance(defined_in, str) and isinstance(qualname, str) else \
            f"a {type(fn).__name__} object with no module and name of its own"
        raise ValueError(f"{kind} {path!r}: {module_name}.{name} is {where}, not a {noun} defined at module level in "
                         f"{module_name!r}; only such a {noun} is accepted (not a name the module imported or an alias)")
    return fn


def import_reward_function(path: str) -> RewardFn:
    """The function at `path`, "package.module:function", defined at module level in that module and callable
    (`import_defined`)."""
    return import_defined(path, "reward function", "function", "fn(prompts, completions) -> floats")
