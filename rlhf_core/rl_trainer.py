"""The RL loop shared by PPO, RLOO and GRPO: rollout → score → advantages → update → log → checkpoint.

`RLTrainer.train` runs one update per turn of its loop, phase by phase; each phase's temporaries die when it
returns. The phases live where a reader can open them: rollout_maker.py (sampling), scoring.py, the algorithm
(ppo.py / rloo.py / grpo.py: advantages, loss, loss units, whether a value model is trained), rl_update.py (the
optimizer steps), checkpoint.py and guards.py. Distribution, mixed precision and DeepSpeed come from accelerate.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import Tensor, nn

from rlhf_core import checkpoint, grpo, ops, ppo, rloo
from rlhf_core.checkpoint import TrainerState
from rlhf_core.config import BatchPlan, RLConfig
from rlhf_core.data import PromptSampler
from rlhf_core.guards import stop_if_out_of_bounds
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.models import disable_dropout
from rlhf_core.multi_turn import ToolRollouts
from rlhf_core.rl_update import PolicyAndValue, optimize, prepare_for_training
from rlhf_core.rollout import Rollout, gradient_checkpointing
from rlhf_core.rollout_maker import RolloutMaker
from rlhf_core.runtime import modifiable, whole_weights, zero_stage
from rlhf_core.scoring import Scorer, scores_by_source
from rlhf_core.threads import refit_threads
from rlhf_core.tracking import NullTracker, Tracker

ALGORITHMS = {"ppo": ppo, "rloo": rloo, "grpo": grpo}
logger = logging.getLogger(__name__)

UpdateHook = Callable[["RLTrainer", Rollout, dict[str, Tensor]], None]
"""Called on the main process after each update with the trainer, the update's filled rollout batch (this
process's share) and its per-episode stats: what the reward-flow trace (trace.py) reads."""


class RLTrainer:
    """Trains `policy` against `scorer` with PPO, RLOO or GRPO as `cfg.algo` says.

    prompts: tokenized prompts (no padding); the reference policy is a frozen copy of `policy`
    unless given (or, for a PEFT policy, the base model with the adapter disabled); none for GRPO with beta 0.
    With `cfg.tools` or `cfg.environment_factory` rollouts are multi-turn (rlhf_core/multi_turn.py): each episode's
    prompt is its row of `prompt_rows` (TRL's dataset rows, {"prompt": messages, ...}, one per prompt: `prompts` then
    only count them) rendered by `tokenizer` with the tools, its environment's reset text joining it.
    """

    def __init__(self, cfg: RLConfig, policy: nn.Module, scorer: Scorer, prompts: Sequence[Sequence[int]], *,
                 pad_token_id: int, stop_token_id: int | None, value_model: nn.Module | None = None,
                 ref_policy: nn.Module | None = None, accelerator: Accelerator | None = None,
                 tracker: Tracker | None = None, checkpoint_dir: str | Path | None = None,
                 on_update: UpdateHook | None = None, monitors: Mapping[str, Scorer] | None = None,
                 tokenizer=None, prompt_rows: Sequence[Mapping] | None = None,
                 chat_template_kwargs: Mapping | None = None):
        self.cfg = cfg
        self.algo = ALGORITHMS[cfg.algo]
        if self.algo.USES_VALUE_MODEL and value_model is None:
            raise ValueError(f"algo={cfg.algo!r} needs a value_model (a sequence classifier, num_labels=1)")
        self.accelerator = accelerator or Accelerator(
            gradient_accumulation_steps=cfg.gradient_accumulation_steps, step_scheduler_with_optimizer=False)
        if self.accelerator.gradient_accumulation_steps != cfg.gradient_accumulation_steps:
            raise ValueError("the accelerator's gradient_accumulation_steps must equal the config's")
        self.plan = BatchPlan.derive(cfg, self.accelerator.num_processes)
        set_seed(cfg.seed, device_specific=True)  # ranks sample different completions
        self.pad_token_id, self.stop_token_id = pad_token_id, (stop_token_id if cfg.stop_token else None)
        assert all(len(p) > 0 for p in prompts), "every prompt needs at least one token"
        self.scorer, self.prompts = scorer, prompts
        self.monitors = dict(monitors or {})  # scored and logged as monitor/<name>, never trained on
        self.tracker = tracker or NullTracker()
        self.on_update = on_update
        self.on_checkpoint: Callable[[Path], None] | None = None  # every rank, after each checkpoint is complete
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.state = TrainerState()
        self.weight_gathers = 0  # ZeRO-3: how often the sharded policy was gathered whole (once per rollout)
        self.sampler = PromptSampler(len(prompts), self.plan.local_prompts, seed=cfg.seed,
                                     rank=self.accelerator.process_index,
                                     num_processes=self.accelerator.num_processes)
        for model in (policy, value_model):
            if model is not None:
                disable_dropout(model)  # dropout would make rollout and training log-probs disagree
        self.ref_policy = self._frozen_reference(policy, ref_policy) if cfg.uses_reference else None
        if cfg.sync_ref_model and self.ref_policy is None:
            raise ValueError("sync_ref_model needs a reference model of its own; with LoRA the reference is the "
                             "base model with the adapter off, which cannot follow the policy")
        if cfg.truncated_sampling:
            logger.warning("top_k/top_p/min_p/repetition_penalty: completions are sampled from a truncated "
                           "distribution while the loss uses the policy's full one, so the importance ratio is "
                           "off-policy by the truncation (as in TRL); leave them at their defaults for exact PPO")
        model = PolicyAndValue(policy, None if not self.algo.USES_VALUE_MODEL else value_model)
        # the k samples of a prompt go through its tokens once, in the rollout and in training alike (their numbers
        # must agree); gradient checkpointing drops the KV cache this needs
        self.share_prompts = cfg.samples_per_prompt > 1 and not gradient_checkpointing(policy)
        self.model, self.optimizer, self.scheduler = prepare_for_training(model, self.accelerator, cfg, self.plan)
        # the module DDP / DeepSpeed wrap, kept rather than recovered by accelerate's unwrap_model, which imports
        # deepspeed whenever it is installed (+115 MB of RSS on every run)
        self.unwrapped = model
        self.rollouts = RolloutMaker(model, self.ref_policy, self.accelerator, whole_weights=self._whole_weights,
                                     pad_token_id=self.pad_token_id, stop_token_id=self.stop_token_id,
                                     share_prompts=self.share_prompts,
                                     tools=self._tool_rollouts(tokenizer, prompt_rows, chat_template_kwargs))

    def _tool_rollouts(self, tokenizer, rows: Sequence[Mapping] | None,
                       template_kwargs: Mapping | None) -> ToolRollouts | None:
        if not self.cfg.uses_tools:
            return None
        if tokenizer is None or rows is None or len(rows) != len(self.prompts):
            raise ValueError("tools / environment_factory: the trainer needs the tokenizer and the prompt rows (one "
                             "per prompt) to render each episode's prompt with its tools")
        return ToolRollouts(self.cfg, tokenizer, rows, template_kwargs=template_kwargs)

    def _frozen_reference(self, policy: nn.Module, ref: nn.Module | None) -> nn.Module | None:
        if ref is None and hasattr(policy, "disable_adapter"):
            return None  # PEFT: the reference is the base model, adapter disabled
        ref = ref if ref is not None else copy.deepcopy(policy)
        disable_dropout(ref)
        return ref.to(self.accelerator.device).eval().requires_grad_(False)

    def train(self, max_updates: int | None = None) -> list[dict[str, float]]:
        """Run the remaining updates (at most `max_updates` in this call); returns each update's metrics."""
        history, start = [], time.perf_counter()
        start_episode = self.state.episode
        stop_at = self.plan.num_updates if max_updates is None else min(self.plan.num_updates,
                                                                         self.state.update + max_updates)
        while self.state.update < stop_at:
            refit_threads()  # another torch process may have started beside this one (rlhf_core/threads.py)
            metrics = MetricAccumulator()
            with metrics.timer("time/rollout_s"):
                batch = self.rollout(self.sampler.next_indices())
            with metrics.timer("time/score_s"):
                batch = self.score(batch, metrics)
            with metrics.timer("time/advantages_s"):
                batch, episode_stats = self.compute_advantages(batch)
            with metrics.timer("time/update_s"):
                self.optimize(batch, metrics)
            self.state.update += 1
            self.state.episode += self.plan.batch_size
            logs = self.log(batch, episode_stats, metrics, elapsed=time.perf_counter() - start,
                            episodes=self.state.episode - start_episode)
            history.append(logs)
            stop_if_out_of_bounds(logs, update=self.state.update, max_update_kl=self.cfg.max_update_kl,
                                  checkpoint_dir=self.checkpoint_dir)
            if self.on_update is not None and self.accelerator.is_main_process:
                self.on_update(self, batch, episode_stats)
            if self.checkpoint_dir and checkpoint.checkpoint_due(self.state.update, self.plan.num_updates,
                                                                 self.cfg.checkpoint_every):
                saved = self.save_checkpoint()
                if self.on_checkpoint is not None:
                    self.on_checkpoint(saved)
        return history

    # ------------------------------------------------------------------ the phases

    def rollout(self, prompt_indices: Sequence[int]) -> Rollout:
        """Sample completions for this process's prompts (each repeated `samples_per_prompt` times)."""
        return self.rollouts(self.prompts, prompt_indices, self.cfg, self.state.update)

    def score(self, batch: Rollout, metrics: MetricAccumulator | None = None) -> Rollout:
        """Score each completion; subtract the missing-EOS penalty from those that never stopped. A scorer with
        several sources (`WeightedScorer`) has each source's scores logged as rewards/<name>/mean and /std."""
        with self.accelerator.autocast():
            scores, by_source = scores_by_source(self.scorer, batch)  # (B,), {name: (B,)}
            if metrics is not None:
                for name, values in by_source.items():
                    metrics.add_mean(f"rewards/{name}/mean", values.float())
                    metrics.add(f"rewards/{name}/std", values.float().std(correction=0))  # per process
        if metrics is not None:
            for name, monitor in self.monitors.items():
                metrics.add_mean(f"monitor/{name}", monitor(batch).float())
        if batch.env_rewards is not None:  # TRL: the environment's get_reward, one more source of weight 1
            scores = scores + batch.env_rewards
            if metrics is not None:
                name = self.rollouts.tools.reward_name
                metrics.add_mean(f"rewards/{name}/mean", batch.env_rewards)
                metrics.add(f"rewards/{name}/std", batch.env_rewards.std(correction=0))
        if self.cfg.missing_eos_penalty is not None and self.stop_token_id is not None:
            scores = scores - self.cfg.missing_eos_penalty * (~batch.contains_stop).float()
        in_loss = batch.contains_stop if self.cfg.mask_truncated_completions else None
        return replace(batch, scores=scores, in_loss=in_loss)

    def compute_advantages(self, batch: Rollout) -> tuple[Rollout, dict[str, Tensor]]:
        """The algorithm's advantages; whitening and normalization over the global batch (all processes)."""
        acc = self.accelerator
        reduce = None if acc.num_processes == 1 else (lambda t: acc.reduce(t, reduction="sum"))
        return self.algo.compute_advantages(batch, self.cfg, reduce=reduce)

    def optimize(self, batch: Rollout, metrics: MetricAccumulator) -> None:
        """num_epochs passes of shuffled mini-batches, each one optimizer step (rl_update.optimize)."""
        optimize(batch, metrics, algo=self.algo, cfg=self.cfg, plan=self.plan, accelerator=self.accelerator,
                 model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, update=self.state.update,
                 share_prompts=self.share_prompts, after_optimizer_step=self._sync_reference)

    def log(self, batch: Rollout, episode_stats: dict[str, Tensor], metrics: MetricAccumulator, *,
            elapsed: float, episodes: int) -> dict[str, float]:
        """Reduce this update's metrics across processes (one collective) and hand them to the tracker."""
        if "kl" in episode_stats:  # GRPO with beta 0 has no reference
            metrics.add_mean("objective/kl", episode_stats["kl"])
        metrics.add_mean("objective/entropy", -batch.logprobs.sum(1))  # sampled-token estimate, as TRL
        metrics.add_mean("objective/non_score_reward", episode_stats["non_score_reward"])
        metrics.add_mean("objective/rlhf_reward", episode_stats["rlhf_reward"])
        metrics.add_mean("objective/scores", batch.scores)
        written = batch.response_mask if batch.tool_mask is None else batch.response_mask & batch.tool_mask
        metrics.add_mean("val/response_length", written.sum(1).float())  # the policy's tokens (TRL's, with tools)
        metrics.add_total("val/num_eos_tokens", batch.contains_stop.sum())
        if batch.tool_calls is not None:  # TRL's: calls per completion, failures per call (over all processes)
            metrics.add_mean("tools/call_frequency", batch.tool_calls.float())
            calls = torch.arange(int(batch.tool_calls.sum()), device=batch.tool_calls.device)
            metrics.add_mean("tools/failure_frequency", (calls < batch.tool_failures.sum()).float())
        logs = metrics.reduce(self.accelerator)
        logs.update({"lr": self.scheduler.get_last_lr()[0], "episode": self.state.episode,
                     "eps": episodes / max(elapsed, 1e-9), "update": self.state.update})
        if self.accelerator.device.type == "cuda":  # this process's peak since the run started
            logs["gpu/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.accelerator.device) / 2**30
        if self.accelerator.is_main_process:
            self.tracker.log_metrics(logs, step=self.state.update)
        return logs

    def _whole_weights(self) -> AbstractContextManager:
        """The prepared model's weights whole inside the block (ZeRO-3 gathers them; counted in `weight_gathers`). A
        rollout gathers once, not once per generated token, so generation never waits for a rank that stopped."""
        if zero_stage(self.accelerator) == 3:
            self.weight_gathers += 1
        return whole_weights(self.accelerator, self.model)

    def _sync_reference(self, optimizer_steps: int) -> None:
        """TR-DPO's soft update after every `ref_model_sync_steps`-th optimizer step (counted over the run)."""
        cfg = self.cfg
        if not cfg.sync_ref_model or optimizer_steps % cfg.ref_model_sync_steps:
            return
        # ZeRO-3: every rank mixes the whole policy into the whole reference; rank 0's result is sharded back
        with self._whole_weights(), modifiable(self.ref_policy):
            ops.mix_into(self.ref_policy.parameters(), self.unwrapped.policy.parameters(), cfg.ref_model_mixup_alpha)

    # ------------------------------------------------------------------ saving (checkpoint.py)

    def save_checkpoint(self) -> Path:
        """Atomically save everything needed to resume (checkpoint.save_checkpoint); every process calls it."""
        assert self.checkpoint_dir is not None, "RLTrainer(checkpoint_dir=...) is not set"
        return checkpoint.save_checkpoint(self.checkpoint_dir, self.accelerator, self.state, self.cfg, self.sampler,
                                          self.ref_policy)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint written by `save_checkpoint`; `train()` then continues at the next update."""
        self.state = checkpoint.load_checkpoint(path, self.accelerator, self.cfg, self.sampler, self.ref_policy)

    def save_pretrained(self, policy_dir: str | Path, tokenizer=None, value_dir: str | Path | None = None) -> None:
        """Save the trained policy (with `tokenizer`; and the value model) as safetensors, atomically; every process
        calls it (checkpoint.save_pretrained)."""
        checkpoint.save_pretrained(self.accelerator, self.model, self.unwrapped, policy_dir, tokenizer, value_dir)
