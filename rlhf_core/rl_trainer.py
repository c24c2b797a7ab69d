"""The RL loop shared by PPO, RLOO and GRPO: rollout → score → advantages → update → log.

Each phase is a method whose temporaries die when it returns. The algorithm (ppo.py / rloo.py / grpo.py)
supplies only what differs: `compute_advantages`, `loss`, `loss_units` and whether a value model
is trained (GRPO also whether every forward needs the entropy). Distribution, mixed precision and DeepSpeed come from accelerate.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import get_scheduler

from rlhf_core import grpo, ops, ppo, rloo
from rlhf_core.batching import pad
from rlhf_core.config import BatchPlan, RLConfig
from rlhf_core.data import PromptSampler, mini_batch_indices
from rlhf_core.decode import TokenChoice, decode, graphs_available
from rlhf_core.hub import save_tokenizer
from rlhf_core.jsonio import atomic_path, read_json
from rlhf_core.metrics import MetricAccumulator
from rlhf_core.models import disable_dropout
from rlhf_core.rollout import (
    PolicyOutput,
    Rollout,
    gradient_checkpointing,
    response_logits,
    stop_mask,
    token_values,
)
from rlhf_core.runtime import adamw, averaged_over, configure_deepspeed, modifiable, whole_weights, zero_stage
from rlhf_core.scoring import Scorer, WeightedScorer
from rlhf_core.threads import refit_threads
from rlhf_core.tracking import NullTracker, Tracker

ALGORITHMS = {"ppo": ppo, "rloo": rloo, "grpo": grpo}
REFERENCE_FILE = "reference.safetensors"
"""In a checkpoint of a run with sync_ref_model: the reference as it has followed the policy."""
logger = logging.getLogger(__name__)

GUARDED_PREFIXES = ("loss/", "objective/", "policy/", "val/ratio")
"""The figures that stop training when NaN or inf: losses, rewards (objective/scores, objective/rlhf_reward,
objective/kl), gradient norms and the policy ratio."""


class TrainingDiverged(RuntimeError):
    """An update's figures left their bounds (NaN/inf, or a KL above `max_update_kl`). Raised on every process at
    the same update, after it was logged and before it was checkpointed; the message names the update, the figures
    and the newest checkpoint, which stays the newest."""


def out_of_bounds(metrics: Mapping[str, float], max_update_kl: float | None = None) -> dict[str, float]:
    """The figures of one update's (reduced) metrics that stop training."""
    bad = {k: v for k, v in metrics.items()
           if k.startswith(GUARDED_PREFIXES) and isinstance(v, int | float) and not math.isfinite(v)}
    kl = metrics.get("objective/kl")
    if max_update_kl is not None and kl is not None and kl > max_update_kl:
        bad["objective/kl"] = kl
    return bad

UpdateHook = Callable[["RLTrainer", Rollout, dict[str, Tensor]], None]
"""Called on the main process after each update with the trainer, the update's filled rollout batch (this
process's share) and its per-episode stats: what the reward-flow trace (trace.py) reads."""


class PolicyAndValue(nn.Module):
    """Policy (and PPO's value model) as one module: one optimizer and one DDP/DeepSpeed wrapper own both."""

    def __init__(self, policy: nn.Module, value: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        self.value = value

    def forward(self, queries: Tensor, query_mask: Tensor, responses: Tensor, response_mask: Tensor,
                temperature: float, share_prompts: bool = False, with_entropy: bool = True) -> PolicyOutput:
        parts = (queries, query_mask, responses, response_mask)
        logits = response_logits(self.policy, parts, temperature, share_prompts=share_prompts)  # (B, R, V)
        logprobs = ops.selective_log_softmax(logits, responses) * response_mask  # (B, R)
        entropy = None
        if with_entropy:
            with torch.no_grad():  # a logged statistic, not part of the loss
                entropy = ops.entropy_from_logits(logits)  # (B, R)
        values = None if self.value is None else token_values(self.value, parts)  # (B, R)
        return PolicyOutput(logprobs=logprobs, entropy=entropy, values=values)


@dataclass
class TrainerState:
    """Where a run stands; saved with every checkpoint."""

    update: int = 0
    """Updates completed."""
    episode: int = 0
    """Episodes (completions) consumed across all processes."""
    sampler: dict = field(default_factory=dict)
    """The prompt sampler's position."""


class RLTrainer:
    """Trains `policy` against `scorer` with PPO, RLOO or GRPO as `cfg.algo` says.

    prompts: tokenized prompts (no padding); the reference policy is a frozen copy of `policy`
    unless given (or, for a PEFT policy, the base model with the adapter disabled); none for GRPO with beta 0.
    """

    def __init__(self, cfg: RLConfig, policy: nn.Module, scorer: Scorer, prompts: Sequence[Sequence[int]], *,
                 pad_token_id: int, stop_token_id: int | None, value_model: nn.Module | None = None,
                 ref_policy: nn.Module | None = None, accelerator: Accelerator | None = None,
                 tracker: Tracker | None = None, checkpoint_dir: str | Path | None = None,
                 on_update: UpdateHook | None = None, monitors: Mapping[str, Scorer] | None = None):
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
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.state = TrainerState()
        self.weight_gathers = 0  # ZeRO-3: how often the sharded policy was gathered whole (once per rollout)
        self.sampler = PromptSampler(len(prompts), self.plan.local_prompts, seed=cfg.seed,
                                     rank=self.accelerator.process_index,
                                     num_processes=self.accelerator.num_processes)
        device = self.accelerator.device

        for model in (policy, value_model):
            if model is not None:
                disable_dropout(model)  # dropout would make rollout and training log-probs disagree
        self.ref_policy = self._frozen_reference(policy, ref_policy, device) if cfg.uses_reference else None
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
        optimizer = adamw(model, self.accelerator, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                          eps=cfg.adam_eps)
        scheduler = get_scheduler(cfg.lr_scheduler, optimizer,
                                  num_warmup_steps=int(cfg.warmup_ratio * self.plan.num_optimizer_steps),
                                  num_training_steps=self.plan.num_optimizer_steps)
        configure_deepspeed(self.accelerator, micro_batch_size=cfg.per_device_train_batch_size,
                            max_grad_norm=cfg.max_grad_norm)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self._module = model  # what DDP / DeepSpeed wrap, not copied: `unwrapped` without accelerate's unwrap_model

    @staticmethod
    def _frozen_reference(policy: nn.Module, ref: nn.Module | None, device: torch.device) -> nn.Module | None:
        if ref is None and hasattr(policy, "disable_adapter"):
            return None  # PEFT: the reference is the base model, adapter disabled
        ref = ref if ref is not None else copy.deepcopy(policy)
        disable_dropout(ref)
        return ref.to(device).eval().requires_grad_(False)

    @property
    def unwrapped(self) -> PolicyAndValue:
        # accelerate's unwrap_model imports deepspeed whenever it is installed: +115 MB of RSS on every run
        return self._module

    # ------------------------------------------------------------------ the loop

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
            self._guard(logs)
            if self.on_update is not None and self.accelerator.is_main_process:
                self.on_update(self, batch, episode_stats)
            if self.checkpoint_dir and self._checkpoint_due():
                self.save_checkpoint()
        return history

    @torch.no_grad()
    def rollout(self, prompt_indices: Sequence[int]) -> Rollout:
        """Sample completions for this process's prompts (each repeated k times for RLOO)."""
        k = self.cfg.samples_per_prompt
        queries, query_mask = pad([self.prompts[i] for i in prompt_indices for _ in range(k)],
                                  self.pad_token_id, "left")  # (B, P)
        queries, query_mask = queries.to(self.accelerator.device), query_mask.to(self.accelerator.device)
        keys = None
        if self.cfg.sampling_seed == "episode":  # (B,): episode (prompt, j-th sample) of this update
            prompt_ids = torch.tensor(list(prompt_indices), dtype=torch.long).repeat_interleave(k)
            keys = ops.episode_keys(self.cfg.seed, self.state.update, prompt_ids,
                                    torch.arange(k).repeat(len(prompt_indices))).to(queries.device)
        step = self.cfg.local_rollout_forward_batch_size
        # the training forward's autocast (accelerate applies it to the prepared model only): rollout,
        # reference and value forwards in another precision make PPO's ratio wrong before any update
        with self.accelerator.autocast(), self._whole_weights():
            return Rollout.cat([self._rollout_chunk(queries[i:i + step], query_mask[i:i + step],
                                                    None if keys is None else keys[i:i + step])
                                for i in range(0, len(queries), step)])

    def _whole_weights(self) -> AbstractContextManager:
        """Under DeepSpeed ZeRO-3: the policy and value weights gathered once per rollout, not once per generated
        token, so generation runs on whole weights and never waits for another rank that stopped earlier."""
        if zero_stage(self.accelerator) == 3:
            self.weight_gathers += 1
        return whole_weights(self.accelerator, self.model)

    def _rollout_chunk(self, queries: Tensor, query_mask: Tensor, noise_keys: Tensor | None) -> Rollout:
        model, cfg = self.unwrapped, self.cfg
        responses, sampled_logprobs = decode(
            model.policy, queries, query_mask, response_length=cfg.response_length, pad_token_id=self.pad_token_id,
            stop_token_id=self.stop_token_id, choice=self.token_choice, noise_keys=noise_keys,
            keep_logprobs=self._sampling_logprobs_exact, graphs=self._decode_graphs)  # (b, R), (b, R) or None
        if self.stop_token_id is not None:
            responses = ops.truncate_after_stop(responses, self.stop_token_id, self.pad_token_id)
        response_mask, contains_stop = stop_mask(responses, self.stop_token_id)
        parts = (queries, query_mask, responses, response_mask)
        if sampled_logprobs is None:
            logprobs = self._logprobs(model.policy, parts, share_prompts=self.share_prompts)
        else:  # read at the sampling steps: the forward the training step would repeat, saved
            logprobs = sampled_logprobs * response_mask
        if not cfg.uses_reference:
            ref_logprobs = None
        elif self.ref_policy is None:
            with model.policy.disable_adapter():
                ref_logprobs = self._logprobs(model.policy, parts, share_prompts=True)
        else:
            ref_logprobs = self._logprobs(self.ref_policy, parts, share_prompts=True)
        values = None if model.value is None else token_values(model.value, parts) * response_mask
        return Rollout(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask,
                       logprobs=logprobs, ref_logprobs=ref_logprobs, contains_stop=contains_stop, values=values)

    @property
    def token_choice(self) -> TokenChoice:
        cfg = self.cfg
        return TokenChoice(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                           repetition_penalty=cfg.repetition_penalty)

    @property
    def _decode_graphs(self) -> bool:
        """Whether the rollout's decode steps replay CUDA graphs (`RLConfig.decode_graphs`)."""
        if self.cfg.decode_graphs == "off":
            return False
        available = graphs_available(self.unwrapped.policy)
        if self.cfg.decode_graphs == "on" and not available:
            raise ValueError("train.decode_graphs=on: CUDA graphs need a CUDA device, a model whose KV cache is a "
                             "plain static cache (no sliding-window or hybrid layers) and no ZeRO-3 partitioning; "
                             "set it to auto or off")
        return available

    @property
    def _sampling_logprobs_exact(self) -> bool:
        """Whether the logits of the sampling steps are the training forward's to rounding (~1e-6), so that the
        rollout's log-probs can be read at the sampling steps instead of a second forward over the whole batch (as
        TRL's PPO does): only in plain fp32. Under bf16/fp16 (autocast or DeepSpeed) the incremental decode rounds
        differently from the full forward, and the first ratio of an update must be exactly 1 there too."""
        return (self.accelerator.mixed_precision == "no" and self.accelerator.state.deepspeed_plugin is None
                and all(p.dtype == torch.float32 for p in self.unwrapped.policy.parameters()))

    def _logprobs(self, policy: nn.Module, parts: tuple[Tensor, Tensor, Tensor, Tensor], *,
                  share_prompts: bool = False) -> Tensor:
        logits = response_logits(policy, parts, self.cfg.temperature, share_prompts=share_prompts)  # (b, R, V)
        return ops.selective_log_softmax(logits, parts[2]) * parts[3]  # (b, R), 0 on padding

    def score(self, batch: Rollout, metrics: MetricAccumulator | None = None) -> Rollout:
        """Score each completion; subtract the missing-EOS penalty from those that never stopped. A scorer with
        several sources (`WeightedScorer`) has each source's scores logged as rewards/<name>/mean and /std."""
        with self.accelerator.autocast():
            if isinstance(self.scorer, WeightedScorer):
                by_source = self.scorer.by_source(batch)
                scores = self.scorer.combine(by_source).to(batch.queries.device).float()  # (B,)
                if metrics is not None:
                    for name, values in by_source.items():
                        metrics.add_mean(f"rewards/{name}/mean", values.float())
                        metrics.add(f"rewards/{name}/std", values.float().std(correction=0))  # per process
            else:
                scores = self.scorer(batch).to(batch.queries.device).float()  # (B,)
        if metrics is not None:
            for name, monitor in self.monitors.items():
                metrics.add_mean(f"monitor/{name}", monitor(batch).float())
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
        """num_epochs passes of shuffled mini-batches, each accumulated over micro-batches.

        The loss of a micro-batch is its mean over loss units (tokens or sequences) rescaled to
        its share of the whole mini-batch's units across processes, so one optimizer step sees the
        exact mini-batch mean whatever the micro-batch x accumulation x process split.
        """
        cfg, plan, acc = self.cfg, self.plan, self.accelerator
        units = self.algo.loss_units(batch, cfg).float()  # (B,)
        every_entropy = self.algo.needs_entropy(cfg)  # else measured in the first epoch only (a logged statistic)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.state.update)
        self.model.train()
        optimizer_steps = self.state.update * cfg.num_epochs * cfg.num_mini_batches  # before this update
        for epoch in range(cfg.num_epochs):
            for mini in mini_batch_indices(plan.batch_size, cfg.num_mini_batches, rank=acc.process_index,
                                           num_processes=plan.num_processes, generator=generator,
                                           group_size=cfg.samples_per_prompt):
                mini = mini.to(batch.queries.device)
                # all processes' units (at least 1: a mini-batch of left-out episodes gives zero gradients)
                mini_units = acc.reduce(units[mini].sum(), reduction="sum").clamp(min=1)
                for micro in mini.split(plan.micro_batch_size):
                    with acc.accumulate(self.model):
                        mb = batch[micro]
                        # the entropy is logged, never trained on: the first epoch's pass over the whole batch
                        # measures it (a full-vocabulary pass per micro-batch, ~5 % of a CPU PPO update per epoch)
                        out = self.model(mb.queries, mb.query_mask, mb.responses, mb.response_mask,
                                         cfg.temperature, self.share_prompts,
                                         with_entropy=epoch == 0 or every_entropy)
                        loss, stats = self.algo.loss(out, mb, cfg)
                        share = units[micro].sum() * averaged_over(acc)  # the micro-batch's units, times
                        acc.backward(loss * share / mini_units)  # what accelerate and DDP average over
                        if acc.sync_gradients:
                            if cfg.max_grad_norm is not None:
                                grad_norm = acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                                if grad_norm is not None:
                                    metrics.add("policy/grad_norm", grad_norm)
                            self.optimizer.step()
                            self.scheduler.step()
                            self.optimizer.zero_grad()
                            optimizer_steps += 1
                            self._sync_reference(optimizer_steps)
                        metrics.add_all(stats)

    def log(self, batch: Rollout, episode_stats: dict[str, Tensor], metrics: MetricAccumulator, *,
            elapsed: float, episodes: int) -> dict[str, float]:
        """Reduce this update's metrics across processes (one collective) and hand them to the tracker."""
        if "kl" in episode_stats:  # GRPO with beta 0 has no reference
            metrics.add_mean("objective/kl", episode_stats["kl"])
        metrics.add_mean("objective/entropy", -batch.logprobs.sum(1))  # sampled-token estimate, as TRL
        metrics.add_mean("objective/non_score_reward", episode_stats["non_score_reward"])
        metrics.add_mean("objective/rlhf_reward", episode_stats["rlhf_reward"])
        metrics.add_mean("objective/scores", batch.scores)
        metrics.add_mean("val/response_length", batch.response_lengths.float())
        metrics.add_total("val/num_eos_tokens", batch.contains_stop.sum())
        logs = metrics.reduce(self.accelerator)
        logs.update({"lr": self.scheduler.get_last_lr()[0], "episode": self.state.episode,
                     "eps": episodes / max(elapsed, 1e-9), "update": self.state.update})
        if self.accelerator.device.type == "cuda":  # this process's peak since the run started
            logs["gpu/peak_memory_gib"] = torch.cuda.max_memory_allocated(self.accelerator.device) / 2**30
        if self.accelerator.is_main_process:
            self.tracker.log_metrics(logs, step=self.state.update)
        return logs

    def _guard(self, logs: Mapping[str, float]) -> None:
        """Stop after an update whose figures are out of bounds. `logs` were reduced across processes, so every
        process reads the same figures and stops at the same update, with no collective of its own."""
        bad = out_of_bounds(logs, self.cfg.max_update_kl)
        if not bad:
            return
        figures = ", ".join(f"{k} = {v:.6g}" for k, v in sorted(bad.items()))
        bound = (f" (train.max_update_kl = {self.cfg.max_update_kl})"
                 if "objective/kl" in bad and math.isfinite(bad["objective/kl"]) else "")
        kept = list_checkpoints(self.checkpoint_dir) if self.checkpoint_dir else []
        where = (f"the last good checkpoint, {kept[-1]}, stays the newest" if kept else
                 f"no checkpoint in {self.checkpoint_dir} yet" if self.checkpoint_dir else "nothing was checkpointed")
        raise TrainingDiverged(f"update {self.state.update}: {figures}{bound}; training stopped before checkpointing "
                               f"it ({where}). Lower train.learning_rate or train.max_grad_norm, raise train.kl_coef, "
                               "or check the reward model's scores")

    def _sync_reference(self, optimizer_steps: int) -> None:
        """TR-DPO's soft update after every `ref_model_sync_steps`-th optimizer step (counted over the run)."""
        cfg = self.cfg
        if not cfg.sync_ref_model or optimizer_steps % cfg.ref_model_sync_steps:
            return
        # ZeRO-3: every rank mixes the whole policy into the whole reference; rank 0's result is sharded back
        with self._whole_weights(), modifiable(self.ref_policy):
            ops.mix_into(self.ref_policy.parameters(), self.unwrapped.policy.parameters(), cfg.ref_model_mixup_alpha)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint_every
        last = self.state.update == self.plan.num_updates
        return last or (every > 0 and self.state.update % every == 0)

    def save_checkpoint(self) -> Path:
        """Atomically save everything needed to resume: written to a temp dir, then renamed. A save that fails (a
        full disk) leaves the previous checkpoint as it was, removes its own partial copy, and raises
        CheckpointNotSaved naming both."""
        assert self.checkpoint_dir is not None, "RLTrainer(checkpoint_dir=...) is not set"
        final = self.checkpoint_dir / f"update-{self.state.update:06d}"
        tmp = final.with_name(final.name + ".tmp")
        acc = self.accelerator
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
            tmp.mkdir(parents=True)  # before any rank writes its shard into it (DeepSpeed saves on every rank)
        acc.wait_for_everyone()
        try:
            self._write_checkpoint(tmp)
        except Exception as err:  # a full disk is an OSError from Python's writes, a RuntimeError from torch.save's
            free_mib = shutil.disk_usage(self.checkpoint_dir).free / 2**20
            shutil.rmtree(tmp, ignore_errors=True)  # its space back; a partial save is never resumed from
            kept = list_checkpoints(self.checkpoint_dir)
            first_line = (str(err).splitlines() or [""])[0]
            raise CheckpointNotSaved(f"checkpoint {final.name} not saved in {self.checkpoint_dir} "
                                     f"({type(err).__name__}: {first_line}; {free_mib:.1f} MiB were free on its disk); "
                                     f"{f'the previous one, {kept[-1].name}, is kept' if kept else 'none kept yet'}: "
                                     "free space and run again to resume from it") from err
        if acc.is_main_process:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in list_checkpoints(self.checkpoint_dir)[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old)
        acc.wait_for_everyone()
        return final

    def _write_checkpoint(self, tmp: Path) -> None:
        acc = self.accelerator
        acc.save_state(str(tmp), safe_serialization=True)  # model, optimizer, scheduler, RNG states
        acc.wait_for_everyone()  # every rank's shard is written before the main process renames the directory
        if self.cfg.sync_ref_model:  # the reference has moved: resuming from the initial one would differ
            with modifiable(self.ref_policy):  # ZeRO-3: whole on every rank (every rank joins), rank 0 writes it
                if acc.is_main_process:
                    save_file({k: v.contiguous() for k, v in self.ref_policy.state_dict().items()},
                              tmp / REFERENCE_FILE)
        if acc.is_main_process:
            self.state.sampler = self.sampler.state_dict()
            meta = {"trainer": asdict(self.state), "config": self.cfg.model_dump(mode="json")}
            (tmp / "trainer_state.json").write_text(json.dumps(meta, indent=2))

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore a checkpoint written by `save_checkpoint`; `train()` then continues at the next update."""
        path = Path(path)
        meta_file = path / "trainer_state.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"{path} is not a checkpoint: {meta_file.name} is missing")
        meta = read_json(meta_file)
        saved = RLConfig.model_validate(meta["config"])
        for key in ("algo", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
                    "total_episodes", "seed"):
            if getattr(saved, key) != getattr(self.cfg, key):
                raise ValueError(f"checkpoint {path} was made with {key}={getattr(saved, key)!r}, "
                                 f"this run has {key}={getattr(self.cfg, key)!r}")
        self.accelerator.load_state(str(path))
        if self.cfg.sync_ref_model:
            with modifiable(self.ref_policy):
                self.ref_policy.load_state_dict(load_file(path / REFERENCE_FILE, device=str(self.accelerator.device)))
        self.state = TrainerState(**meta["trainer"])
        self.sampler.load_state_dict(self.state.sampler)

    def save_pretrained(self, policy_dir: str | Path, tokenizer=None, value_dir: str | Path | None = None) -> None:
        """Save the trained policy (with `tokenizer`; and the value model) as safetensors, atomically.

        Every process must call it: the full state dict is gathered first (ZeRO-3 shards it across ranks), then
        the main process writes.
        """
        acc = self.accelerator
        acc.wait_for_everyone()
        state = acc.get_state_dict(self.model)  # {"policy.*", "value.*"}: PolicyAndValue's parameters
        if not acc.is_main_process:
            return
        model = self.unwrapped
        for part, target, extra in (("policy", policy_dir, tokenizer), ("value", value_dir, None)):
            module = getattr(model, part)
            if target is None or module is None:
                continue
            own = {k.removeprefix(f"{part}."): v for k, v in state.items() if k.startswith(f"{part}.")}
            with atomic_path(target, directory=True) as tmp:
                module.save_pretrained(tmp, state_dict=own, safe_serialization=True)
                if extra is not None:
                    save_tokenizer(extra, tmp)


class CheckpointNotSaved(RuntimeError):
    """A checkpoint could not be written (a full disk): which, where, the space left, and which one is kept."""


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first (temp dirs of interrupted saves excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("update-*") if p.is_dir() and not p.name.endswith(".tmp"))
