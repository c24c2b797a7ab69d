"""LoRA policies: only the adapter trains, and the reference is the base model (adapter disabled). In the pipeline
(`train.use_peft` and TRL's other ModelConfig names): bad settings refused before any model loads, the real train
stage on 2 processes under DDP and DeepSpeed ZeRO-3 ending with the same policy, a resumed LoRA run, the saved
layout (merged model + adapter), and `rlhf run --profile cpu-zero2-lora` through Prefect and DVC ending with a
registered version."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_pipeline import TINY
from test_resume import make_workspace
from typer.testing import CliRunner

from cli.main import app
from conftest import target_fraction
from rlhf_core.config import RLConfig
from rlhf_core.lora import ADAPTER_DIR
from rlhf_core.models import load_policy, tiny_gpt_neox_config
from rlhf_core.rl_trainer import RLTrainer
from rlhf_core.scoring import FunctionScorer
from tasks.execution.launcher import LAUNCHED_ENV
from tasks.parameters.params import ParamsError, deep_merge, load_params, parse_override
from tasks.runner import run_stage

REPO = Path(__file__).resolve().parent.parent
RLHF = str(Path(sys.executable).parent / "rlhf")
# 2 updates of 64 episodes: 2 processes x 8 x 4; episode-keyed sampling, so every layout draws the same completions
LORA = ["train.use_peft=true", "train.lora_r=4", "train.lora_alpha=8", "train.learning_rate=1e-2",
        "train.total_episodes=128", "train.response_length=8", "train.checkpoint_every=1", "train.trace_every=0",
        "train.per_device_train_batch_size=8", "train.local_rollout_forward_batch_size=32",
        "train.sampling_seed=episode", "prepare.max_prompt_tokens=16"]
TARGETED = ".attention.query_key_value.weight"  # PEFT's default LoRA target on GPT-NeoX
LORA_PROFILE = "cpu-zero2-lora"
# docs/gpus.md ("Training on GPUs"): its LoRA commands -> the test that runs each or its CPU stand-in (read by
# tests/test_cpu_profiles.py, which fails on a command of the guide that no test runs)
GPU_GUIDE_COMMANDS = {
    "rlhf run --profile tldr-pythia-1b --set train.use_peft=true --set train.lora_r=16 --set train.lora_alpha=32 "
    "--set runtime.num_processes=8 --set runtime.accelerate_config=infra/accelerate/deepspeed_zero2.yaml":
        "test_lora.py::test_cpu_zero2_lora_profile_runs_the_whole_flow_and_registers_a_version",
    "rlhf run --profile cpu-zero2-lora":
        "test_lora.py::test_cpu_zero2_lora_profile_runs_the_whole_flow_and_registers_a_version",
}


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_lora_policy_trains_adapter_only(tokenizer, prompts, make_policy, algo):
    base = make_policy()
    frozen_copy = {k: v.clone() for k, v in base.state_dict().items()}
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value", "dense_h_to_4h"],
                                             lora_dropout=0.0))
    # num_generations: RLOO's rloo_k, GRPO's group; beta 0.05 gives GRPO a reference (TRL's default 0 loads none)
    cfg = RLConfig(algo=algo, total_episodes=96, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                   num_epochs=1, local_rollout_forward_batch_size=32, response_length=6, stop_token=None,
                   missing_eos_penalty=None, learning_rate=1e-2, num_generations=4, beta=0.05)
    trainer = RLTrainer(cfg, policy, FunctionScorer(target_fraction, tokenizer), prompts, pad_token_id=0,
                        stop_token_id=1)
    assert trainer.ref_policy is None, "a PEFT policy's reference is its own base model"
    history = trainer.train()
    assert history[-1]["objective/kl"] != 0.0, "the adapter moved the policy away from the base model"

    lora = {k: v for k, v in policy.state_dict().items() if "lora_B" in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values()), "lora_B starts at 0 and must train"
    merged_names = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                    for k, v in policy.state_dict().items() if "lora_" not in k}
    for name, value in frozen_copy.items():
        torch.testing.assert_close(merged_names[name], value, rtol=0, atol=0, msg=name)


def sets(*groups: list[str]) -> list[str]:
    return [x for group in groups for item in group for x in ("--set", item)]


def stage_train(root: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHF_TRACKING": "off"}
    env.pop(LAUNCHED_ENV, None)
    return subprocess.run([RLHF, "stage", "train", *sets(LORA, overrides)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)


def policy_of(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "models" / "policy" / "model.safetensors")


def assert_only_the_adapted_weights_moved(root: Path) -> None:
    """The merged policy is the SFT policy's weights, changed only where the adapter sits."""
    sft, policy = load_file(root / "models" / "sft" / "model.safetensors"), policy_of(root)
    assert policy.keys() == sft.keys()
    moved = {name for name in sft if not torch.equal(policy[name], sft[name])}
    assert moved and all(name.endswith(TARGETED) for name in moved), sorted(moved)
    config = json.loads((root / "models" / "policy" / ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "models/sft" and config["r"] == 4, "recorded relative to the workspace"


def test_lora_settings_are_refused_before_any_model_loads(workspace):
    """Each refusal names its key. The model checks read models/sft's config alone: there are no weights to load."""
    for overrides, message in ((["train.use_peft=true", "train.sync_ref_model=true"], "train.sync_ref_model with train.use_peft"),
                               (["train.use_peft=true", "train.lora_dropout=0.05"], "lora_dropout=0.05: must be 0")):
        with pytest.raises(ParamsError, match=message):
            load_params(workspace, overrides=overrides)
    tiny = tiny_gpt_neox_config(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    tiny.save_pretrained(workspace / "models" / "sft")  # a config.json, no weights
    cases = [
        (["train.lora_target_modules=[q_proj]"], "train.lora_target_modules ['q_proj']: not in this model; name some "
         "of the gpt_neox model's layers: dense, dense_4h_to_h, dense_h_to_4h, embed_in, lm_head, query_key_value"),
        (["train.lora_target_modules=[input_layernorm]"], "PEFT cannot wrap this model so (Target module LayerNorm"),
        (["train.lora_modules_to_save=[score]"], "train.lora_modules_to_save: 'score' is not a module"),
    ]
    runner = CliRunner()
    for overrides, message in cases:
        result = runner.invoke(app, ["stage", "train", *sets(["train.use_peft=true", *overrides])])
        assert result.exit_code == 2 and message in result.output, result.output
    # an architecture PEFT has no default targets for (BioGPT), with lora_target_modules left to PEFT
    from transformers import BioGptConfig

    BioGptConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64).save_pretrained(workspace / "models" / "sft")
    result = runner.invoke(app, ["stage", "train", "--set", "train.use_peft=true"])
    assert result.exit_code == 2 and "train.lora_target_modules None: PEFT cannot wrap this model so (Please " \
        "specify `target_modules`" in result.output and "biogpt model's layers" in result.output, result.output
    # `rlhf run`: before Prefect starts and sft runs, against the tiny model the sft stage would make
    result = runner.invoke(app, ["run", *sets(["train.use_peft=true", "train.lora_target_modules=[q_proj]"])])
    assert result.exit_code == 2 and "train.lora_target_modules ['q_proj']: not in this model" in result.output, \
        result.output
    assert not (workspace / ".prefect").exists() and not (workspace / "reports").exists(), "nothing ran"


def test_a_lora_run_saves_the_merged_policy_and_its_adapter_and_resumes(tmp_path, make_policy, make_scorer_model,
                                                                        tokenizer, monkeypatch):
    """One process, in process: models/policy is the merged model (it equals the base + adapter through PEFT) with
    the adapter in models/policy/adapter/; with its last checkpoint gone, the rerun resumes from update 1 and ends
    with the same policy."""
    from peft import PeftModel

    root = make_workspace(tmp_path / "ws", make_policy, make_scorer_model, tokenizer)
    monkeypatch.chdir(root)
    monkeypatch.setenv("RLHF_TRACKING", "off")
    overrides = [*LORA, "train.gradient_accumulation_steps=8"]  # the 2-process tests' global batch on 1 process
    first = run_stage("train", root, overrides=overrides)
    assert first["update"] == 2 and first["resumed_from_update"] == 0
    assert_only_the_adapted_weights_moved(root)
    assert not (root / "checkpoints" / "train" / "adapter").exists(), "the scratch adapter is cleaned up"
    merged = load_policy(root / "models" / "policy")
    adapted = PeftModel.from_pretrained(load_policy(root / "models" / "sft"), root / "models" / "policy" / ADAPTER_DIR)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
    trained = policy_of(root)

    shutil.rmtree(root / "checkpoints" / "train" / "update-000002")
    shutil.rmtree(root / "models" / "policy")
    again = run_stage("train", root, overrides=overrides)
    execution = json.loads((root / "reports" / "execution" / "train.json").read_text())
    assert execution["resumed_from_update"] == 1 and again["update"] == 2
    assert again["objective/scores"] == pytest.approx(first["objective/scores"], abs=1e-6)
    for name, value in trained.items():
        torch.testing.assert_close(policy_of(root)[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_lora_train_stage_on_two_processes_under_ddp_and_zero3(tmp_path, make_policy, make_scorer_model, tokenizer,
                                                               algo):
    """The real stage through the launcher: torchrun (gloo DDP) and accelerate + DeepSpeed ZeRO-3, 2 ranks each.
    The adapter starts from one seeded init on every rank, the reference is the base with the adapter off, and both
    launches end with the same merged policy (episode-keyed sampling: the same completions). GRPO: params.yaml's
    kl_coef is its beta (a reference), 8 generations per prompt (4 prompts per rank)."""
    layouts = {"ddp": [], "zero3": ["runtime.accelerate_config=infra/accelerate/deepspeed_zero3.yaml"]}
    policies = {}
    for name, extra in layouts.items():
        root = make_workspace(tmp_path / name, make_policy, make_scorer_model, tokenizer)
        proc = stage_train(root, ["runtime.num_processes=2", "train.gradient_accumulation_steps=4",
                                  f"train.algo={algo}", *extra])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        metrics = json.loads((root / "metrics" / "train.json").read_text())
        expected = "DEEPSPEED" if name == "zero3" else "MULTI_CPU"
        assert (metrics["num_processes"], metrics["distributed_type"], metrics["update"]) == (2, expected, 2), metrics
        assert metrics["objective/kl"] != 0, "the adapter moved the policy away from its reference, the base"
        assert_only_the_adapted_weights_moved(root)
        policies[name] = policy_of(root)
    for name, weight in policies["ddp"].items():
        torch.testing.assert_close(policies["zero3"][name], weight, rtol=1e-4, atol=1e-5, msg=name)


def listen_port() -> int:
    """A free port below the kernel's range for outgoing connections (ip_local_port_range, 32768 up), for a port
    every launch of a run reuses over minutes: one from that range (bind to 0) can be taken meanwhile as the local
    port of any outgoing connection, and a later launch then fails with EADDRINUSE (seen once in make test)."""
    import random
    import socket

    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")


@pytest.fixture
def lora_flow_repo(tmp_path, mlflow_db_template):
    """The repo's pipeline, profiles and launch configs in a fresh git + DVC repo, with an MLflow store ready."""
    from test_flow import git_dvc_repo, with_migrated_prefect_db

    for item in ("dvc.yaml", ".gitignore", "prefect.yaml", "params.yaml"):
        shutil.copy(REPO / item, tmp_path / item)
    for package in ("rlhf_core", "tasks", "flows", "profiles", "infra/accelerate"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    # the profile shrunk further to TINY in its own file: a stage applies its profile over params.yaml, where
    # `rlhf run --set` puts the overrides, so an override of a key the profile sets would not reach the stages
    profile = tmp_path / "profiles" / f"{LORA_PROFILE}.yaml"
    shrunk = yaml.safe_load(profile.read_text())
    for item in TINY:
        shrunk = deep_merge(shrunk, parse_override(item))
    profile.write_text(yaml.safe_dump(shrunk, sort_keys=False))
    # a free rendezvous port: another launch on this machine (a second test session) would meet this one on 29500
    config = tmp_path / shrunk["runtime"]["accelerate_config"]
    config.write_text(config.read_text().replace("main_process_port: 29500", f"main_process_port: {listen_port()}"))
    shutil.copy(mlflow_db_template, tmp_path / "mlflow.db")  # git-ignored; saves the ~10 s migrations
    with_migrated_prefect_db(tmp_path / ".prefect")  # the same for the temporary Prefect server's
    return git_dvc_repo(tmp_path)


@pytest.mark.slow
def test_cpu_zero2_lora_profile_runs_the_whole_flow_and_registers_a_version(lora_flow_repo):
    """`rlhf run --profile cpu-zero2-lora` as in a fresh clone (a temporary Prefect server, every stage through DVC),
    the profile shrunk further to TINY: every model stage on 2 DeepSpeed ZeRO-2 ranks (sft and reward-model fully
    fine-tuned), the LoRA policy merged, evaluated and registered with its adapter."""
    from mlflow import MlflowClient
    from test_cpu_profiles import MODEL_METRICS  # (it imports this module: here, not at the top)
    from test_flow import base_env

    root = lora_flow_repo
    proc = subprocess.run([RLHF, "run", "--profile", LORA_PROFILE], cwd=root,
                          env=base_env(COLUMNS="200", OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    for stage, metrics_file in MODEL_METRICS.items():  # every model stage on both ZeRO-2 ranks, tracked once
        metrics = json.loads((root / "metrics" / f"{metrics_file}.json").read_text())
        assert (metrics["num_processes"], metrics["distributed_type"]) == (2, "DEEPSPEED"), (stage, metrics)
        assert len(client.search_runs(experiments, f"tags.`rlhf.stage` = '{stage}'")) == 1, stage
    for stage in ("sft", "reward-model"):  # the supervised loop: DeepSpeed's micro-batch and clipping from ours
        assert json.loads((root / "reports" / "execution" / f"{stage}.json").read_text())["train_seconds"] > 0
        assert "train_seconds" not in json.loads((root / "metrics" / f"{MODEL_METRICS[stage]}.json").read_text())
    assert (root / "models" / "policy" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    profile = yaml.safe_load((REPO / "profiles" / f"{LORA_PROFILE}.yaml").read_text())["train"]
    moved = {n for n, w in policy_of(root).items()
             if not torch.equal(w, load_file(root / "models" / "sft" / "model.safetensors")[n])}
    assert moved and {n.rsplit(".", 2)[-2] for n in moved} <= set(profile["lora_target_modules"]), sorted(moved)
    report = json.loads((root / "metrics" / "register.json").read_text())
    assert report["registered"] is True and report["version"] == 1, report
    version = client.get_model_version("rlhf-policy", "1")
    assert version.tags["adapter"].endswith(f"/{ADAPTER_DIR}")
    artifacts = [a.path for a in client.list_artifacts(version.run_id, ADAPTER_DIR)]
    assert f"{ADAPTER_DIR}/adapter_model.safetensors" in artifacts, artifacts
