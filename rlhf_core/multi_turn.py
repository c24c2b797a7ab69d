"""Multi-turn rollouts with tools (TRL 1.16's GRPOTrainer `_tool_call_loop`), decoded by the rollout's own loop.

The episodes of a rollout chunk go in rounds, all together, as TRL's loop does:

    sample    each episode in play samples its turn, one token per step (decode.py's `_choose`: the same processors,
              keyed draws and log-probs), until the stop token or the completion budget (`response_length`, TRL's
              max_completion_length) counted over the whole completion
    tools     while the round is below `max_tool_calling_iterations`, each turn is parsed (tool_chat.parse_turn) and
              its calls run (tools.run_tool_calls); the tool messages become suffix ids (tool_chat.tool_suffix_ids)
              appended to the completion with tool mask 0 and log-prob 0, unless prompt + completion + suffix would
              pass the budget or the model's positions: the episode then ends as it was (TRL's rollback; its calls
              ran and count)
    continue  episodes that called a tool and have budget left feed the suffix into the KV cache and sample again

until no episode continues. The KV cache is carried across turns (`TurnForwards`), never rebuilt from the text: every
forward appends one block of slots to all rows, masked where a row has nothing to add (it is waiting, or done), each
real token at its row's own next position, so a row's keys are exactly its own tokens at their positions and the
logits equal a full forward over the finished sequence to rounding (tests/test_tools.py). The completion is the
model's turns and the tool suffixes in order; the training forward attends to all of it and the loss and KL skip the
suffixes (`Rollout.tool_mask`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlhf_core import chat
from rlhf_core.batching import pad
from rlhf_core.decode import TokenChoice, _choose
from rlhf_core.kv_cache import CACHE, GrowingCache
from rlhf_core.rollout import distinct_prompts, position_ids, prefill_shared_prompts, reading_last
from rlhf_core.tool_chat import check_tool_template, parse_turn, render_ids, tool_suffix_ids
from rlhf_core.tools import (
    Toolbox,
    check_environment,
    environment_reward,
    environment_tools,
    import_environment_factory,
    import_tool,
    run_tool_calls,
)

TokenChooser = Callable[[Tensor, Tensor, list[int], Tensor], tuple[Tensor, Tensor | None]]
"""(logits (n, V) of the rows `rows` (n,), each row's index in its completion, the rows' tokens so far (n, P + R)) ->
((n,) chosen tokens, (n,) their log-probs under softmax(logits / temperature) or None)."""


class Sampler:
    """The rollout's `TokenChooser`: decode.py's `_choose` (processors, keyed or stream draws, log-probs). A keyed draw
    is keyed by the token's index in its own completion, as in single-turn decoding, so an episode's sample does not
    depend on the others in its batch; rows at different indices draw in one call per index."""

    def __init__(self, choice: TokenChoice, noise_keys: Tensor | None, keep_logprobs: bool):
        self.choice, self.processors = choice, choice.processors()
        self.noise_keys, self.keep_logprobs = noise_keys, keep_logprobs

    def __call__(self, logits: Tensor, rows: Tensor, steps: list[int], seen: Tensor) -> tuple[Tensor, Tensor | None]:
        keys = None if self.noise_keys is None else self.noise_keys[rows]
        if keys is None or len(set(steps)) == 1:
            return _choose(logits, self.choice, self.processors, seen, keys, steps[0], self.keep_logprobs)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        logprobs = torch.empty(len(rows), device=logits.device) if self.keep_logprobs else None
        for step in sorted(set(steps)):
            group = torch.tensor([i for i, s in enumerate(steps) if s == step], device=logits.device)
            chosen, logprob = _choose(logits[group], self.choice, self.processors, seen[group], keys[group], step,
                                      self.keep_logprobs)
            tokens[group] = chosen
            if logprobs is not None:
                logprobs[group] = logprob
        return tokens, logprobs


class TurnForwards:
    """The policy's forwards over B episodes whose tokens arrive in turns, on one KV cache from the prompt to the last
    token (a `GrowingCache`: no-grad, appended in place). Every `feed` appends S slots to all rows; `real` marks the
    slots a row fills, the rest stay masked for good. Positions count a row's real tokens only."""

    def __init__(self, model: nn.Module, queries: Tensor, query_mask: Tensor, capacity: int):
        self.model, self.queries, self.query_mask = model, queries, query_mask
        self.cache = GrowingCache(capacity)
        self.attended = query_mask.bool()  # (B, L): the slots each row attends to
        self.next_position = query_mask.long().sum(1)  # (B,) the position of each row's next real token

    def prefill(self) -> Tensor:
        """The prompts' forward (each distinct prompt once): the (B, V) logits of each row's last prompt token."""
        queries, query_mask = self.queries, self.query_mask
        groups = distinct_prompts(queries, query_mask)
        with reading_last(self.model, 1):
            if groups is None:
                out = self.model(input_ids=queries, attention_mask=query_mask.long(),
                                 position_ids=position_ids(query_mask), use_cache=True, logits_to_keep=1,
                                 **{CACHE: self.cache})
                return out.logits[:, -1]
            prompts, _ = prefill_shared_prompts(self.model, queries, query_mask, groups, reads=1, logits_to_keep=1,
                                                **{CACHE: self.cache})
            return prompts.logits[groups[1], -1]

    def feed(self, tokens: Tensor, real: Tensor) -> Tensor:
        """Append (B, S) `tokens`, real where `real` (B, S) (a row's real tokens last: it pads on the left); the (B, V)
        logits after each row's last slot, which for a row that fed anything are those of its last real token."""
        positions = (self.next_position[:, None] + real.long().cumsum(1) - 1).clamp(min=0)  # (B, S)
        self.attended = torch.cat([self.attended, real], dim=1)  # (B, L + S)
        self.next_position = self.next_position + real.long().sum(1)
        out = self.model(input_ids=tokens, attention_mask=self.attended.long(), position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{CACHE: self.cache})
        return out.logits[:, -1]


@dataclass(frozen=True)
class Episode:
    """What one episode calls: its tools (the configured ones, then its environment's methods) and its environment."""

    toolbox: Toolbox
    environment: object | None = None


@dataclass
class Turns:
    """The completions of a chunk's episodes as token lists (B of each), filled turn by turn."""

    ids: list[list[int]]  # the model's turns and the tool suffixes, in order
    tool_mask: list[list[int]]  # 1 on the model's tokens, 0 on tool suffixes (TRL's tool_mask)
    logprobs: list[list[float]]  # the sampling log-prob of each model token (0.0 if not kept), 0.0 on suffixes
    calls: list[int]  # tool calls made by each episode
    failures: list[int]  # of them, those that failed


def multi_turn_decode(model: nn.Module, queries: Tensor, query_mask: Tensor, episodes: Sequence[Episode], *,
                      tokenizer, choose: TokenChooser, response_length: int, stop_token_id: int,
                      max_iterations: int | None, timeout: float | None, template_kwargs: Mapping | None = None,
                      max_positions: int | None = None) -> Turns:
    """The multi-turn completions of left-padded (B, P) prompts (module docstring). `max_positions`: the model's
    (TRL's `max_position_embeddings`), a bound on prompt + completion + a tool suffix."""
    B, P = queries.shape
    R, limit = response_length, math.inf if max_iterations is None else max_iterations
    prompts = [q[m].tolist() for q, m in zip(queries, query_mask, strict=True)]
    out = Turns(ids=[[] for _ in range(B)], tool_mask=[[] for _ in range(B)], logprobs=[[] for _ in range(B)],
                calls=[0] * B, failures=[0] * B)
    # (B, P + R) each row's tokens so far, for the repetition penalty; slots not yet written hold the row's last prompt
    # token, already among them, so the penalty sees exactly the row's own tokens (tool results included, as TRL's)
    seen = torch.cat([queries, queries[:, -1:].expand(B, R)], dim=1).clone()
    forwards = TurnForwards(model, queries, query_mask, capacity=P + 2 * R)
    logits, playing, round_ = forwards.prefill(), list(range(B)), 0
    while True:
        starts = {row: len(out.ids[row]) for row in playing}
        unfed = _sample_turns(forwards, logits, playing, out, seen, choose, R, stop_token_id)
        if round_ >= limit:
            break
        continuing = []
        for row in playing:
            suffix = _call_tools(row, starts[row], prompts[row], episodes[row], out, tokenizer, timeout,
                                 template_kwargs)
            if suffix is None:
                continue
            length = len(out.ids[row]) + len(suffix)
            if length > R or (max_positions is not None and len(prompts[row]) + length >= max_positions):
                continue  # TRL's rollback: the results are dropped, the episode ends with its call
            _append_suffix(out, seen, P, row, suffix)
            if length < R:  # else no budget is left to answer: the episode ends with the results
                continuing.append((row, ([unfed[row]] if row in unfed else []) + suffix))
        if not continuing:
            break
        tokens, real = pad([ids for _, ids in continuing], 0, "left")  # (n, S)
        rows = torch.tensor([row for row, _ in continuing], device=queries.device)
        block = queries.new_zeros(B, tokens.shape[1])
        block_real = torch.zeros(B, tokens.shape[1], dtype=torch.bool, device=queries.device)
        block[rows], block_real[rows] = tokens.to(queries.device), real.to(queries.device)
        logits, playing, round_ = forwards.feed(block, block_real), [row for row, _ in continuing], round_ + 1
    return out


def _sample_turns(forwards: TurnForwards, logits: Tensor, playing: list[int], out: Turns, seen: Tensor,
                  choose: TokenChooser, R: int, stop_token_id: int) -> dict[int, int]:
    """Sample the turn of every row in `playing` from `logits` (B, V), step by step, each row until its stop token or
    the budget; each token is fed as soon as another row still needs the next logits. Returns {row: its last token}
    for the rows whose last token was not fed (those of the final step: fed later with their tool suffix)."""
    P, device = forwards.queries.shape[1], logits.device
    active = list(playing)
    while True:
        rows = torch.tensor(active, device=device)
        tokens, logprobs = choose(logits[rows], rows, [len(out.ids[r]) for r in active], seen[rows])
        chosen = tokens.tolist()  # the host decides who stops (a device sync per step)
        kept = [0.0] * len(active) if logprobs is None else logprobs.tolist()
        for row, token, logprob in zip(active, chosen, kept, strict=True):
            out.ids[row].append(token)
            out.tool_mask[row].append(1)
            out.logprobs[row].append(logprob)
        seen[rows, P + torch.tensor([len(out.ids[r]) - 1 for r in active], device=device)] = tokens
        still = [r for r, t in zip(active, chosen, strict=True) if t != stop_token_id and len(out.ids[r]) < R]
        if not still:
            return dict(zip(active, chosen, strict=True))
        step = forwards.queries.new_zeros(len(forwards.queries), 1)
        real = torch.zeros(len(forwards.queries), 1, dtype=torch.bool, device=device)
        step[rows, 0], real[rows, 0] = tokens, True
        logits = forwards.feed(step, real)
        active = still


def _call_tools(row: int, start: int, prompt: list[int], episode: Episode, out: Turns, tokenizer,
                timeout: float | None, template_kwargs: Mapping | None) -> list[int] | None:
    """Parse the turn of `row` that began at `start`; run its calls (counted) and return the suffix ids of their
    results, or None when the turn called nothing."""
    turn = out.ids[row][start:]
    if not turn:
        return None
    parsed = parse_turn(tokenizer, turn, prompt + out.ids[row][:start], episode.toolbox.functions)
    if not parsed.get("tool_calls"):
        return None
    done = run_tool_calls(episode.toolbox, parsed["tool_calls"], timeout)
    out.calls[row] += done.calls
    out.failures[row] += done.failures
    return tool_suffix_ids(tokenizer, done.messages, template_kwargs)


def _append_suffix(out: Turns, seen: Tensor, P: int, row: int, ids: list[int]) -> None:
    """Tool-result ids join the completion of `row`: mask 0, log-prob 0."""
    start = len(out.ids[row])
    out.ids[row].extend(ids)
    out.tool_mask[row].extend([0] * len(ids))
    out.logprobs[row].extend([0.0] * len(ids))
    seen[row, P + start:P + start + len(ids)] = torch.tensor(ids, device=seen.device)


@dataclass(frozen=True)
class CompletionTensors:
    """`Turns` as the rollout's (b, R) tensors."""

    responses: Tensor  # (b, R) ids, pad after the completion
    response_mask: Tensor  # (b, R) bool, True on the completion (model turns and tool suffixes)
    tool_mask: Tensor  # (b, R) bool, False on tool suffixes (True on padding, as TRL pads it with 1)
    logprobs: Tensor | None  # (b, R) sampling log-probs, 0 on suffixes and padding; None: not kept
    contains_stop: Tensor  # (b,) the completion ends with the stop (or pad) token: not truncated, as TRL tells it


def completion_tensors(turns: Turns, response_length: int, *, pad_token_id: int, stop_token_id: int,
                       keep_logprobs: bool, device: torch.device | str) -> CompletionTensors:
    responses, response_mask = pad(turns.ids, pad_token_id, "right", width=response_length)
    tool_mask, _ = pad(turns.tool_mask, 1, "right", width=response_length)
    logprobs = None
    if keep_logprobs:
        logprobs = torch.zeros(len(turns.ids), response_length)
        for row, values in enumerate(turns.logprobs):
            logprobs[row, :len(values)] = torch.tensor(values)
        logprobs = logprobs.to(device)
    contains_stop = torch.tensor([bool(ids) and ids[-1] in (stop_token_id, pad_token_id) for ids in turns.ids])
    return CompletionTensors(responses=responses.to(device), response_mask=response_mask.to(device),
                             tool_mask=tool_mask.bool().to(device), logprobs=logprobs,
                             contains_stop=contains_stop.to(device))


class ToolRollouts:
    """The multi-turn side of a trainer: its tools and environment factory (resolved from `cfg.tools` and
    `cfg.environment_factory`), the prompt rows it renders prompts from, and a pool of environments (constructed once,
    reset for every episode, as TRL's).

    rows: the prompts as TRL's dataset rows, {"prompt": messages, ...}: each episode's prompt is its row's messages,
    the environment's reset(**row) text appended to the last user message, rendered with the episode's tools.
    `chooser` makes the `TokenChooser` of a rollout from (TokenChoice, noise keys, keep log-probs): `Sampler`, or one
    that replays recorded turns (teacher forcing: tests/test_tools.py replays the turns it gives TRL)."""

    chooser: Callable[[TokenChoice, Tensor | None, bool], TokenChooser] = Sampler

    def __init__(self, cfg, tokenizer, rows: Sequence[Mapping], *, template_kwargs: Mapping | None = None):
        self.cfg, self.tokenizer, self.rows = cfg, tokenizer, rows
        self.template_kwargs = dict(template_kwargs or {})
        self.tools = tuple(import_tool(path) for path in cfg.tools)
        self.factory = import_environment_factory(cfg.environment_factory) if cfg.environment_factory else None
        check_tool_template(tokenizer, self.template_kwargs)
        bad = [i for i, row in enumerate(rows) if not chat.is_conversation(row.get("prompt"))]
        if bad:
            raise ValueError(f"tools: prompt row {bad[0]} is not a conversation (a list of {{role, content}} "
                             "messages); tool calls need the prompt as messages, as TRL's")
        self.pool: list[object] = []
        self.reward_name = None  # the environment's class name when it owns a reward (TRL's reward source name)
        if self.factory is not None:
            probe = self.factory()
            check_environment(probe, f"environment_factory {cfg.environment_factory!r}")
            self.pool.append(probe)
            if callable(getattr(probe, "get_reward", None)):
                self.reward_name = type(probe).__name__

    def start(self, prompt_indices: Sequence[int], samples_per_prompt: int) -> tuple[list[list[int]], list[Episode]]:
        """Each episode's prompt ids and tools, `samples_per_prompt` per prompt index, prompt-major: an environment
        per episode, reset with its row."""
        prompts, episodes = [], []
        for n, index in enumerate(i for i in prompt_indices for _ in range(samples_per_prompt)):
            row = self.rows[index]
            messages = [dict(m) for m in row["prompt"]]
            environment, functions = None, self.tools
            if self.factory is not None:
                if n == len(self.pool):
                    self.pool.append(self.factory())
                environment = self.pool[n]
                observation = environment.reset(**row)
                if observation is not None:  # TRL: appended to the last message's text
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
                functions = functions + tuple(environment_tools(environment))
            episodes.append(Episode(toolbox=Toolbox(functions), environment=environment))
            prompts.append(render_ids(self.tokenizer, messages, tools=functions, generation_prompt=True,
                                      template_kwargs=self.template_kwargs))
        return prompts, episodes

    def decode(self, model: nn.Module, queries: Tensor, query_mask: Tensor, episodes: Sequence[Episode],
               choose: TokenChooser, stop_token_id: int) -> Turns:
        cfg = self.cfg
        return multi_turn_decode(model, queries, query_mask, episodes, tokenizer=self.tokenizer, choose=choose,
                                 response_length=cfg.response_length, stop_token_id=stop_token_id,
                                 max_iterations=cfg.max_tool_calling_iterations, timeout=cfg.tool_timeout,
                                 template_kwargs=self.template_kwargs,
                                 max_positions=getattr(model.config, "max_position_embeddings", None))

    def rewards(self, episodes: Sequence[Episode], device: torch.device | str) -> Tensor | None:
        """(b,) each episode's environment's get_reward(), when it has one (TRL's extra reward source)."""
        if self.reward_name is None:
            return None
        return torch.tensor([environment_reward(e.environment) for e in episodes], dtype=torch.float32, device=device)
