"""The rollout phase: completions sampled for one update's prompts, with what training needs of them.

The decode loop is decode.py's; this adds the batching around it (prompts repeated `samples_per_prompt` times,
chunks of `local_rollout_forward_batch_size`, ZeRO-3 weights gathered once per rollout) and the forwards that read
the completions: the policy's log-probs, the reference's and (PPO) the value model's values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from rlhf_core import ops
from rlhf_core.batching import pad
from rlhf_core.config import RLConfig
from rlhf_core.decode import TokenChoice, decode, graphs_available
from rlhf_core.multi_turn import Episode, ToolRollouts, completion_tensors
from rlhf_core.rollout import Rollout, response_logit_pieces, stop_mask, token_values


def logprobs_of(policy: nn.Module, parts: tuple[Tensor, Tensor, Tensor, Tensor], temperature: float, *,
                share_prompts: bool = False) -> Tensor:
    """(b, R) log-probs of the responses under `policy` at `temperature`, 0 on padding: through the training
    forward's own op (`ops.token_logprobs_and_entropy`), so that under bf16 the first ratio of an update is exactly 1."""
    pieces = response_logit_pieces(policy, parts, share_prompts=share_prompts)
    logprobs, _ = ops.token_logprobs_and_entropy(pieces, parts[2], temperature, with_entropy=False)
    return logprobs * parts[3]


def by_rows(forward: Callable[[tuple[Tensor, ...]], Tensor], parts: tuple[Tensor, ...], rows: int) -> Tensor:
    """`forward(parts)` over at most `rows` rows at a time, joined along the rows. The rollout's forwards over the
    completions (log-probs, values) run a training micro-batch at a time: the update holds that many rows'
    activations with their gradients anyway, so a no-grad forward of as many never sets the peak memory, where one
    over the whole rollout chunk did (bench-tiny's RLOO, 64 rows in pieces of 16: 20-26 MiB less peak RSS). Each
    row's numbers are its own: a row's forward reads no other row."""
    return torch.cat([forward(tuple(part[start:start + rows] for part in parts))
                      for start in range(0, len(parts[0]), rows)])


def sampling_logprobs_exact(accelerator: Accelerator, policy: nn.Module) -> bool:
    """Whether the logits of the sampling steps are the training forward's to rounding (~1e-6), so that the
    rollout's log-probs can be read at the sampling steps instead of a second forward over the whole batch (as
    TRL's PPO does): only in plain fp32. Under bf16/fp16 (autocast or DeepSpeed) the incremental decode rounds
    differently from the full forward, and the first ratio of an update must be exactly 1 there too."""
    return (accelerator.mixed_precision == "no" and accelerator.state.deepspeed_plugin is None
            and all(p.dtype == torch.float32 for p in policy.parameters()))


def use_decode_graphs(cfg: RLConfig, policy: nn.Module) -> bool:
    """Whether the rollout's decode steps replay CUDA graphs (`RLConfig.decode_graphs`)."""
    if cfg.decode_graphs == "off":
        return False
    available = graphs_available(policy)
    if cfg.decode_graphs == "on" and not available:
        raise ValueError("train.decode_graphs=on: CUDA graphs need a CUDA device, a model whose KV cache is a "
                         "plain static cache (no sliding-window or hybrid layers) and no ZeRO-3 partitioning; "
                         "set it to auto or off")
    return available


def token_choice(cfg: RLConfig) -> TokenChoice:
    return TokenChoice(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                       repetition_penalty=cfg.repetition_penalty)


class RolloutMaker:
    """Makes this process's `Rollout` of an update from the policy (and value model) of `model`, a
    `PolicyAndValue`, and the frozen `ref_policy` (None: a PEFT policy's base model, adapter disabled).

    whole_weights: a context in which the prepared model's weights are whole (ZeRO-3 gathers them).
    share_prompts: the k samples of a prompt go through its tokens once (as they will in training).
    tools: multi-turn rollouts (rlhf_core/multi_turn.py): prompts rendered from its rows with the tools, tool calls run.
    """

    def __init__(self, model: nn.Module, ref_policy: nn.Module | None, accelerator: Accelerator, *,
                 whole_weights: Callable[[], AbstractContextManager], pad_token_id: int, stop_token_id: int | None,
                 share_prompts: bool, tools: ToolRollouts | None = None):
        self.model, self.ref_policy, self.accelerator, self.whole_weights = model, ref_policy, accelerator, whole_weights
        self.pad_token_id, self.stop_token_id, self.share_prompts = pad_token_id, stop_token_id, share_prompts
        self.tools = tools

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int], cfg: RLConfig,
                 update: int) -> Rollout:
        """Sample completions for `prompts[i]` of each of `prompt_indices`, each repeated `samples_per_prompt`
        times; `update` keys the noise under `sampling_seed=episode`. With tools, the prompts are the tools' rows
        rendered per episode."""
        k = cfg.samples_per_prompt
        episodes = None
        if self.tools is None:
            episode_prompts = [prompts[i] for i in prompt_indices for _ in range(k)]
        else:
            episode_prompts, episodes = self.tools.start(prompt_indices, k)
        queries, query_mask = pad(episode_prompts, self.pad_token_id, "left")  # (B, P)
        queries, query_mask = queries.to(self.accelerator.device), query_mask.to(self.accelerator.device)
        keys = None
        if cfg.sampling_seed == "episode":  # (B,): episode (prompt, j-th sample) of this update
            prompt_ids = torch.tensor(list(prompt_indices), dtype=torch.long).repeat_interleave(k)
            keys = ops.episode_keys(cfg.seed, update, prompt_ids,
                                    torch.arange(k).repeat(len(prompt_indices))).to(queries.device)
        step = cfg.local_rollout_forward_batch_size
        # the training forward's autocast (accelerate applies it to the prepared model only): rollout,
        # reference and value forwards in another precision make PPO's ratio wrong before any update
        with self.accelerator.autocast(), self.whole_weights():
            return Rollout.cat([self._chunk(cfg, queries[i:i + step], query_mask[i:i + step],
                                            None if keys is None else keys[i:i + step],
                                            None if episodes is None else episodes[i:i + step])
                                for i in range(0, len(queries), step)])

    def _chunk(self, cfg: RLConfig, queries: Tensor, query_mask: Tensor, noise_keys: Tensor | None,
               episodes: Sequence[Episode] | None = None) -> Rollout:
        model, policy = self.model, self.model.policy
        exact = sampling_logprobs_exact(self.accelerator, policy)
        tool_mask = env_rewards = calls = failures = None
        if episodes is None:
            responses, sampled_logprobs = decode(
                policy, queries, query_mask, response_length=cfg.response_length, pad_token_id=self.pad_token_id,
                stop_token_id=self.stop_token_id, choice=token_choice(cfg), noise_keys=noise_keys,
                keep_logprobs=exact, graphs=use_decode_graphs(cfg, policy))  # (b, R), (b, R) or None
            if self.stop_token_id is not None:
                responses = ops.truncate_after_stop(responses, self.stop_token_id, self.pad_token_id)
            response_mask, contains_stop = stop_mask(responses, self.stop_token_id)
        else:
            sampler = self.tools.chooser(token_choice(cfg), noise_keys, exact)
            turns = self.tools.decode(policy, queries, query_mask, episodes, sampler, self.stop_token_id)
            done = completion_tensors(turns, cfg.response_length, pad_token_id=self.pad_token_id,
                                      stop_token_id=self.stop_token_id, keep_logprobs=exact, device=queries.device)
            responses, response_mask, sampled_logprobs = done.responses, done.response_mask, done.logprobs
            contains_stop, tool_mask = done.contains_stop, done.tool_mask
            env_rewards = self.tools.rewards(episodes, queries.device)
            calls, failures = (torch.tensor(n, device=queries.device) for n in (turns.calls, turns.failures))
        # the tokens the policy wrote: a tool result's log-probs are 0 in the rollout and the reference alike, so
        # every KL over the response (the loss's, the reward's, the logged one) leaves tool results out
        written = response_mask if tool_mask is None else response_mask & tool_mask
        parts = (queries, query_mask, responses, response_mask)
        rows = cfg.per_device_train_batch_size
        if sampled_logprobs is None:
            logprobs = by_rows(lambda piece: logprobs_of(policy, piece, cfg.temperature,
                                                         share_prompts=self.share_prompts), parts, rows) * written
        else:  # read at the sampling steps: the forward the training step would repeat, saved
            logprobs = sampled_logprobs * written
        if not cfg.uses_reference:
            ref_logprobs = None
        elif self.ref_policy is None:
            with policy.disable_adapter():
                ref_logprobs = by_rows(lambda piece: logprobs_of(policy, piece, cfg.temperature, share_prompts=True),
                                       parts, rows) * written
        else:
            ref_logprobs = by_rows(lambda piece: logprobs_of(self.ref_policy, piece, cfg.temperature,
                                                             share_prompts=True), parts, rows) * written
        values = None if model.value is None else by_rows(lambda piece: token_values(model.value, piece), parts,
                                                          rows) * response_mask
        return Rollout(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask,
                       logprobs=logprobs, ref_logprobs=ref_logprobs, contains_stop=contains_stop, values=values,
                       tool_mask=tool_mask, env_rewards=env_rewards, tool_calls=calls, tool_failures=failures)
