"""Multi-turn rollouts with tools (rlhf_core/tools.py, tool_chat.py, multi_turn.py): the tool-call format, running
calls with TRL's semantics, the KV cache carried across turns, the tool mask in the loss and the KL, the trust model,
and one GRPO update with tools equal to TRL 1.16.0's GRPOTrainer on the same forced turns.

Every model and tokenizer is built here (a byte-level BPE trained with the demo world's tool template, a tiny
GPT-NeoX); the tools are a module written to a temporary folder, imported by path on both sides."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf_core import grpo, ops, rloo
from rlhf_core.config import RLConfig
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.models import init_causal_lm, tiny_gpt_neox_config
from rlhf_core.multi_turn import Episode, Sampler, ToolRollouts, multi_turn_decode
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.rl_update import PolicyAndValue
from rlhf_core.rollout import PolicyOutput, Rollout, response_logits
from rlhf_core.tool_chat import check_tool_template, parse_turn, render_ids, tool_suffix_ids
from rlhf_core.tools import Toolbox, import_environment_factory, import_tool, run_tool_calls
from rlhf_core.world.tokenizer import CHAT_TEMPLATE, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TRL116_PYTHON = ROOT / ".venv-trl116" / "bin" / "python"
TOOLS_MODULE = "rlhf_test_tools"
TOOLS_SOURCE = '''
"""Tools and an environment for tests/test_tools.py, imported by path in our venv and in TRL's."""
import asyncio
import subprocess
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def broken(x: str) -> str:
    """A tool that always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


def repeat(word: str, times: int) -> str:
    """A word, many times.

    Args:
        word: The word.
        times: How many times.
    """
    return " ".join([word] * times)


async def slow(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(seconds)
    return "slept"


async def failing(x: str) -> str:
    """An async tool that always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"failing on {x}")


def hang(seconds: float) -> str:
    """Block.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def blocks(seconds: float) -> list:
    """Content blocks, passed through as they are.

    Args:
        seconds: Unused.
    """
    return [{"type": "text", "text": "a block"}]


def undocumented(x):
    return x


imported_run = subprocess.run


class Counter:
    """An environment: a counter the model bumps; its reward is the count."""

    def __init__(self):
        self.count = 0

    def reset(self, **row):
        self.count = 0
        return " The counter is at 0."

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class NoReset:
    def bump(self, by: int) -> int:
        """Add.

        Args:
            by: How much.
        """
        return by
'''
TEMPERATURE = 0.9


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def tool_module(tmp_path_factory):
    """The tools' module, importable as rlhf_test_tools for the module's tests (and by path on TRL's side)."""
    folder = tmp_path_factory.mktemp("tool_module")
    (folder / f"{TOOLS_MODULE}.py").write_text(TOOLS_SOURCE)
    sys.path.insert(0, str(folder))
    import importlib

    module = importlib.import_module(TOOLS_MODULE)
    yield module
    sys.path.remove(str(folder))
    sys.modules.pop(TOOLS_MODULE, None)


QUESTIONS = ["what is two plus three", "what is one plus one", "count to five", "say hello", "what is four plus four"]


@pytest.fixture(scope="module")
def tok(tool_module):
    """The demo world's tokenizer trained with tools, on text like the tests' (the rendered prompts, calls, answers),
    so that a prompt with its tools' schemas is tens of tokens, not hundreds."""
    m = tool_module
    seed_texts = [call("add", a=2, b=3), "the answer is five", *QUESTIONS]
    first = train_tokenizer(seed_texts, vocab_size=300, tools=True)
    env_tools = [m.add, m.Counter().bump]
    rendered = [first.apply_chat_template([{"role": "user", "content": q + " The counter is at 0."}],
                                          tools=tools, tokenize=False, add_generation_prompt=True)
                for q in QUESTIONS for tools in ([m.add, m.broken, m.repeat, m.slow], env_tools)]
    calls = [call("add", a=a, b=b) for a in range(5) for b in range(5)] + [call("broken", x="x"),
                                                                            call("bump", by=2)]
    return train_tokenizer(seed_texts + rendered + calls, vocab_size=900, tools=True)


@pytest.fixture(scope="module")
def model_config(tok):
    return tiny_gpt_neox_config(vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                max_positions=512)


def ids(tok, text: str, eos: bool = True) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])


class Replay:
    """A `TokenChooser` replaying each row's scripted model tokens (its turns, in order), then, with `then`, sampling.
    The log-probs are the model's, read off the logits it is handed, as sampling keeps them; every step's logits are
    recorded, to compare with a full forward."""

    def __init__(self, scripts: list[list[int]], temperature: float = TEMPERATURE, then=None):
        self.scripts, self.temperature, self.then = scripts, temperature, then
        self.used = [0] * len(scripts)
        self.steps: list[tuple[list[int], list[int], torch.Tensor]] = []

    def __call__(self, logits, rows, steps, seen):
        self.steps.append((rows.tolist(), list(steps), logits.float().clone()))
        tokens = torch.zeros(len(rows), dtype=torch.long)
        sampled = [i for i, row in enumerate(rows.tolist()) if self.used[row] == len(self.scripts[row])]
        for i, row in enumerate(rows.tolist()):
            if i not in sampled:
                tokens[i] = self.scripts[row][self.used[row]]
                self.used[row] += 1
        if sampled:
            assert self.then is not None, "a row ran out of its script"
            pick = torch.tensor(sampled)
            tokens[pick] = self.then(logits[pick], rows[pick], [steps[i] for i in sampled], seen[pick])[0]
        logprobs = (logits.float() / self.temperature).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs


def flat(turns: list[list[int]]) -> list[int]:
    return [token for turn in turns for token in turn]


# ------------------------------------------------------------------------------------------- the tool-call format

def test_parse_turn_reads_tool_calls_as_trl_does(tok, tool_module):
    """Calls with their arguments typed by the tool's schema, several per turn, plain text, and a malformed call,
    which is plain text (TRL's fallback), never an error."""
    m = tool_module
    prompt = render_ids(tok, [{"role": "user", "content": "what is two plus three"}], tools=[m.add],
                        generation_prompt=True)
    one = parse_turn(tok, ids(tok, call("add", a=2, b="3")), prompt, [m.add])
    assert one["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    assert one["content"] == ""
    two = parse_turn(tok, ids(tok, "let me see " + call("add", a=1, b=1) + call("nope")), prompt, [m.add])
    assert [c["function"]["name"] for c in two["tool_calls"]] == ["add", "nope"]
    assert two["tool_calls"][1]["function"]["arguments"] == {}, "a call without arguments gets {} (TRL's)"
    assert two["content"] == "let me see"
    assert parse_turn(tok, ids(tok, "the answer is five"), prompt) == {"role": "assistant",
                                                                      "content": "the answer is five"}
    broken = parse_turn(tok, ids(tok, '<tool_call>{"name": "add", "argu', eos=False), prompt)
    assert "tool_calls" not in broken and broken["content"] == '<tool_call>{"name": "add", "argu'


def test_tool_suffix_ids_continue_the_rendered_conversation(tok, tool_module):
    """prompt ids + the model's turn + the suffix of its tool results are exactly the ids of the whole conversation
    rendered by the template (what makes appending tokens, never re-encoding, right), for one and two results."""
    m = tool_module
    messages = [{"role": "user", "content": "what is two plus three"}]
    prompt = render_ids(tok, messages, tools=[m.add], generation_prompt=True)
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
             {"type": "function", "function": {"name": "broken", "arguments": {"x": "x"}}}]
    for n in (1, 2):
        turn = ids(tok, "".join(call(c["function"]["name"], **c["function"]["arguments"]) for c in calls[:n]))
        results = [{"role": "tool", "name": "add", "content": "5"},
                   {"role": "tool", "name": "broken", "content": str({"error": "broken on x"})}][:n]
        suffix = tool_suffix_ids(tok, results)
        whole = render_ids(tok, [*messages, {"role": "assistant", "content": "", "tool_calls": calls[:n]}, *results],
                           tools=[m.add], generation_prompt=True)
        assert prompt + turn + suffix == whole
        assert tok.decode(suffix).startswith("<|tool|>5") and tok.decode(suffix).endswith("<|assistant|>")


def test_a_template_that_cannot_carry_tools_is_refused(tok):
    """No response template, a template that drops tool calls (the world's plain chat template), one that renders
    an earlier turn differently once a tool message follows: each refused once, with its reason."""
    plain = copy.deepcopy(tok)
    plain.response_template = None
    with pytest.raises(ValueError, match="has no response_template"):
        check_tool_template(plain)
    plain = copy.deepcopy(tok)
    plain.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match="drops part of a tool exchange"):
        check_tool_template(plain)
    shifting = copy.deepcopy(tok)  # an assistant turn's header depends on what follows it: not prefix-preserving
    header = "<|assistant|>{{ message['content'] or '' }}"
    assert header in tok.chat_template
    shifting.chat_template = tok.chat_template.replace(
        header, "{% if loop.last %}<|assistant|>{% else %}<|system|>{% endif %}{{ message['content'] or '' }}")
    with pytest.raises(ValueError, match="not prefix-preserving"):
        check_tool_template(shifting)
    check_tool_template(tok)


# ------------------------------------------------------------------------------------------- running calls

def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_calls_run_with_trls_semantics(tool_module):
    """Each call counts; an unknown tool, a raising tool, wrong arguments, another call type, a raising async tool:
    failures whose result is TRL's {"error": str(e)}; results as str (content blocks as they are); the sync results
    first in call order, then the async ones (TRL's order). A malformed call (TRL would raise) is one more failure."""
    m = tool_module
    box = Toolbox((m.add, m.broken, m.slow, m.failing, m.blocks))
    done = run_tool_calls(box, [_call("slow", seconds=0.01), _call("add", a=2, b=3), _call("nope"),
                                _call("broken", x="x"), _call("add", a=1), {"type": "retrieval", "name": "web"},
                                _call("failing", x="y"), _call("blocks", seconds=0),
                                {"type": "function", "function": "add(1, 2)"}], timeout=None)
    assert (done.calls, done.failures) == (9, 6)
    assert [(msg["name"], msg["content"]) for msg in done.messages] == [
        ("add", "5"),
        ("nope", str({"error": "Tool nope not found."})),
        ("broken", str({"error": "broken on x"})),
        ("add", str({"error": "add() missing 1 required positional argument: 'b'"})),
        ("web", str({"error": "Unsupported tool call type: retrieval"})),
        ("blocks", [{"type": "text", "text": "a block"}]),
        ("unknown", str({"error": "malformed tool call {'type': 'function', 'function': 'add(1, 2)'}"})),
        ("slow", "slept"),
        ("failing", str({"error": "failing on y"})),
    ]
    assert all(msg["role"] == "tool" for msg in done.messages)
    assert run_tool_calls(box, [], timeout=None).calls == 0


def test_a_tool_that_overruns_its_timeout_is_a_failed_call(tool_module):
    """A blocking sync tool and a sleeping async one, each past a 0.2 s timeout: failed calls returned at once (the
    sync one is abandoned in its daemon thread), not a hung rollout."""
    m = tool_module
    box = Toolbox((m.hang, m.slow, m.add))
    start = time.perf_counter()
    done = run_tool_calls(box, [_call("hang", seconds=120), _call("slow", seconds=120), _call("add", a=1, b=1)],
                          timeout=0.2)
    # not waited for: a bound far below the tools' 120 s, not a timing figure (a loaded machine stays far under it)
    assert time.perf_counter() - start < 60
    assert (done.calls, done.failures) == (3, 2)
    timed_out = str({"error": "tool call timed out after 0.2 s"})
    assert [msg["content"] for msg in done.messages] == [timed_out, "2", timed_out]


# ------------------------------------------------------------------------------------------- paths, trust, config

def test_tools_and_environments_resolve_under_the_trust_model(tool_module):
    """trust.tool_modules allows a module (prefix) for train.tools and train.environment_factory, apart from
    trust.reward_modules; nothing is imported before the check; each refusal is one line naming the key."""
    from pydantic import ValidationError

    from tasks.parameters.params import Params

    def params(tools=(), environment=None, modules=(TOOLS_MODULE,), reward_modules=()):
        return Params.model_validate({
            "trust": {"tool_modules": list(modules), "reward_modules": list(reward_modules)},
            "train": {"algo": "grpo", "tools": list(tools), "environment_factory": environment}})

    ok = params([f"{TOOLS_MODULE}:add", f"{TOOLS_MODULE}:slow"], f"{TOOLS_MODULE}:Counter")
    assert ok.train.tools == [f"{TOOLS_MODULE}:add", f"{TOOLS_MODULE}:slow"]
    refused = {
        (f"{TOOLS_MODULE}:add", None, (), (TOOLS_MODULE,)):
            f"train.tools[0]: module '{TOOLS_MODULE}' is not in trust.tool_modules (empty); not imported",
        ("os:system", None, (TOOLS_MODULE,), ()): "train.tools[0]: module 'os' is not in trust.tool_modules",
        (f"{TOOLS_MODULE}:imported_run", None, (TOOLS_MODULE,), ()):
            f"train.tools[0]: tool '{TOOLS_MODULE}:imported_run': {TOOLS_MODULE}.imported_run is subprocess:run, "
            "not a function defined at module level",
        (f"{TOOLS_MODULE}:subprocess.run", None, (TOOLS_MODULE,), ()): "one name after the colon, no attribute path",
        (f"{TOOLS_MODULE}:undocumented", None, (TOOLS_MODULE,), ()): "the model cannot be told how to call it",
        (None, "os:getcwd", (TOOLS_MODULE,), ()): "train.environment_factory: module 'os' is not in trust.tool_modules",
        (None, f"{TOOLS_MODULE}:TEMPERATURE", (TOOLS_MODULE,), ()): f"module '{TOOLS_MODULE}' has no 'TEMPERATURE'",
    }
    for (tool, environment, modules, reward_modules), says in refused.items():
        with pytest.raises(ValidationError) as err:
            params([tool] if tool else [], environment, modules, reward_modules)
        message = str(err.value)
        assert says in message, (tool, environment, message)
        assert len([line for line in message.splitlines() if says[:30] in line]) == 1, message
    with pytest.raises(ValueError, match="an environment needs a reset"):  # checked when the trainer builds it
        from rlhf_core.tools import check_environment

        check_environment(import_environment_factory(f"{TOOLS_MODULE}:NoReset")(), "NoReset")
    assert import_tool(f"{TOOLS_MODULE}:add") is tool_module.add


@pytest.mark.parametrize("settings, says", [
    (dict(algo="ppo", tools=["m:f"]), "tools: multi-turn rollouts are implemented for algo grpo and rloo"),
    (dict(algo="grpo", environment_factory="m:C", stop_token=None), "environment_factory: multi-turn rollouts need"),
    (dict(algo="grpo", tools=["m:f", "n:f"]), "names one tool twice"),
    (dict(algo="grpo", max_tool_calling_iterations=2), "max_tool_calling_iterations: has no effect without tools"),
    (dict(algo="grpo", tool_timeout=5.0), "tool_timeout: has no effect without tools"),
    (dict(algo="grpo", tools=["m.f"]), "tools[0]: tool 'm.f': expected 'package.module:function'"),
    (dict(algo="rloo", tools=["m:f"], rloo={"kl_level": "token", "normalize_advantage": True}), "whiten over the tool"),
    (dict(algo="grpo", tools=["m:f"], max_tool_calling_iterations=-1), "max_tool_calling_iterations"),
])
def test_config_refuses_what_multi_turn_rollouts_cannot_do_by_name(settings, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        RLConfig(**settings)


def test_config_takes_trls_tool_options():
    cfg = RLConfig(algo="grpo", tools=["m:f"], environment_factory="m:Env", max_tool_calling_iterations=3)
    assert cfg.uses_tools and cfg.max_tool_calling_iterations == 3 and cfg.tool_timeout == 30.0
    assert RLConfig(algo="rloo", environment_factory="m:Env", tool_timeout=None).uses_tools
    assert not RLConfig(algo="grpo").uses_tools


# ------------------------------------------------------------------------------------------- the decode loop

def _episodes(tok, module, questions, tools):
    prompts = [render_ids(tok, [{"role": "user", "content": q}], tools=tools, generation_prompt=True)
               for q in questions]
    from rlhf_core.batching import pad

    queries, query_mask = pad(prompts, tok.pad_token_id, "left")
    return prompts, queries, query_mask, [Episode(Toolbox(tuple(tools))) for _ in questions]


def test_the_kv_cache_is_carried_across_turns(tok, tool_module, model_config):
    """Three episodes in one batch, prompts of different lengths: one calls a tool then answers, one answers at once
    (then waits while the others go on), one calls a failing tool then two tools in one turn then answers. Every
    step's logits, from the cache carried across turns and masked slots, equal a full forward over the finished
    sequences; the completions are the turns and the suffixes of the real results, in order, with their tool mask."""
    m = tool_module
    model = init_causal_lm(model_config, seed=0).eval()
    tools = [m.add, m.broken, m.slow]
    prompts, queries, query_mask, episodes = _episodes(tok, m, ["what is two plus three", "say hello",
                                                                "what is one plus one and more"], tools)
    turns = [[ids(tok, call("add", a=2, b=3)), ids(tok, "the answer is five")],
             [ids(tok, "hello")],
             [ids(tok, call("broken", x="x")), ids(tok, call("add", a=1, b=1) + call("slow", seconds=0.01)),
              ids(tok, "two")]]
    replay = Replay([flat(t) for t in turns])
    out = multi_turn_decode(model, queries, query_mask, episodes, tokenizer=tok, choose=replay, response_length=120,
                            stop_token_id=tok.eos_token_id, max_iterations=None, timeout=5.0, max_positions=512)
    results = [[[("add", "5")]], [], [[("broken", str({"error": "broken on x"}))], [("add", "2"), ("slow", "slept")]]]
    for row, (row_turns, row_results) in enumerate(zip(turns, results, strict=True)):
        expected, mask = [], []
        for i, turn in enumerate(row_turns):
            expected += turn
            mask += [1] * len(turn)
            if i < len(row_results):
                suffix = tool_suffix_ids(tok, [{"role": "tool", "name": n, "content": c} for n, c in row_results[i]])
                expected += suffix
                mask += [0] * len(suffix)
        assert out.ids[row] == expected and out.tool_mask[row] == mask, row
    assert (out.calls, out.failures) == ([1, 0, 3], [0, 0, 1])
    # every step's logits against one full forward over prompt + completion (what training computes)
    from rlhf_core.batching import pad

    responses, response_mask = pad(out.ids, tok.pad_token_id, "right")
    with torch.no_grad():
        full = response_logits(model, (queries, query_mask, responses, response_mask), 1.0)  # (B, R, V)
    compared = 0
    for rows, steps, logits in replay.steps:
        for i, (row, step) in enumerate(zip(rows, steps, strict=True)):
            torch.testing.assert_close(logits[i], full[row, step], rtol=1e-4, atol=1e-5)
            compared += 1
    assert compared == sum(map(sum, out.tool_mask)), "one step per token the model wrote"
    kept = torch.tensor([lp for row in out.logprobs for lp in row])
    recomputed = ops.selective_log_softmax(full / TEMPERATURE, responses)[response_mask]
    written = torch.tensor([t for row in out.tool_mask for t in row], dtype=torch.bool)
    torch.testing.assert_close(kept[written], recomputed[written], rtol=1e-5, atol=1e-5)
    assert (kept[~written] == 0).all(), "a tool result's sampling log-prob is 0"


def test_budget_rollback_and_iteration_cap_follow_trl(tok, tool_module, model_config):
    """TRL's rules on our side: a tool result that would pass the budget is dropped and the episode ends with its
    call (the call ran and counts); an answer after a tool is cut at the budget; with max_tool_calling_iterations 1
    the second round's calls are not run."""
    m = tool_module
    model = init_causal_lm(model_config, seed=0).eval()
    tools = [m.add, m.repeat]
    _, queries, query_mask, episodes = _episodes(tok, m, ["what is two plus three"] * 3, tools)
    long_call, add = ids(tok, call("repeat", word="hello", times=80)), ids(tok, call("add", a=2, b=3))
    turns = [[long_call], [add, ids(tok, "the answer is five and that is all " * 8)], [add, add, add]]
    out = multi_turn_decode(model, queries, query_mask, episodes, tokenizer=tok, choose=Replay([flat(t) for t in turns]),
                            response_length=60, stop_token_id=tok.eos_token_id, max_iterations=1, timeout=None)
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "5"}])
    assert out.ids[0] == long_call and out.calls[0] == 1, "rolled back: the result would pass the budget"
    assert len(out.ids[1]) == 60 and out.ids[1][:len(add) + len(suffix)] == add + suffix
    assert out.ids[1][-1] != tok.eos_token_id, "the answer was cut at the budget"
    assert out.ids[2] == add + suffix + add and out.calls[2] == 1, "the second round's call is not run"


def test_keyed_sampling_after_a_tool_does_not_depend_on_the_batch(tok, tool_module, model_config):
    """sampling_seed=episode: an episode's tokens after its tool results are the same alone or beside others that
    stopped earlier or called other tools (its keys follow its own token index, its positions its own tokens)."""
    from rlhf_core.decode import TokenChoice

    m = tool_module
    model = init_causal_lm(model_config, seed=0).eval()
    tools = [m.add, m.broken]
    questions = ["what is two plus three", "say hello", "count to five"]
    _, queries, query_mask, episodes = _episodes(tok, m, questions, tools)
    keys = ops.episode_keys(0, 0, torch.arange(3), torch.zeros(3, dtype=torch.long))
    scripts = [ids(tok, call("add", a=2, b=3)), ids(tok, "hello"), ids(tok, call("broken", x="x") + call("add", a=1, b=1))]

    def run(rows):
        sampler = Sampler(TokenChoice(temperature=TEMPERATURE), keys[rows], keep_logprobs=True)
        from rlhf_core.batching import pad

        prompts = [queries[r][query_mask[r]].tolist() for r in rows]
        q, qm = pad(prompts, tok.pad_token_id, "left")
        return multi_turn_decode(model, q, qm, [episodes[r] for r in rows], tokenizer=tok,
                                 choose=Replay([scripts[r] for r in rows], then=sampler), response_length=30,
                                 stop_token_id=tok.eos_token_id, max_iterations=1, timeout=None)

    together = run([0, 1, 2])
    for row in (0, 2):
        alone = run([row])
        assert alone.ids[0] == together.ids[row]
        torch.testing.assert_close(torch.tensor(alone.logprobs[0]), torch.tensor(together.logprobs[row]),
                                   rtol=1e-5, atol=1e-5)
    assert len(together.ids[0]) > len(scripts[0]) + 3, "it sampled after its results"


# ------------------------------------------------------------------------------------------- the mask in the loss

def _masked_rollout(seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    B, R = 4, 7
    response_mask = torch.arange(R)[None, :] < torch.tensor([7, 5, 6, 3])[:, None]
    tool_mask = torch.ones(B, R, dtype=torch.bool)
    tool_mask[0, 2:4] = tool_mask[2, 1:3] = tool_mask[1, 4] = False
    written = response_mask & tool_mask
    logprobs = -torch.rand(B, R, generator=g) * written
    return Rollout(queries=torch.ones(B, 2, dtype=torch.long), query_mask=torch.ones(B, 2, dtype=torch.bool),
                   responses=torch.ones(B, R, dtype=torch.long), response_mask=response_mask, logprobs=logprobs,
                   ref_logprobs=(logprobs - 0.3 * torch.rand(B, R, generator=g)) * written,
                   contains_stop=torch.tensor([True, True, False, True]), scores=torch.randn(B, generator=g),
                   tool_mask=tool_mask, in_loss=torch.tensor([True, True, False, True]))


@pytest.mark.parametrize("algo, options", [("grpo", dict(loss_type="dapo", beta=0.1)),
                                           ("grpo", dict(loss_type="grpo", beta=0.1,
                                                         importance_sampling_level="sequence")),
                                           ("rloo", dict(beta=0.1)),
                                           ("rloo", dict(beta=0.1, rloo={"kl_level": "token"}))])
def test_tool_results_are_out_of_the_loss_and_the_kl(algo, options):
    """TRL's loss mask (completion mask * tool mask, a truncated completion's zeroed): no gradient reaches a tool
    result's log-prob, in GRPO's loss (KL term included) and RLOO's (sequence and token level), and the KL that
    RLOO puts in the reward and every algorithm logs counts none of them (their log-probs are 0 on both sides)."""
    batch = _masked_rollout()
    assert batch.loss_mask.equal(batch.response_mask & batch.tool_mask & batch.in_loss[:, None])
    cfg = RLConfig(algo=algo, num_generations=2, response_length=7, **options)
    module = {"grpo": grpo, "rloo": rloo}[algo]
    filled, stats = module.compute_advantages(batch, cfg)
    tools_out = ~batch.tool_mask & batch.response_mask
    # the logged (and RLOO's reward) KL sums over the response: the same with the tool results dropped from it
    kl = ops.kl_penalty(batch.logprobs, batch.ref_logprobs, cfg.kl_estimator)
    torch.testing.assert_close(stats["kl"], (kl * (batch.response_mask & batch.tool_mask)).sum(1))
    new = (batch.logprobs + 0.05 * torch.randn(batch.logprobs.shape)).requires_grad_(True)
    loss, _ = module.loss(PolicyOutput(logprobs=new, entropy=None), filled, cfg)
    loss.backward()
    assert (new.grad[tools_out] == 0).all(), "a tool result's log-prob moves nothing"
    assert new.grad[batch.loss_mask].abs().sum() > 0, "the model's tokens do train"


# ------------------------------------------------------------------------------------------- against TRL 1.16.0

R_TRL, LR, ADAM_EPS = 100, 1e-3, 1e-5


def _tool_world(tmp_path_factory, tok, model_config):
    """The reference saved where TRL loads it from (with the tokenizer), and the policy moved away from it."""
    model_dir = tmp_path_factory.mktemp("trl116-tools") / "policy"
    ref = init_causal_lm(model_config, seed=0)
    ref.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    policy = init_causal_lm(model_config, seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model_dir, ref.eval(), policy


def _scenarios(tok) -> dict:
    """Two updates' forced turns (per episode, prompt-major, 2 per prompt), each first turn distinct (TRL's side
    tells the episodes apart by it) and at most the budget (TRL's first generation never passes it)."""
    answer, long = ids(tok, "the answer is five"), ids(tok, "and so the answer is five and that is all " * 6, eos=False)
    tools = {
        "questions": ["what is two plus three", "what is one plus one", "count to five", "what is four plus four"],
        "tools": ["add", "broken", "repeat", "slow"], "environment": None,
        "turns": [
            [ids(tok, call("add", a=2, b=3)), answer],                                       # a call, then the answer
            [ids(tok, "the answer is seven")],                                              # no call
            [ids(tok, call("broken", x="x")), ids(tok, call("add", a=1, b=1)), answer],     # a failure, 3 turns
            [ids(tok, call("nope", y=1)), answer],                                          # an unknown tool
            [ids(tok, call("add", a=4, b=4)), ids(tok, call("add", a=8, b=1)),
             ids(tok, call("add", a=9, b=1))],                                               # the cap: 3rd not run
            [ids(tok, call("slow", seconds=0.01) + call("broken", x="y")), long],          # async + sync, cut
            [ids(tok, call("repeat", word="hello", times=120))],                            # rolled back
            [ids(tok, "and so the answer is eight " * 20, eos=False)[:R_TRL]],              # truncated at once
        ]}
    environment = {
        "questions": ["count to five", "what is two plus three"], "tools": ["add"], "environment": "Counter",
        "turns": [
            [ids(tok, call("bump", by=2)), ids(tok, call("bump", by=3)), answer],
            [ids(tok, call("bump", by=-1) + call("bump", by="x")), answer],                 # a typed-argument failure
            [ids(tok, call("add", a=2, b=3)), answer],
            [ids(tok, "the answer is five.")],
        ]}
    return {"tools": tools, "environment": environment}


def _ours_with_tools(scenario: dict, world, tok, module_file: Path) -> tuple[dict, dict]:
    """Our trainer's rollout (the forced turns replayed), scores, advantages, gradients and one optimizer step; and
    TRL's case for the same."""
    model_dir, ref, policy = world
    B = len(scenario["turns"])
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in scenario["questions"]]
    rewards = torch.randn(B, generator=torch.Generator().manual_seed(11))
    rewards[2:4] = 0.5  # a group of equal rewards
    options = dict(num_generations=2, max_completion_length=R_TRL, temperature=TEMPERATURE, beta=0.04, epsilon=0.2,
                   mask_truncated_completions=True, max_tool_calling_iterations=2, loss_type="dapo")
    cfg = RLConfig(algo="grpo", tools=[f"{TOOLS_MODULE}:{name}" for name in scenario["tools"]],
                   environment_factory=scenario["environment"] and f"{TOOLS_MODULE}:{scenario['environment']}",
                   total_episodes=B, per_device_train_batch_size=B, gradient_accumulation_steps=1, num_epochs=1,
                   local_rollout_forward_batch_size=B, learning_rate=LR, adam_eps=ADAM_EPS, weight_decay=0.0,
                   lr_scheduler="constant", max_grad_norm=None, missing_eos_penalty=None, tool_timeout=None, **options)
    trainer = RLTrainer(cfg, copy.deepcopy(policy), lambda batch: rewards.clone(), [[1]] * len(rows),
                        pad_token_id=tok.pad_token_id, stop_token_id=tok.eos_token_id, ref_policy=ref, tokenizer=tok,
                        prompt_rows=rows)
    trainer.rollouts.tools.chooser = lambda choice, keys, keep: Replay([flat(t) for t in scenario["turns"]])
    metrics = MetricAccumulator()
    batch = trainer.score(trainer.rollout(range(len(rows))), metrics)
    filled, episode_stats = trainer.compute_advantages(batch)
    graded = copy.deepcopy(policy)
    out = PolicyAndValue(graded, fused_logprobs=True)(filled.queries, filled.query_mask, filled.responses,
                                                      filled.response_mask, TEMPERATURE, share_prompts=True)
    loss, _ = grpo.loss(out, filled, cfg)
    loss.backward()
    trainer.optimize(filled, metrics)
    logs = trainer.log(filled, episode_stats, metrics, elapsed=1.0, episodes=B)  # what the trainer logs
    width = int(filled.response_mask.sum(1).max())  # TRL pads its completions to the longest
    ours = {"batch": filled, "loss": loss.detach(), "metrics": logs,
            "grads": {n: p.grad.detach().clone() for n, p in graded.named_parameters() if p.grad is not None},
            "weights": {n: p.detach().clone() for n, p in trainer.unwrapped.policy.named_parameters()},
            "prompt_ids": [q[m].tolist() for q, m in zip(filled.queries, filled.query_mask, strict=True)],
            "completion_ids": [r[m].tolist() for r, m in zip(filled.responses, filled.response_mask, strict=True)],
            "tool_mask": [t[m].long().tolist() for t, m in zip(filled.tool_mask, filled.response_mask, strict=True)],
            "width": width}
    case = {"model_dir": str(model_dir), "policy_state": policy.state_dict(), "tools_file": str(module_file),
            "tools_module": TOOLS_MODULE, "tools": scenario["tools"], "environment": scenario["environment"],
            "prompts": [row["prompt"] for row in rows for _ in range(2)], "turns": scenario["turns"],
            "rewards": rewards, "old_logprobs": filled.logprobs[:, :width].clone(),
            "config": {**options, "gradient_checkpointing": False}, "step": {"lr": LR, "eps": ADAM_EPS}}
    return ours, case


def _run_trl(directory: Path, cases: list[dict]) -> list[dict]:
    if not TRL116_PYTHON.exists():
        pytest.fail(f"{TRL116_PYTHON} is missing: `make trl116` builds TRL 1.16.0's venv (make test does)")
    torch.save(cases, directory / "cases.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import trl116_side; "
              f"trl116_side.main_tools({str(directory / 'cases.pt')!r}, {str(directory / 'out.pt')!r})")
    done = subprocess.run([str(TRL116_PYTHON), "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(directory / "out.pt", weights_only=True)


@pytest.fixture(scope="module")
def trl_tool_runs(tmp_path_factory, tok, model_config, tool_module) -> dict:
    """Ours and TRL 1.16.0's GRPO update with tools, for both scenarios: {name: (ours, TRL's, the policy's weights)}."""
    world = _tool_world(tmp_path_factory, tok, model_config)
    module_file = Path(tool_module.__file__)
    runs, cases = {}, []
    for name, scenario in _scenarios(tok).items():
        ours, case = _ours_with_tools(scenario, world, tok, module_file)
        runs[name] = ours
        cases.append(case)
    start = time.perf_counter()
    trl = _run_trl(tmp_path_factory.mktemp("trl116-tool-runs"), cases)
    print(f"TRL's side: {time.perf_counter() - start:.1f} s")
    before = {n: p.detach().clone() for n, p in world[2].named_parameters()}
    return {name: (runs[name], theirs, before) for name, theirs in zip(runs, trl, strict=True)}


@pytest.mark.parametrize("name", ["tools", "environment"])
def test_grpo_update_with_tools_equals_trl_1_16(name, trl_tool_runs, tok):
    """The same forced turns through TRL 1.16.0's `_tool_call_loop` and ours: the prompts rendered with the tools, the
    completions (turns, suffixes, rollback, truncation), the tool mask, tools/call_frequency and
    tools/failure_frequency, the advantages (with the environment's get_reward as one more source), the loss, every
    gradient, and the weights after one AdamW step, to float rounding. Several turns, failing tools (raising, unknown,
    badly typed), the iteration cap (2), sync and async calls in one turn, a rollback, truncations."""
    ours, trl, before = trl_tool_runs[name]
    assert ours["prompt_ids"] == trl["prompt_ids"], "the prompts rendered with the tools"
    assert ours["completion_ids"] == trl["completion_ids"]
    assert ours["tool_mask"] == trl["tool_mask_list"]
    assert any(0 in mask for mask in trl["tool_mask_list"]), "tool results in the completions"
    for metric in ("tools/call_frequency", "tools/failure_frequency"):
        assert ours["metrics"][metric] == pytest.approx(trl["metrics"][metric], rel=1e-6), metric
    assert trl["metrics"]["tools/failure_frequency"] > 0
    batch, width = ours["batch"], ours["width"]
    assert width == trl["completion_mask"].shape[1]
    torch.testing.assert_close(batch.advantages.view(-1), trl["advantages"], rtol=1e-5, atol=1e-6)
    kept = batch.loss_mask[:, :width]
    torch.testing.assert_close(kept.long(), (trl["completion_mask"] * trl["tool_mask"]).long())
    torch.testing.assert_close(batch.ref_logprobs[:, :width] * kept, trl["ref_per_token_logps"] * kept, rtol=1e-5,
                               atol=1e-5)
    assert ours["loss"].item() == pytest.approx(trl["loss"].item(), rel=1e-5, abs=1e-7)
    scale = max(g.abs().max().item() for g in trl["grads"].values())
    assert scale > 0 and set(ours["grads"]) == set(trl["grads"])
    for key, grad in ours["grads"].items():
        torch.testing.assert_close(grad, trl["grads"][key], rtol=1e-4, atol=1e-5 * scale, msg=key)
    moved = max((trl["weights"][k] - before[k]).abs().max().item() for k in before)
    assert moved > LR / 2, "TRL's weights did not move; the check would be empty"
    for key in before:
        torch.testing.assert_close(ours["weights"][key] - before[key], trl["weights"][key] - before[key], rtol=1e-3,
                                   atol=0.02 * LR, msg=key)
    written = batch.response_mask & batch.tool_mask
    assert (batch.logprobs[~written] == 0).all() and (batch.ref_logprobs[~written] == 0).all(), \
        "a tool result's rollout and reference log-probs are 0: no KL anywhere counts it"
    print(f"{name}: loss {ours['loss'].item():.6g} vs {trl['loss'].item():.6g}, calls "
          f"{ours['metrics']['tools/call_frequency']:.3f}, failures {ours['metrics']['tools/failure_frequency']:.3f}")


def test_the_scenarios_reach_every_rule(trl_tool_runs, tok):
    """The forced turns are not vacuous: TRL itself ran out the iteration cap, rolled one episode back, cut answers
    at the budget, and the environment's reward moved the advantages."""
    ours, trl, _ = trl_tool_runs["tools"]
    turns = _scenarios(tok)["tools"]["turns"]
    assert trl["turns_used"][4] == 3, "the cap: three turns, the third's call not run"
    assert trl["completion_ids"][6] == turns[6][0], "the long result was rolled back"
    assert len(trl["completion_ids"][5]) == R_TRL and trl["completion_ids"][5][-1] != tok.eos_token_id
    assert trl["completion_mask"][5].sum() == 0, "a truncated completion is out of the loss (mask_truncated)"
    env_ours, _, _ = trl_tool_runs["environment"]
    assert env_ours["batch"].env_rewards.tolist() == [5.0, -1.0, 0.0, 0.0], "bump 2 + 3; -1 then a failed bump"


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_trainer_trains_with_an_environment(algo, tok, tool_module, model_config):
    """Two updates of the trainer, GRPO and RLOO (its KL in the reward), with a tool and an environment: each episode's
    first turn a forced call of the environment's `bump`, then sampling (keyed per episode) after its result. The
    environments are pooled (one per episode, reset for each), the tool metrics and the environment's reward are
    logged under TRL's names, and in the rollout a tool result's log-probs are 0, its loss mask False."""
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS[:2]]
    cfg = RLConfig(algo=algo, tools=[f"{TOOLS_MODULE}:add"], environment_factory=f"{TOOLS_MODULE}:Counter",
                   total_episodes=8, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_epochs=1,
                   local_rollout_forward_batch_size=4, response_length=40, temperature=1.0, num_generations=2,
                   learning_rate=1e-3, sampling_seed="episode", max_tool_calling_iterations=1, kl_coef=0.05)
    batches = []
    trainer = RLTrainer(cfg, init_causal_lm(model_config, seed=0), lambda batch: torch.zeros(len(batch)),
                        [[1]] * len(rows), pad_token_id=tok.pad_token_id, stop_token_id=tok.eos_token_id,
                        tokenizer=tok, prompt_rows=rows, on_update=lambda _, batch, __: batches.append(batch))
    bump = ids(tok, call("bump", by=2))
    trainer.rollouts.tools.chooser = lambda choice, keys, keep: Replay([bump] * 4, then=Sampler(choice, keys, keep))
    history = trainer.train()
    assert len(history) == 2 and len(trainer.rollouts.tools.pool) == 4
    assert history[-1]["tools/call_frequency"] == 1.0 and history[-1]["tools/failure_frequency"] == 0.0
    assert history[-1]["rewards/Counter/mean"] == 2.0
    assert all(k in history[-1] for k in ("loss/policy_avg", "objective/kl")), sorted(history[-1])
    for batch in batches:
        results = batch.response_mask & ~batch.tool_mask
        assert results.sum(1).min() > 0, "every episode has its tool result in its completion"
        assert (batch.logprobs[results] == 0).all() and (batch.ref_logprobs[results] == 0).all()
        assert not batch.loss_mask[results].any()
        assert (batch.response_lengths > len(bump) + results.sum(1)).all(), "it sampled after the result"
    with pytest.raises(ValueError, match="needs the tokenizer and the prompt rows"):
        RLTrainer(cfg, init_causal_lm(model_config, seed=0), lambda batch: torch.zeros(len(batch)), [[1]] * 2,
                  pad_token_id=tok.pad_token_id, stop_token_id=tok.eos_token_id)


def test_tool_rollouts_refuse_prompts_that_are_not_conversations(tok, tool_module):
    cfg = RLConfig(algo="grpo", tools=[f"{TOOLS_MODULE}:add"])
    with pytest.raises(ValueError, match="prompt row 1 is not a conversation"):
        ToolRollouts(cfg, tok, [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": "hi"}])


# ------------------------------------------------------------------------ through the pipeline: evaluate and trace

def test_greedy_evaluation_runs_the_tools_and_reports_their_rates(tok, tool_module, model_config):
    """evaluate's greedy rollout is multi-turn with tools: the calls the model writes run (here forced: a call of add,
    one of broken, none), their results join the completion, and the report has TRL's tool figures, calls per
    completion and failures per call, for the policy and the reference, next to the win rates; KL and length count
    the model's tokens only, and the gold reward reads the model's words only (the table shows the tool's result)."""
    from rlhf_core.greedy_eval import evaluate

    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS[:3]]
    cfg = RLConfig(algo="grpo", tools=[f"{TOOLS_MODULE}:add", f"{TOOLS_MODULE}:broken"], response_length=40,
                   max_tool_calling_iterations=1)
    tools = ToolRollouts(cfg, tok, rows)
    scripts = [ids(tok, call("add", a=2, b=3)), ids(tok, call("broken", x="x")), ids(tok, "the answer is five")]
    tools.chooser = lambda choice, keys, keep: Replay(scripts, then=Sampler(choice, keys, keep))
    gold_read = []  # what the gold reward reads: the policy's own words, not the tool's result
    report = evaluate(init_causal_lm(model_config, seed=0), init_causal_lm(model_config, seed=1), tok,
                      ["unused"] * 3, scorer=lambda batch: torch.zeros(len(batch)), response_length=40,
                      temperature=1.0, gold=lambda prompt, completion, eos: gold_read.append(completion) or 1.0,
                      tools=tools)
    summary, table = report.summary, report.rows
    for prefix in ("", "ref_"):
        assert summary[f"{prefix}tool_call_rate"] == pytest.approx(2 / 3)
        assert summary[f"{prefix}tool_failure_rate"] == pytest.approx(1 / 2), "broken's call failed"
    assert [(r["tool_calls"], r["tool_failures"]) for r in table] == [(1, 0), (1, 1), (0, 0)]
    assert table[0]["completion"].startswith(call("add", a=2, b=3) + "5"), "the tool's result follows its call"
    assert '"name": "add"' in table[0]["prompt"], "the prompt as rendered with its tools"
    assert table[0]["score_gold"] == 1.0 and {"win_rate_gold", "win_rate_rm", "mean_kl"} <= summary.keys()
    assert gold_read[0].startswith(call("add", a=2, b=3)) and not gold_read[0].startswith(call("add", a=2, b=3) + "5")
    assert table[0]["completion"].removeprefix(call("add", a=2, b=3) + "5") == gold_read[0].removeprefix(
        call("add", a=2, b=3)), "the gold reward reads the completion without the tool's result"
    with_results = sum(len(ids(tok, r["completion"], eos=False)) for r in table) / 3
    assert summary["mean_length"] < with_results, "the tool results are not the policy's tokens"


def test_the_trace_shows_each_turn_and_which_tokens_were_trained(tok, tool_module, model_config, tmp_path):
    """The reward-flow trace of a multi-turn update: the turns in order (the model's call, the tool's result, the
    model's answer), each token's turn and source, tool results untrained with log-prob 0; the heatmap is drawn."""
    from rlhf_core.trace import trace_update
    from tasks.reports.plots import plot_trace

    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS[:2]]
    cfg = RLConfig(algo="grpo", tools=[f"{TOOLS_MODULE}:add"], total_episodes=4, per_device_train_batch_size=4,
                   gradient_accumulation_steps=1, num_epochs=1, local_rollout_forward_batch_size=4, response_length=40,
                   temperature=1.0, num_generations=2, max_tool_calling_iterations=1, sampling_seed="episode")
    traces = []
    trainer = RLTrainer(cfg, init_causal_lm(model_config, seed=0), lambda batch: torch.zeros(len(batch)),
                        [[1]] * len(rows), pad_token_id=tok.pad_token_id, stop_token_id=tok.eos_token_id,
                        tokenizer=tok, prompt_rows=rows,
                        on_update=lambda _, batch, stats: traces.append(
                            trace_update(batch, stats, cfg, update=1, decode=tok.decode, rollouts=2)))
    add = ids(tok, call("add", a=2, b=3))
    trainer.rollouts.tools.chooser = lambda choice, keys, keep: Replay([add] * 4, then=Sampler(choice, keys, keep))
    trainer.train()
    rollout = traces[0]["rollouts"][0]
    turns = rollout["turns"]
    assert [t["source"] for t in turns][:3] == ["model", "tool", "model"] and rollout["tool_calls"] == 1
    assert turns[0]["text"] == tok.decode(add) and "5" in turns[1]["text"]
    assert [(t["start"], t["end"]) for t in turns] == list(zip([0] + [t["end"] for t in turns[:-1]],
                                                               [t["end"] for t in turns], strict=True))
    tokens = rollout["tokens"]
    assert all(t["trained"] == (t["source"] == "model") for t in tokens)
    assert all(t["logprob"] == 0.0 for t in tokens if t["source"] == "tool")
    assert [t["turn"] for t in tokens[turns[1]["start"]:turns[1]["end"]]] == [1] * (turns[1]["end"] - turns[1]["start"])
    plot_trace(traces[0], tmp_path / "trace.png")
    assert (tmp_path / "trace.png").stat().st_size > 0


def test_the_evaluate_stage_takes_trains_tools_at_its_own_budget(tok, tool_module):
    from tasks.parameters.params import Params
    from tasks.stages.evaluate import tool_rollouts

    rows = [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS[:2]]
    params = Params.model_validate({"trust": {"tool_modules": [TOOLS_MODULE]}, "evaluate": {"response_length": 17},
                                    "train": {"algo": "grpo", "tools": [f"{TOOLS_MODULE}:add"],
                                              "environment_factory": f"{TOOLS_MODULE}:Counter",
                                              "max_tool_calling_iterations": 2}})
    tools = tool_rollouts(params, tok, rows)
    assert (tools.cfg.response_length, tools.cfg.max_tool_calling_iterations) == (17, 2)
    assert [fn.__name__ for fn in tools.tools] == ["add"] and tools.reward_name == "Counter"
    assert tool_rollouts(Params(), tok, rows) is None, "no tools: single-turn greedy completions as before"
