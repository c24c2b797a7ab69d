"""TRL's side of `bench/vs_trl.py`: TRL 1.9.0's PPO (`trl.experimental.ppo`), the RLOO trainer of TRL 1.9.0 or 1.16.0
(the same `RLOOConfig` fields and `RLOOTrainer` arguments in both) or TRL 1.16.0's GRPO on a prepared workload.

Runs in TRL's own environment (only torch, transformers, accelerate, datasets and trl are imported), launched
as a TRL user would: `accelerate launch --mixed_precision bf16 bench/vs_trl_peer.py WORKLOAD ALGO` (TRL 1.9.0's
PPO builds its own Accelerator and reads precision only from the launch). Prints one `RESULT {json}` line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)


class UpdateClock(TrainerCallback):
    """The wall-clock end of every optimizer step (one PPO/RLOO update here), the device synchronized."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def precision_args() -> dict:
    """TRL's configs default to bf16=True and refuse it on a CPU: follow the launch (which sets the precision)."""
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return {"bf16": mixed == "bf16", "fp16": mixed == "fp16", "use_cpu": not torch.cuda.is_available()}


def ppo_trainer(spec: dict, workload: Path, tokenizer, clock: UpdateClock, output_dir: str):
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    args = PPOConfig(
        output_dir=output_dir, seed=spec["seed"], learning_rate=spec["learning_rate"],
        per_device_train_batch_size=spec["per_device_train_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], num_mini_batches=1,
        num_ppo_epochs=spec["ppo_epochs"], total_episodes=spec["episodes_per_update"] * spec["updates"],
        local_rollout_forward_batch_size=spec["local_rollout_forward_batch_size"],
        response_length=spec["response_length"], temperature=spec["temperature"], stop_token="eos",
        missing_eos_penalty=spec["missing_eos_penalty"], kl_coef=spec["kl_coef"], num_sample_generations=0,
        gradient_checkpointing=spec["gradient_checkpointing"], save_strategy="no", report_to=[], disable_tqdm=True, **precision_args(),
    )
    prompts = json.loads((workload / "prompts.json").read_text())
    dataset = Dataset.from_dict({"input_ids": prompts})
    return PPOTrainer(
        args=args, processing_class=tokenizer,
        model=AutoModelForCausalLM.from_pretrained(workload / "policy"),
        ref_model=AutoModelForCausalLM.from_pretrained(workload / "policy"),
        reward_model=AutoModelForSequenceClassification.from_pretrained(workload / "scorer"),
        value_model=AutoModelForSequenceClassification.from_pretrained(workload / "scorer"),
        train_dataset=dataset, eval_dataset=dataset.select(range(16)), callbacks=[clock],
    )


def group_trainer(algo: str, spec: dict, workload: Path, tokenizer, clock: UpdateClock, output_dir: str):
    """RLOO (TRL 1.9.0 or 1.16.0) or GRPO (1.16.0): the same config fields and trainer arguments; GRPO at its
    GRPOConfig defaults (beta 0: no reference model; loss dapo; one generation per optimizer step)."""
    import trl

    config, trainer = (trl.RLOOConfig, trl.RLOOTrainer) if algo == "rloo" else (trl.GRPOConfig, trl.GRPOTrainer)
    own = {"num_generations": spec["rloo_k"], "beta": spec["kl_coef"]} if algo == "rloo" else \
        {"num_generations": spec["grpo_generations"]}
    args = config(
        output_dir=output_dir, seed=spec["seed"], learning_rate=spec["learning_rate"],
        per_device_train_batch_size=spec["per_device_train_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], **own,
        num_iterations=1, max_completion_length=spec["response_length"], temperature=spec["temperature"],
        top_k=0, top_p=1.0, max_steps=spec["updates"], logging_steps=1,
        gradient_checkpointing=spec["gradient_checkpointing"], save_strategy="no", report_to="none",
        disable_tqdm=True, **precision_args(),
    )
    prompts = json.loads((workload / "prompts.json").read_text())
    dataset = Dataset.from_dict({"prompt": tokenizer.batch_decode(prompts)})  # word-level: decodes exactly
    return trainer(
        model=AutoModelForCausalLM.from_pretrained(workload / "policy"),
        reward_funcs=AutoModelForSequenceClassification.from_pretrained(workload / "scorer"),
        args=args, train_dataset=dataset, processing_class=tokenizer, reward_processing_classes=tokenizer,
        callbacks=[clock],
    )


def main(workload: Path, algo: str) -> None:
    spec = json.loads((workload / "spec.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(workload / "policy")
    clock = UpdateClock()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = (ppo_trainer(spec, workload, tokenizer, clock, output_dir) if algo == "ppo" else
                   group_trainer(algo, spec, workload, tokenizer, clock, output_dir))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    import trl

    result = {"side": "trl", "algo": algo, "update_ends": clock.ends,
              "episodes_per_update": spec["episodes_per_update"],
              "mixed_precision": trainer.accelerator.mixed_precision,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "version": f"trl {trl.__version__}"}
    if torch.cuda.is_available():
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
