"""The runtime between the trainer and the hardware: precision, devices, settings checked before models load."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import tiny_config

from conftest import target_fraction
from rlhf_core.config import RuntimeConfig
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.rollout_maker import sampling_logprobs_exact
from rlhf_core.runtime import (
    LR_SCHEDULES,
    Runtime,
    RuntimeSettingError,
    adamw,
    check,
    check_fp16_loss_scaling,
    lr_schedule,
)
from rlhf_core.scoring import FunctionScorer


def sharp(model: torch.nn.Module, scale: float = 300.0) -> torch.nn.Module:
    """Scale the LM head: near-one-hot next-token distributions, where a precision mismatch between the
    rollout and the training forward shows (a random tiny model's near-uniform logits hide it)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_bf16_rollout_and_training_forwards_agree_before_the_first_step(
        algo, tokenizer, prompts, make_policy, make_scorer_model):
    """Learning rate 0, one epoch: every ratio is 1 (approxkl 0, nothing clipped) under bf16 autocast."""
    runtime = Runtime(RuntimeConfig(device="cpu", mixed_precision="bf16"),
                      gradient_accumulation_steps=tiny_config(algo).gradient_accumulation_steps)
    assert runtime.accelerator.mixed_precision == "bf16" and runtime.frozen_dtype == torch.bfloat16
    cfg = tiny_config(algo, total_episodes=32, num_epochs=1, learning_rate=0.0, kl_coef=0.05)
    policy = sharp(make_policy(0))
    reference = runtime.frozen(sharp(make_policy(0)))
    value = make_scorer_model(1) if algo == "ppo" else None
    trainer = RLTrainer(cfg, policy, FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                        stop_token_id=1, value_model=value, ref_policy=reference, accelerator=runtime.accelerator)
    assert not sampling_logprobs_exact(trainer.accelerator, trainer.unwrapped.policy), "bf16: the rollout recomputes the policy's log-probs"
    assert trainer.share_prompts == (algo == "rloo"), "RLOO's shared prompts, in the rollout and training alike"
    [logs] = trainer.train(max_updates=1)
    assert logs["objective/entropy"] < 0.5 * 8, "the sharp policy is nearly deterministic (else the test is weak)"
    assert logs["policy/clipfrac_avg"] == 0.0
    assert logs["policy/approxkl_avg"] == 0.0 and logs["val/ratio"] == 1.0


def test_settings_this_machine_cannot_run_fail_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        RuntimeConfig(device="cpu", mixed_precision="fp16")
    with pytest.raises(RuntimeSettingError, match="flash-attn"):
        check(RuntimeConfig(attn_implementation="flash_attention_2"))
    with pytest.raises(RuntimeSettingError, match="no such file"):
        check(RuntimeConfig(accelerate_config=str(tmp_path / "missing.yaml")))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeSettingError, match="no CUDA device"):
            check(RuntimeConfig(device="cuda"))


def test_frozen_models_move_to_the_device_in_the_frozen_dtype(make_policy):
    runtime = Runtime(RuntimeConfig(device="cpu", mixed_precision="bf16", frozen_dtype="auto"))
    frozen = runtime.frozen(make_policy(0))
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in frozen.parameters()) and not frozen.training
    assert next(frozen.parameters()).device == runtime.device


def test_fp16_under_zero3_without_loss_scaling_is_refused(tmp_path):
    """A DeepSpeed JSON that leaves fp16 unscaled under ZeRO-3, with an fp16 launch: refused before any model."""
    import json

    launch = tmp_path / "zero3_fp16.yaml"
    launch.write_text("distributed_type: DEEPSPEED\nmixed_precision: fp16\n"
                      "deepspeed_config:\n  deepspeed_config_file: ds.json\n")
    for fp16, refused in (({"enabled": True, "loss_scale": 1}, True), ({"enabled": False}, True),
                          ({"enabled": True, "loss_scale": 0}, False)):
        (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "fp16": fp16}))
        cfg = RuntimeConfig(device="auto", accelerate_config=str(launch))
        if refused:
            with pytest.raises(RuntimeSettingError, match="without loss scaling"):
                check_fp16_loss_scaling(cfg)
        else:
            check_fp16_loss_scaling(cfg)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "fp16": {"enabled": False}}))
    check_fp16_loss_scaling(RuntimeConfig(device="auto", accelerate_config=str(launch)))  # ZeRO-2: not this rule


def test_the_trainers_adamw_is_fused_and_steps_as_torchs_per_tensor_one(make_policy):
    """One fused kernel for the step (the SFT, reward-model and RL trainers all make theirs here), frozen
    parameters left out, and the same update as the default per-tensor AdamW to rounding."""
    runtime = Runtime(RuntimeConfig(device="cpu"))
    fused_model, plain_model = make_policy(0), make_policy(0)
    for model in (fused_model, plain_model):
        model.get_input_embeddings().requires_grad_(False)
    fused = adamw(fused_model, runtime.accelerator, lr=1e-2, weight_decay=0.1, eps=1e-5)
    assert fused.defaults["fused"] is True
    trainable = [p for p in fused_model.parameters() if p.requires_grad]
    assert [id(p) for p in fused.param_groups[0]["params"]] == [id(p) for p in trainable]
    plain = torch.optim.AdamW([p for p in plain_model.parameters() if p.requires_grad], lr=1e-2,
                              weight_decay=0.1, eps=1e-5, foreach=False)
    input_ids = torch.randint(0, fused_model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model, optimizer in ((fused_model, fused), (plain_model, plain)):
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(fused_model.named_parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(fused_model.gpt_neox.layers[0].mlp.dense_h_to_4h.weight,
                           make_policy(0).gpt_neox.layers[0].mlp.dense_h_to_4h.weight), "the weights moved"


@pytest.mark.parametrize("kind", LR_SCHEDULES)
@pytest.mark.parametrize(("warmup", "total"), [(0, 7), (3, 10), (4, 4), (0, 1)])
def test_the_lr_schedules_rates_are_transformers_get_schedulers(kind, warmup, total):
    """Rate for rate, steps past the end included, and after a state-dict round trip (a resumed run)."""
    from transformers import get_scheduler

    def rates(make, steps=total + 3, resume_at=None):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        scheduler = make(optimizer)
        out = []
        for step in range(steps):
            if step == resume_at:  # a new optimizer and schedule, loaded as a resumed run loads them
                state = scheduler.state_dict(), optimizer.state_dict()
                optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
                scheduler = make(optimizer)
                scheduler.load_state_dict(state[0])
                optimizer.load_state_dict(state[1])
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    theirs = rates(lambda opt: get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total))
    ours = rates(lambda opt: lr_schedule(kind, opt, warmup_steps=warmup, total_steps=total))
    assert ours == theirs
    assert rates(lambda opt: lr_schedule(kind, opt, warmup_steps=warmup, total_steps=total),
                 resume_at=total // 2) == theirs


def test_an_unknown_lr_schedule_is_refused_by_name():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    with pytest.raises(ValueError, match="lr_scheduler: expected one of linear, cosine, constant, "
                                         "constant_with_warmup, got 'polynomial'"):
        lr_schedule("polynomial", optimizer, warmup_steps=0, total_steps=5)


def test_deepspeed_builds_its_ops_with_this_environments_ninja(monkeypatch, tmp_path):
    """DeepSpeed JIT-builds ops with the first `ninja` on PATH. With Debian's before the environment's (another
    version, another build-log format) each launch rebuilt the CPU all-reduce op after the other had: the
    environment's own goes first, once, keeping the rest of PATH in its order; without one there, PATH stays."""
    import os
    import shutil
    import sys
    from pathlib import Path

    from rlhf_core.runtime import prefer_this_environments_ninja

    here = Path(sys.executable).parent
    other = tmp_path / "system-bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), "/usr/bin", str(here), "/bin"]))
    assert shutil.which("ninja") == str(other / "ninja")
    prefer_this_environments_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [str(here), str(other), "/usr/bin", "/bin"]
    assert shutil.which("ninja") == str(here / "ninja")

    elsewhere = tmp_path / "python-without-ninja" / "bin"
    elsewhere.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(elsewhere / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), "/usr/bin"]))
    prefer_this_environments_ninja()
    assert os.environ["PATH"] == os.pathsep.join([str(other), "/usr/bin"])


HEAP = """
import ctypes
import torch
from rlhf_core.allocator import keep_freed_memory
keep_freed_memory()
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
activations = [torch.empty(1_000_000) for _ in range(12)]  # 12 x 4 MB, as one step's
from_heap = all(t.data_ptr() < libc.sbrk(0) for t in activations)  # mappings lie above the heap's end
end = libc.sbrk(0)
del activations
print(from_heap, libc.sbrk(0) == end)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_runtime_keeps_the_memory_its_steps_free_instead_of_handing_it_back():
    """A Runtime's process reuses the pages the last step freed (rlhf_core/allocator.py): a step's 4 MB tensors
    come from the heap, and freeing them leaves the heap as large as it was, where glibc's defaults map each with
    a mapping of its own, unmapped when freed, to be faulted in again by the next step (bench-tiny's GRPO update:
    16-20k page faults). RLHF_KEEP_FREED_MEMORY=0 leaves the defaults."""
    from rlhf_core import allocator

    Runtime(RuntimeConfig(device="cpu"))
    assert allocator._kept, "building a Runtime sets the thresholds"

    def heap(**env) -> str:
        return subprocess.run([sys.executable, "-c", HEAP], capture_output=True, text=True, check=True,
                              env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[1]).stdout.split()

    assert heap() == ["True", "True"]
    assert heap(RLHF_KEEP_FREED_MEMORY="0") == ["False", "True"]
