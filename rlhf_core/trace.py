"""The reward-flow trace: how one update's reward reaches each token of a few of its rollouts.

PPO, per response token t: the sampled token, its log-prob under the policy and the reference, the KL
estimate KL_t and its penalty -kl_coef * KL_t, the score (on the final response token only, see ppo.py), the
shaped reward r_t, the value V_t, the advantage A_t (as the loss sees it, whitened when whiten_advantages)
and the return (the value target). RLOO: per token the log-probs and the KL penalty; per rollout the
sequence reward (score - kl_coef * sum_t KL_t), the leave-one-out baseline and the advantage; at
kl_level='token' also the per-token rewards and advantages.

Every token says whether the loss trained on it (`trained`: the rollout's loss mask). A multi-turn rollout with tools
also lists its turns in order (the model's and the tool results appended after its calls, each with its token span and
text), and each token says which turn and source it belongs to: tool-result tokens are never trained (TRL's
tool_mask) and carry no log-prob or KL.

Pure: it reads the filled `Rollout` and the per-episode stats the algorithm returned (the trainer's
`on_update` hook hands both over). The only arithmetic is `ops.kl_penalty`, the op the algorithms apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from rlhf_core import ops, ppo
from rlhf_core.config import RLConfig
from rlhf_core.rollout import Rollout

Decode = Callable[[Sequence[int]], str]

TOKEN_QUANTITIES = ("logprob", "ref_logprob", "kl", "kl_penalty", "score", "reward", "value", "advantage", "return")
"""Per-token columns, in the order a reader follows the reward: some are absent for some algorithms."""


def token_columns(batch: Rollout, cfg: RLConfig) -> dict[str, Tensor]:
    """Each per-token quantity the update used, (n, R), for the rollouts in `batch`."""
    mask = batch.response_mask
    columns = {"logprob": batch.logprobs}
    if batch.ref_logprobs is not None:  # None: GRPO with beta 0 loads no reference
        kl = ops.kl_penalty(batch.logprobs, batch.ref_logprobs, cfg.kl_estimator) * mask  # (n, R)
        columns.update(ref_logprob=batch.ref_logprobs, kl=kl, kl_penalty=-cfg.kl_coef * kl)
    if batch.rewards is not None:  # PPO and token-level RLOO place the score on a token
        score = torch.zeros_like(batch.logprobs)
        score[torch.arange(len(batch)), ppo.score_positions(batch)] = batch.scores
        columns.update(score=score, reward=batch.rewards)
    if batch.values is not None:
        columns["value"] = batch.values
    if batch.advantages is not None and batch.advantages.shape[1] > 1:
        columns["advantage"] = batch.advantages
    if batch.returns is not None:
        columns["return"] = batch.returns
    return columns


def rollout_summary(batch: Rollout, stats: dict[str, Tensor], cfg: RLConfig, row: int, decode: Decode) -> dict:
    """Per-rollout numbers: the score, where it was placed, the KL total and, for RLOO, baseline and advantage."""
    length = int(batch.response_lengths[row])
    missing_eos = cfg.missing_eos_penalty is not None and cfg.stop_token is not None and \
        not bool(batch.contains_stop[row])
    out = {"index": row,
           "prompt": decode(batch.queries[row][batch.query_mask[row]].tolist()),
           "response": decode(batch.responses[row][batch.response_mask[row]].tolist()),
           "response_length": length,
           "contains_stop": bool(batch.contains_stop[row]),
           "score": float(batch.scores[row]),
           "missing_eos_penalty": cfg.missing_eos_penalty if missing_eos else 0.0,
           "score_position": int(ppo.score_positions(batch)[row]) if batch.rewards is not None else None,
           "kl_sum": float(stats["kl"][row]) if "kl" in stats else None,
           "non_score_reward": float(stats["non_score_reward"][row]),
           "rlhf_reward": float(stats["rlhf_reward"][row])}
    if cfg.algo == "grpo":
        out.update(prompt_group=row // cfg.grpo.num_generations, advantage=float(batch.advantages[row, 0]))
    if cfg.algo == "rloo":
        out.update(prompt_group=row // cfg.rloo.rloo_k, sequence_reward=float(stats["rloo/reward"][row]),
                   baseline=float(stats["rloo/baseline"][row]))
        if batch.advantages.shape[1] == 1:
            out["advantage"] = float(batch.advantages[row, 0])
    return out


def turns(batch: Rollout, row: int, decode: Decode) -> list[dict]:
    """The turns of a multi-turn rollout: runs of model tokens (tool mask 1) and of tool results (0), in order."""
    length, out = int(batch.response_lengths[row]), []
    for t in range(length):
        source = "model" if bool(batch.tool_mask[row, t]) else "tool"
        if not out or out[-1]["source"] != source:
            out.append({"turn": len(out), "source": source, "start": t, "end": t})
        out[-1]["end"] = t + 1
    for turn in out:
        turn["text"] = decode(batch.responses[row, turn["start"]:turn["end"]].tolist())
    return out


def trace_update(batch: Rollout, stats: dict[str, Tensor], cfg: RLConfig, *, update: int, decode: Decode,
                 rollouts: int = 4) -> dict:
    """The trace of the first `rollouts` rollouts of an update's batch, JSON-ready.

    batch: filled by `compute_advantages` (scores, rewards, advantages, ...); stats: its per-episode stats.
    Only response tokens (through the stop token) are listed.
    """
    n = min(rollouts, len(batch))
    head = batch[:n].to("cpu")
    head_stats = {k: v[:n].detach().cpu() for k, v in stats.items()}
    columns = {k: v.detach().float() for k, v in token_columns(head, cfg).items()}
    trained = head.loss_mask
    traced = []
    for row in range(n):
        summary = rollout_summary(head, head_stats, cfg, row, decode)
        summary["tokens"] = [
            {"position": t, "token_id": int(head.responses[row, t]), "token": decode([int(head.responses[row, t])]),
             "trained": bool(trained[row, t]),
             **{name: float(columns[name][row, t]) for name in TOKEN_QUANTITIES if name in columns}}
            for t in range(summary["response_length"])]
        if head.tool_mask is not None:
            summary["turns"] = turns(head, row, decode)
            for turn in summary["turns"]:
                for token in summary["tokens"][turn["start"]:turn["end"]]:
                    token.update(turn=turn["turn"], source=turn["source"])
            summary.update(tool_calls=int(head.tool_calls[row]), tool_failures=int(head.tool_failures[row]))
            if head.env_rewards is not None:
                summary["env_reward"] = float(head.env_rewards[row])
        traced.append(summary)
    return {"update": update, "algo": cfg.algo, "kl_coef": cfg.kl_coef, "kl_estimator": cfg.kl_estimator,
            "quantities": [name for name in TOKEN_QUANTITIES if name in columns],
            **({"rloo_k": cfg.rloo.rloo_k, "kl_level": cfg.rloo.kl_level} if cfg.algo == "rloo" else {}),
            "rollouts": traced}


def trace_due(update: int, num_updates: int, every: int) -> bool:
    """Every `every` updates and the last one; never when every is 0."""
    return every > 0 and (update % every == 0 or update == num_updates)
