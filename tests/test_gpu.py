"""On a GPU (marker `gpu`, `make test-gpu`): Pythia-1B shapes with random weights, bf16 through the runtime, a few
PPO and RLOO updates; prints episodes/s and peak memory. Skipped without CUDA."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from rlhf_core.config import RLConfig, RuntimeConfig
from rlhf_core.models import init_causal_lm, init_sequence_scorer, tiny_gpt_neox_config
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.runtime import Runtime
from rlhf_core.scoring import RewardModelScorer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """The DeepSpeed tests launch their own process: memory this one still caches from an earlier test would
    leave it too little (on an H100, PPO under ZeRO-2 next to the cache of the in-process tests did not fit)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


PYTHIA_1B = dict(vocab_size=50304, hidden_size=2048, num_layers=16, num_heads=8, intermediate_size=8192,
                 max_positions=2048)
PROMPT, RESPONSE = 128, 53


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_pythia_1b_shapes_train_in_bf16(algo, lora):
    runtime = Runtime(RuntimeConfig(device="cuda", mixed_precision="bf16", gradient_checkpointing=True),
                      gradient_accumulation_steps=4)
    config = tiny_gpt_neox_config(**PYTHIA_1B)
    policy = runtime.trainable(init_causal_lm(config, seed=0))
    if lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=16, lora_alpha=32, target_modules=["query_key_value"]))
    reference = None if lora else runtime.frozen(init_causal_lm(config, seed=0))
    reward = runtime.frozen(init_sequence_scorer(config, seed=1))
    value = runtime.trainable(init_sequence_scorer(config, seed=1)) if algo == "ppo" else None
    updates = 3
    cfg = RLConfig(algo=algo, total_episodes=64 * updates, per_device_train_batch_size=16,
                   gradient_accumulation_steps=4, num_epochs=4 if algo == "ppo" else 1,
                   local_rollout_forward_batch_size=64, response_length=RESPONSE, temperature=0.7,
                   learning_rate=0.0, rloo={"rloo_k": 2})
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, PYTHIA_1B["vocab_size"], (512, PROMPT), generator=generator).tolist()
    trainer = RLTrainer(cfg, policy, RewardModelScorer(reward, batch_size=64), prompts, pad_token_id=0,
                        stop_token_id=1, value_model=value, ref_policy=reference, accelerator=runtime.accelerator)
    torch.cuda.reset_peak_memory_stats()
    trainer.train(max_updates=1)  # warm-up: kernels, allocator
    start = time.perf_counter()
    history = trainer.train()
    torch.cuda.synchronize()
    eps = 64 * (updates - 1) / (time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"\n{algo} {'lora' if lora else 'full'} bf16: {eps:.2f} episodes/s, peak {peak:.1f} GiB")
    assert all(h["policy/clipfrac_avg"] == 0.0 for h in history), "lr 0: no ratio clipped under bf16"
    assert all(h["policy/approxkl_avg"] < 1e-6 for h in history)


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
@pytest.mark.parametrize("zero", [2, 3])
def test_pythia_1b_shapes_train_under_deepspeed(algo, zero, tmp_path):
    """The infra/accelerate DeepSpeed config on one GPU (one process): the engine really runs, at lr 0 no ratio is
    clipped (rollout and training agree), and under ZeRO-3 the policy is gathered for generation."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "bench"))
    from vs_trl import workload_spec, write_workload

    spec = workload_spec("pythia-1b", updates=3, gradient_checkpointing=True)
    spec["learning_rate"] = 0.0
    write_workload(spec, tmp_path)
    config = root / "infra" / "accelerate" / f"deepspeed_zero{zero}.yaml"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           "--num_processes", "1", str(root / "bench" / "vs_trl_ours.py"), str(tmp_path), algo],
                          capture_output=True, text=True, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    ends = result["update_ends"]
    eps = 64 * (len(ends) - 1) / (ends[-1] - ends[0])
    print(f"\n{algo} zero{zero} bf16: {eps:.2f} episodes/s, peak {result['peak_gpu_gib']:.1f} GiB, "
          f"phases {result['phases_s']}")
    assert result["distributed_type"] == "DEEPSPEED" and result["zero_stage"] == zero
    assert result["num_processes"] == 1 and result["mixed_precision"] == "bf16"
    assert result["clipfrac"] == 0.0
