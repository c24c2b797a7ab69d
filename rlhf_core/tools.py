"""Tools and environments of multi-turn rollouts (TRL 1.16's GRPOTrainer `tools` and `environment_factory`): resolving
them by import path, the tools one episode may call, and running one assistant turn's calls as TRL does.

A tool is a plain function, sync or async, with type hints and a docstring (the chat template renders its JSON schema,
`transformers.utils.get_json_schema`). An environment is a class (or any factory) whose instances have `reset(**row)`
(returning text appended to the prompt's last user message, or None), public methods that are tools of its episode,
and optionally `get_reward()`, one more reward source. Both are named `package.module:name` and resolved by
`reward_functions.import_defined`: defined at module level in the module named, which `trust.tool_modules` allows.

Running a turn's calls (`run_tool_calls`) keeps TRL's semantics (grpo_trainer.py `_tool_call_loop`): every call counts;
an unknown tool, a call that raises, a call of another type than "function" is a failed call whose result, returned to
the model, is TRL's `{"error": str(e)}`; results of sync tools come first in call order, then those of async tools
(run concurrently). One addition: a per-call `timeout` after which the call is a failure too. A Python thread cannot be
stopped, so a sync tool that overruns its timeout keeps running in its daemon thread, its result dropped.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_core.reward_functions import import_defined

ENVIRONMENT_HOOKS = ("reset", "get_reward")  # an environment's methods that are not tools (TRL's)


def import_tool(path: str) -> Callable:
    """The tool function at `path` ("package.module:function"), with a JSON schema the chat template can render."""
    fn = import_defined(path, "tool", "function", "a function the model may call, sync or async")
    check_tool_schema(fn, f"tool {path!r}")
    return fn


def import_environment_factory(path: str) -> Callable:
    """The environment factory at `path` ("package.module:Class"): called with no argument, one per episode."""
    return import_defined(path, "environment factory", "class", "a class whose instances have reset()")


def check_tool_schema(fn: Callable, label: str) -> None:
    """ValueError naming `label` unless transformers can describe `fn` to the model (type hints, a docstring with
    each argument): the chat template renders that schema, and parsing types the arguments by it."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(fn)
    except Exception as error:  # noqa: BLE001 - transformers raises several kinds; all mean "not describable"
        raise ValueError(f"{label}: the model cannot be told how to call it ({type(error).__name__}: {error}); a tool "
                         "needs type hints and a docstring describing each argument") from None


def environment_tools(environment: object) -> list[Callable]:
    """An environment's tools: its class's public functions other than reset and get_reward, bound to it, by name
    (TRL: `inspect.getmembers(type(env), inspect.isfunction)`, so properties are never evaluated)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ENVIRONMENT_HOOKS and not name.startswith("_")]


def check_environment(environment: object, label: str) -> None:
    """ValueError naming `label` unless the instance has a `reset` method and describable tools."""
    if not callable(getattr(type(environment), "reset", None)):
        raise ValueError(f"{label}: an environment needs a reset() method (called at the start of every episode)")
    for method in environment_tools(environment):
        check_tool_schema(method, f"{label}: method {method.__name__!r}")


@dataclass(frozen=True)
class Toolbox:
    """The tools one episode may call: the configured tools, then its environment's (a later name wins, as in TRL's
    per-rollout dicts). `functions` is what the chat template renders and the parser types arguments with."""

    functions: tuple[Callable, ...]

    @property
    def by_name(self) -> dict[str, Callable]:
        return {fn.__name__: fn for fn in self.functions}


@dataclass(frozen=True)
class TurnCalls:
    """What running one assistant turn's tool calls produced."""

    messages: list[dict]  # the tool messages, {"role": "tool", "name", "content"}, in TRL's order
    calls: int  # tool calls made (each counts, failed or not)
    failures: int  # calls that failed: unknown tool, exception, timeout, unsupported type


def run_tool_calls(toolbox: Toolbox, tool_calls: Sequence[Mapping], timeout: float | None = None) -> TurnCalls:
    """Run a parsed turn's `tool_calls` ([{"type": "function", "function": {"name", "arguments"}}]) with TRL's
    semantics (module docstring); never raises for what a tool does."""
    tools = toolbox.by_name
    results: list[tuple[str, Any]] = []  # sync results and failures, in call order
    pending: list[tuple[str, Any]] = []  # async calls: (name, coroutine)
    failures = 0
    for call in tool_calls:
        if call.get("type") != "function":
            failures += 1
            results.append((call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"}))
            continue
        function = call.get("function")
        name = function.get("name", "unknown") if isinstance(function, Mapping) else "unknown"
        try:
            if not isinstance(function, Mapping):  # parse_turn never hands one over; a replayed call might
                raise ValueError(f"malformed tool call {call!r}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            if inspect.iscoroutinefunction(tools[name]):
                pending.append((name, tools[name](**function["arguments"])))  # binding errors raise here, as TRL's
            else:
                results.append((name, _call_sync(tools[name], function["arguments"], timeout)))
        except Exception as error:  # noqa: BLE001 - whatever a tool raises is its result, returned to the model
            failures += 1
            results.append((name, {"error": str(error)}))
    for name, result in zip([n for n, _ in pending], run_async([c for _, c in pending], timeout), strict=True):
        if isinstance(result, BaseException):
            failures += 1
            result = {"error": str(result)}
        results.append((name, result))
    messages = [{"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}
                for name, result in results]
    return TurnCalls(messages=messages, calls=len(tool_calls), failures=failures)


class ToolTimeout(TimeoutError):
    """A tool call that did not return within the configured timeout."""

    def __init__(self, timeout: float):
        super().__init__(f"tool call timed out after {timeout:g} s")


def _call_sync(fn: Callable, arguments: Any, timeout: float | None) -> Any:
    """fn(**arguments), in the caller's thread without a timeout (as TRL), else in a daemon thread waited on for
    `timeout` seconds (a thread cannot be killed: an overrunning call is abandoned, ToolTimeout raised)."""
    if timeout is None:
        return fn(**arguments)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = fn(**arguments)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread as it is
            outcome["error"] = error

    thread = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ToolTimeout(timeout)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def run_async(coroutines: Sequence, timeout: float | None = None) -> list:
    """Await `coroutines` concurrently on this process's tool event loop (a daemon thread, as TRL's, so it works
    whether or not the caller's thread runs a loop): their results, an exception in place of each that raised."""
    if not coroutines:
        return []

    async def bounded(coroutine):
        if timeout is None:
            return await coroutine
        try:
            return await asyncio.wait_for(coroutine, timeout)
        except asyncio.TimeoutError:
            raise ToolTimeout(timeout) from None

    async def gather():
        return await asyncio.gather(*(bounded(c) for c in coroutines), return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _tool_loop()).result()


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _tool_loop() -> asyncio.AbstractEventLoop:
    """The event loop async tools and async get_reward run on, started once per process in a daemon thread."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rlhf-tool-loop", daemon=True).start()
            _LOOP = loop
    return _LOOP


def environment_reward(environment: object) -> float | None:
    """The environment's `get_reward()` (sync or async) at the end of its episode; None when it has none."""
    get_reward = getattr(environment, "get_reward", None)
    if get_reward is None:
        return None
    if inspect.iscoroutinefunction(get_reward):
        [result] = run_async([get_reward()])
        if isinstance(result, BaseException):
            raise result
        return float(result)
    return float(get_reward())
