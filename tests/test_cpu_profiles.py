"""The CPU launch profiles (profiles/cpu-*.yaml) through the whole flow, and the guide docs/gpus.md held to the
commands the tests run: each launch path the guide shows for GPUs is run here on 2 CPU processes."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_flow import BIN, base_env, pipeline_repo  # noqa: F401 (a fixture)
from test_lora import GPU_GUIDE_COMMANDS as LORA_COMMANDS  # the LoRA commands, mapped beside their tests

from tasks.execution.launcher import LAUNCHED_ENV, MODEL_STAGES, launch_command

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
MODEL_METRICS = {"sft": "sft", "reward-model": "reward", "inspect": "inspect", "train": "train", "evaluate": "eval"}


def with_profiles(repo: Path) -> Path:
    """A workspace with the repo's profiles and launch configs (a profile names infra/accelerate/ relative to it)."""
    shutil.copytree(REPO / "profiles", repo / "profiles", dirs_exist_ok=True)
    shutil.copytree(REPO / "infra" / "accelerate", repo / "infra" / "accelerate", dirs_exist_ok=True)
    return repo


@pytest.mark.slow
def test_the_whole_flow_under_the_cpu_zero3_profile(pipeline_repo):  # noqa: F811
    """`rlhf run --profile cpu-zero3` (Prefect over DVC), the profile as users run it: every model stage runs on 2
    DeepSpeed ZeRO-3 ranks and records so in its metrics and its MLflow params; the run ends with a registered
    version."""
    from mlflow import MlflowClient

    assert set(MODEL_METRICS) == set(MODEL_STAGES)
    repo = with_profiles(pipeline_repo)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "profiles"], cwd=repo, check=True)
    proc = subprocess.run([BIN / "rlhf", "run", "--profile", "cpu-zero3"], cwd=repo,
                          env=base_env(COLUMNS="200", OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "rlhf-policy v1" in proc.stdout, proc.stdout[-3000:]
    assert json.loads((repo / "metrics" / "register.json").read_text())["version"] == 1
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    for stage, metrics_file in MODEL_METRICS.items():
        metrics = json.loads((repo / "metrics" / f"{metrics_file}.json").read_text())
        assert (metrics["num_processes"], metrics["distributed_type"]) == (2, "DEEPSPEED"), (stage, metrics)
        [run] = client.search_runs(experiments, f"tags.`rlhf.stage` = '{stage}'")
        params = run.data.params
        assert (params["num_processes"], params["distributed_type"]) == ("2", "DEEPSPEED"), (stage, params)
        assert params["runtime.accelerate_config"] == "infra/accelerate/deepspeed_zero3.yaml"


# The tool demo shrunk for a test: enough SFT steps (160) for the tiny policy to write the call format (a call that
# parses is all train needs to run one; 96 steps of a 1-layer model wrote none), two GRPO updates, a few prompts.
TOOL_DEMO_SMALL = [
    "prepare.world.sft_train=512", "prepare.world.sft_eval=16", "prepare.world.prefs_train=128",
    "prepare.world.prefs_eval=32", "prepare.world.prompts_train=32", "prepare.world.prompts_eval=16",
    "sft.epochs=5", "sft.tiny.num_layers=2", "sft.tiny.hidden_size=64", "sft.tiny.intermediate_size=256",
    "sft.eval_max_new_tokens=8", "inspect.num_pairs=32", "inspect.num_prompts=16", "train.total_episodes=128",
    "train.checkpoint_every=1", "train.trace_every=1", "evaluate.num_prompts=16",
]


@pytest.mark.slow
def test_the_whole_flow_under_the_tool_demo_profile(pipeline_repo):  # noqa: F811
    """`rlhf run --profile tool-demo` (Prefect over DVC, shrunk by --set): the world's tool task through every stage.
    The SFT data teaches the call (TRL's tool-call layout, a `tools` column), train's GRPO rollouts run lookup_case
    (tools/call_frequency > 0), the trace shows the tool's turn, evaluate reports the tool rates of both policies (the
    SFT policy's greedy rollouts call it), and a version is registered."""
    repo = with_profiles(pipeline_repo)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert params["trust"]["tool_modules"] == ["rlhf_core.world.tools"], "as committed: a profile cannot set trust"
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "profiles"], cwd=repo, check=True)
    overrides = [x for item in TOOL_DEMO_SMALL for x in ("--set", item)]
    proc = subprocess.run([BIN / "rlhf", "run", "--profile", "tool-demo", *overrides], cwd=repo,
                          env=base_env(COLUMNS="200", OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "rlhf-policy v1" in proc.stdout, proc.stdout[-3000:]
    sft_row = json.loads((repo / "data" / "sft_train.jsonl").open().readline())
    assert sft_row["tools"][0]["function"]["name"] == "lookup_case"
    trained = json.loads((repo / "metrics" / "train.json").read_text())
    assert trained["tools/call_frequency"] > 0 and 0 <= trained["tools/failure_frequency"] <= 1, trained
    traces = sorted((repo / "reports" / "trace").glob("update-*.json"))
    roles = {turn["source"] for t in traces for r in json.loads(t.read_text())["rollouts"] for turn in r["turns"]}
    assert traces and "tool" in roles, roles
    evaluation = json.loads((repo / "metrics" / "eval.json").read_text())
    assert {"tool_call_rate", "tool_failure_rate", "ref_tool_call_rate", "ref_tool_failure_rate",
            "win_rate_gold"} <= evaluation.keys(), evaluation
    assert evaluation["ref_tool_call_rate"] > 0, evaluation


# ------------------------------------------------------------------ docs/gpus.md, "Training on GPUs"

GPU_GUIDE = REPO / "docs" / "gpus.md"
# Every `rlhf` command of the guide's code blocks -> the test that runs it, or its CPU stand-in (a CPU profile for
# the GPU flags: the same launcher and accelerate config on 2 CPU processes); the LoRA ones are in tests/test_lora.py.
# A command added to the guide without a test mapped fails `test_every_launch_command_in_the_gpu_guide_is_run_by_a_test`.
GPU_GUIDE_COMMANDS = {
    "rlhf run --profile tldr-pythia-1b":
        "test_pipeline.py::test_real_profile_runs_on_local_copies",
    "rlhf run --profile tldr-pythia-1b --set runtime.num_processes=8 "
    "--set runtime.accelerate_config=infra/accelerate/multi_gpu.yaml":
        "test_launcher.py::test_train_stage_on_two_processes",  # cpu-ddp: DDP on torchrun/gloo
    "rlhf run --profile tldr-pythia-1b --set runtime.num_processes=8 "
    "--set runtime.accelerate_config=infra/accelerate/deepspeed_zero2.yaml":
        "test_lora.py::test_cpu_zero2_lora_profile_runs_the_whole_flow_and_registers_a_version",  # the flow on ZeRO-2
    "rlhf run --profile tldr-pythia-1b --set runtime.num_processes=8 "
    "--set runtime.accelerate_config=infra/accelerate/deepspeed_zero3.yaml":
        "test_cpu_profiles.py::test_the_whole_flow_under_the_cpu_zero3_profile",
    "rlhf run --profile cpu-ddp":
        "test_launcher.py::test_train_stage_on_two_processes",
    "rlhf run --profile cpu-zero3":
        "test_cpu_profiles.py::test_the_whole_flow_under_the_cpu_zero3_profile",
    "rlhf run --profile tldr-pythia-1b --set runtime.launcher=ray --set runtime.num_processes=16 "
    "--set runtime.accelerate_config=infra/accelerate/deepspeed_zero3.yaml":
        "test_ray.py::test_zero3_on_ray_writes_the_accelerate_launchs_bytes_through_a_killed_rank",  # ZeRO-3 ranks on 2 Ray nodes
    "rlhf run --profile cpu-ray":
        "test_ray.py::test_the_whole_pipeline_runs_every_model_stage_on_two_ray_nodes",
    "rlhf stage train --profile tldr-pythia-1b --set runtime.num_machines=2 --set runtime.num_processes=16 "
    "--set runtime.accelerate_config=zero3-node0.yaml":
        "test_launcher.py::test_an_accelerate_config_launches_with_accelerate",  # the command it builds
}


def guide_commands(guide: Path = GPU_GUIDE) -> list[str]:
    """The `rlhf ...` lines (`.venv/bin/rlhf` too) of every shell block of the guide (all of it: the guide is about
    GPUs alone)."""
    blocks = re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", guide.read_text(), flags=re.S)
    lines = [line.strip().removeprefix(".venv/bin/") for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("rlhf ")]


def test_every_launch_command_in_the_gpu_guide_is_run_by_a_test():
    commands = guide_commands()
    assert commands, f"{GPU_GUIDE} has no rlhf command in a bash block"
    mapped = {**GPU_GUIDE_COMMANDS, **LORA_COMMANDS}
    unknown = [c for c in commands if c not in mapped]
    assert not unknown, f"docs/gpus.md names commands no test runs (add the test, then map it): {unknown}"
    for command, test in mapped.items():
        assert command in commands, f"mapped but gone from docs/gpus.md: {command}"
        file, name = test.split("::")
        tree = ast.parse((TESTS / file).read_text())
        assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, f"{test}: no such test"
        for profile in re.findall(r"--profile (\S+)", command):
            assert (REPO / "profiles" / f"{profile}.yaml").is_file(), profile
        for config in re.findall(r"accelerate_config=(infra/\S+)", command):
            assert (REPO / config).is_file(), config


def test_the_cpu_profiles_run_every_model_stage_on_two_processes(monkeypatch):
    """What `rlhf stage NAME --profile P` launches, from the repository's params.yaml under each CPU profile, as the
    CLI computes it (`load_params`, then `launch_command`): every model stage on 2 processes through its launcher
    (torchrun's gloo world for cpu-ddp, accelerate with the ZeRO-3 config for cpu-zero3), every other stage in the
    calling process. The whole flow under cpu-zero3 (above) records the same 2 ranks in each model stage's metrics."""
    from tasks.parameters.params import load_params

    monkeypatch.delenv(LAUNCHED_ENV, raising=False)  # as `rlhf stage` starts: not yet a launched rank
    monkeypatch.chdir(REPO)  # the profile names its accelerate config relative to the workspace
    launchers = {"cpu-ddp": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
                 "cpu-zero3": ["-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
                               "--config_file", "infra/accelerate/deepspeed_zero3.yaml"]}
    for profile, launcher in launchers.items():
        runtime = load_params(REPO, profile).runtime
        for stage in [*MODEL_METRICS, "prepare", "validate", "register"]:
            command = launch_command(runtime, stage, ["--profile", profile])
            if stage not in MODEL_METRICS:
                assert command is None, (profile, stage, command)
                continue
            assert command is not None, f"{profile}: stage {stage} runs in one process"
            assert command[0] == sys.executable and command[1:1 + len(launcher)] == launcher, (profile, stage, command)
            assert command[command.index(str(BIN / "rlhf")):] == [str(BIN / "rlhf"), "stage", stage, "--profile",
                                                                  profile], (profile, stage, command)
