"""Our side of `bench/vs_trl.py`: `RLTrainer` on the same prepared workload as TRL's side, launched the same way
(`accelerate launch --mixed_precision ... bench/vs_trl_ours.py WORKLOAD ALGO[,ALGO] [DECODE_GRAPHS[,...]]`).
Each (algorithm, `train.decode_graphs`) pair runs in turn in this one process on models loaded once (a 1B
model's load dominates a short run), the trained weights put back to the loaded ones before each, a new trainer
and optimizer each time; each run holds only the models it needs (`bench/vs_trl.py` starts one process per
algorithm on the CPU, where a process's peak RSS cannot be reset). Prints one `RESULT {json}` line per run with the
end time of every update, peak memory and the median seconds of each phase.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from itertools import product
from pathlib import Path

import torch

from rlhf_core.bench import median_phases, peak_matmul_flops, update_flops
from rlhf_core.config import RLConfig, RuntimeConfig
from rlhf_core.models import load_policy, load_scorer_model
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.rollout_maker import use_decode_graphs
from rlhf_core.runtime import Runtime
from rlhf_core.scoring import RewardModelScorer


def rl_config(spec: dict, algo: str, decode_graphs: str = "off") -> RLConfig:
    # GRPO at TRL 1.16 GRPOConfig's defaults: beta 0 (no reference), dapo, num_generations completions per prompt
    kl_coef = 0.0 if algo == "grpo" else spec["kl_coef"]
    return RLConfig(
        decode_graphs=decode_graphs, grpo={"num_generations": spec["grpo_generations"]},
        algo=algo, seed=spec["seed"], learning_rate=spec["learning_rate"],
        total_episodes=spec["episodes_per_update"] * spec["updates"],
        per_device_train_batch_size=spec["per_device_train_batch_size"],
        gradient_accumulation_steps=spec["gradient_accumulation_steps"], num_mini_batches=1,
        num_epochs=spec["ppo_epochs"] if algo == "ppo" else 1,
        local_rollout_forward_batch_size=spec["local_rollout_forward_batch_size"],
        response_length=spec["response_length"], temperature=spec["temperature"], stop_token="eos",
        missing_eos_penalty=spec["missing_eos_penalty"], kl_coef=kl_coef, rloo={"rloo_k": spec["rloo_k"]},
    )


def main(workload: Path, algos: list[str], graph_modes: list[str]) -> None:
    spec = json.loads((workload / "spec.json").read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runtime = Runtime(RuntimeConfig(device=device, mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION", "no"),
                                    gradient_checkpointing=spec["gradient_checkpointing"]),
                      gradient_accumulation_steps=spec["gradient_accumulation_steps"])
    needs = {algo: models_needed(rl_config(spec, algo)) for algo in algos}
    algos = sorted(algos, key=lambda algo: len(needs[algo]))  # GRPO at beta 0 needs the fewest, PPO the most
    loaders = {"policy": lambda: runtime.trainable(load_policy(workload / "policy")),
               "reward": lambda: runtime.load_frozen(load_scorer_model, workload / "scorer"),
               "reference": lambda: runtime.load_frozen(load_policy, workload / "policy"),
               "value": lambda: runtime.trainable(load_scorer_model(workload / "scorer"))}
    models, loaded = {}, {}
    prompts = json.loads((workload / "prompts.json").read_text())
    runs = list(product(algos, graph_modes))
    for i, (algo, decode_graphs) in enumerate(runs):
        # each run holds only the models it needs (a peak counts what is resident): load the missing ones, drop
        # what no later run needs
        later = set().union(*(needs[a] for a, _ in runs[i:]))
        for name in set(models) - later:
            del models[name]
            loaded.pop(name, None)
        for name in needs[algo] - set(models):
            models[name] = loaders[name]()
        for name in ("policy", "value"):  # the trained ones start from the loaded weights in every run
            if name in loaded:
                models[name].load_state_dict(loaded[name])
            elif name in models and any(name in needs[a] for a, _ in runs[i + 1:]):  # a later run trains it again
                loaded[name] = {k: v.detach().to("cpu", copy=True) for k, v in models[name].state_dict().items()}
        result = run(spec, rl_config(spec, algo, decode_graphs), runtime, models["policy"], models.get("value"),
                     models.get("reference"), models["reward"], prompts)
        result["models_held"] = sorted(models)
        print("RESULT " + json.dumps(result), flush=True)
        runtime.accelerator.free_memory()  # drops the last trainer's optimizer and prepared models


def models_needed(cfg: RLConfig) -> set[str]:
    """The models a run of `cfg` loads: the policy and reward model, the reference where a KL term needs it,
    PPO's value model."""
    return {"policy", "reward", *(["reference"] if cfg.uses_reference else []), *(["value"] if cfg.algo == "ppo" else [])}


def run(spec: dict, cfg: RLConfig, runtime: Runtime, policy, value, reference, reward, prompts) -> dict:
    device = runtime.device.type if hasattr(runtime.device, "type") else str(runtime.device)
    ends: list[float] = []

    def clock(*_):
        if device == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())

    trainer = RLTrainer(cfg, policy, RewardModelScorer(reward, batch_size=spec["local_rollout_forward_batch_size"]),
                        prompts, pad_token_id=spec["pad_token_id"], stop_token_id=spec["eos_token_id"],
                        value_model=value, ref_policy=reference, accelerator=runtime.accelerator, on_update=clock)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    history = trainer.train()
    steady = history[spec["warmup_updates"]:]
    result = {"side": "ours" if cfg.decode_graphs == "off" else "ours_graphs", "algo": cfg.algo,
              "decode_graphs": cfg.decode_graphs, "decode_graphs_used": use_decode_graphs(cfg, trainer.unwrapped.policy),
              "update_ends": ends, "episodes_per_update": spec["episodes_per_update"],
              "mixed_precision": runtime.accelerator.mixed_precision,
              "distributed_type": runtime.accelerator.distributed_type.value,
              "num_processes": runtime.accelerator.num_processes, "zero_stage": runtime.zero_stage,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "phases_s": median_phases(steady),
              "clipfrac": max(h.get("policy/clipfrac_avg", 0.0) for h in history)}
    if device == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    # model FLOPs utilisation against this machine's measured matmul peak in the training precision
    seconds = (ends[-1] - ends[spec["warmup_updates"] - 1]) / max(len(ends) - spec["warmup_updates"], 1)
    precision = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(runtime.accelerator.mixed_precision,
                                                                       torch.float32)
    peak = peak_matmul_flops(precision, device, n=8192 if device == "cuda" else 1024)
    result["model_tflop_per_s"] = update_flops(trainer, spec["prompt_length"]) / seconds / 1e12
    result["mfu"] = result["model_tflop_per_s"] * 1e12 / peak
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","), (sys.argv[3] if len(sys.argv) > 3 else "off").split(","))
