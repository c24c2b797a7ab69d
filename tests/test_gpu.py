"""On a GPU (marker `gpu`, `make test-gpu`): Pythia-1B shapes with random weights, bf16 through the runtime, a few
PPO and RLOO updates, full and LoRA, in process and under DeepSpeed ZeRO-2/3; prints episodes/s and peak memory.

Skipped without CUDA, except under `bench/gpu_check.sh --cpu-dry-run` (RLHF_GPU_CHECK=cpu-dry-run): the same
tests at tiny shapes on the CPU, so the GPU call can fail only for a reason a GPU shows. Where
RLHF_GPU_CHECK_OUT names a folder, every test appends its figures to `gpu_tests.jsonl` there."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.config import RLConfig, RuntimeConfig
from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.runtime import Runtime
from rlhf_core.scoring import RewardModelScorer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from vs_trl import SHAPES, workload_spec, write_workload  # noqa: E402

DRY_RUN = os.environ.get("RLHF_GPU_CHECK") == "cpu-dry-run"
CUDA = torch.cuda.is_available()
SHAPE = "pythia-1b" if CUDA else "dry-run"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (CUDA or DRY_RUN), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """The DeepSpeed tests launch their own process: memory this one still caches from an earlier test would
    leave it too little (on an H100, PPO under ZeRO-2 next to the cache of the in-process tests did not fit)."""
    yield
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def record(**figures) -> None:
    """Print a test's figures and append them to the check's JSON lines (bench/gpu_check.sh reads them)."""
    print("\n" + json.dumps(figures))
    out = os.environ.get("RLHF_GPU_CHECK_OUT")
    if out:
        with (Path(out) / "gpu_tests.jsonl").open("a") as f:
            f.write(json.dumps({"shapes": SHAPE, "device": "cuda" if CUDA else "cpu", **figures}) + "\n")


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_pythia_1b_shapes_train_in_bf16(algo, lora):
    shapes = SHAPES[SHAPE]
    runtime = Runtime(RuntimeConfig(device="cuda" if CUDA else "cpu", mixed_precision="bf16",
                                    gradient_checkpointing=True), gradient_accumulation_steps=4)
    config = tiny_gpt_neox_config(**shapes["model"])
    with torch.device(runtime.device):  # random init on the GPU: seconds, where the CPU takes ~10 s per 1B model
        policy, reference, reward, value = (init_causal_lm(config, seed=0), init_causal_lm(config, seed=0),
                                            init_sequence_scorer(config, seed=1), init_sequence_scorer(config, seed=1))
    policy = runtime.trainable(policy)
    if lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=16, lora_alpha=32, target_modules=["query_key_value"]))
    reference = None if lora else runtime.frozen(reference)
    reward = runtime.frozen(reward)
    value = runtime.trainable(value) if algo == "ppo" else None
    updates = 2  # one warm-up, one timed: the check's minutes go to the side-by-side runs
    cfg = RLConfig(algo=algo, total_episodes=64 * updates, per_device_train_batch_size=16,
                   gradient_accumulation_steps=4, num_epochs=4 if algo == "ppo" else 1,
                   local_rollout_forward_batch_size=64, response_length=shapes["response_length"], temperature=0.7,
                   learning_rate=0.0, rloo={"rloo_k": 2})
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, shapes["model"]["vocab_size"], (512, shapes["prompt_length"]),
                            generator=generator).tolist()
    trainer = RLTrainer(cfg, policy, RewardModelScorer(reward, batch_size=64), prompts, pad_token_id=0,
                        stop_token_id=1, value_model=value, ref_policy=reference, accelerator=runtime.accelerator)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    trainer.train(max_updates=1)  # warm-up: kernels, allocator
    start = time.perf_counter()
    history = trainer.train()
    if CUDA:
        torch.cuda.synchronize()
    eps = 64 * (updates - 1) / (time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else None
    record(test="in_process", algo=algo, variant="lora" if lora else "full", precision="bf16",
           episodes_per_s=round(eps, 2), peak_gib=peak and round(peak, 1),
           approxkl_max=max(h["policy/approxkl_avg"] for h in history),
           clipfrac_max=max(h["policy/clipfrac_avg"] for h in history))
    assert all(h["policy/clipfrac_avg"] == 0.0 for h in history), "lr 0: no ratio clipped under bf16"
    assert all(h["policy/approxkl_avg"] < 1e-6 for h in history)


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    """One saved workload (weights, prompts) for every DeepSpeed launch: at Pythia-1B shapes it is 8 GB to write, so
    the weights of bench/vs_trl.py's workload are linked where bench/gpu_check.sh left one (RLHF_GPU_CHECK_WORKLOAD)."""
    spec = workload_spec(SHAPE, updates=2, gradient_checkpointing=True)
    spec["learning_rate"] = 0.0
    path = tmp_path_factory.mktemp("workload") / "spec"
    written = Path(os.environ.get("RLHF_GPU_CHECK_WORKLOAD", "/nonexistent"))
    same = (written / "spec.json").is_file() and json.loads((written / "spec.json").read_text())["shapes"] == SHAPE
    write_workload(spec, path, weights_from=written if same else None)
    return path


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
@pytest.mark.parametrize("zero", [2, 3])
def test_pythia_1b_shapes_train_under_deepspeed(algo, zero, workload):
    """The infra/accelerate DeepSpeed config on one device (one process): the engine really runs, and at lr 0 no
    ratio is clipped (rollout and training agree)."""
    config = ROOT / "infra" / "accelerate" / f"deepspeed_zero{zero}.yaml"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           "--num_processes", "1", str(ROOT / "bench" / "vs_trl_ours.py"), str(workload), algo],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **({} if CUDA else {"DS_ACCELERATOR": "cpu"})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    ends = result["update_ends"]
    record(test="deepspeed", algo=algo, variant=f"zero{zero}", precision=result["mixed_precision"],
           episodes_per_s=round(64 * (len(ends) - 1) / (ends[-1] - ends[0]), 2),
           peak_gib=result.get("peak_gpu_gib") and round(result["peak_gpu_gib"], 1),
           phases_s=result["phases_s"], clipfrac_max=result["clipfrac"])
    assert result["distributed_type"] == "DEEPSPEED" and result["zero_stage"] == zero
    assert result["num_processes"] == 1 and result["mixed_precision"] == "bf16"
    assert result["clipfrac"] == 0.0
