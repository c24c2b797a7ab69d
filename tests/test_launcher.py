"""`rlhf stage` on several processes: the launch command, and the real train stage on a 2-process gloo world
(torchrun) against the same stage on one process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_pipeline import TINY, invoke

from rlhf_core.config import RuntimeConfig
from tasks.execution.launcher import LAUNCHED_ENV, launch_command
from tasks.runner import leave_process_group
from tasks.tracking.mlflow_store import get_client

RLHF = str(Path(sys.executable).parent / "rlhf")
REPO = Path(__file__).resolve().parent.parent


def test_cpu_processes_launch_with_torchrun(monkeypatch):
    monkeypatch.delenv(LAUNCHED_ENV, raising=False)
    command = launch_command(RuntimeConfig(device="cpu", num_processes=2), "train", ["--set", "train.kl_coef=0.1"])
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[command.index("--nproc_per_node") + 1] == "2"
    assert command[-5:] == [RLHF, "stage", "train", "--set", "train.kl_coef=0.1"]


def test_an_accelerate_config_launches_with_accelerate(monkeypatch, tmp_path):
    monkeypatch.delenv(LAUNCHED_ENV, raising=False)
    config = tmp_path / "zero2.yaml"
    config.write_text("distributed_type: DEEPSPEED\n")
    command = launch_command(RuntimeConfig(device="cpu", num_processes=2, accelerate_config=str(config),
                                           mixed_precision="bf16"), "sft", [])
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[command.index("--config_file") + 1] == str(config)
    assert command[command.index("--mixed_precision") + 1] == "bf16", "params decide the precision"
    assert command[-4:] == ["--no_python", RLHF, "stage", "sft"]
    # one machine: a free rendezvous port, not the config's 29500 that another launch here may hold
    port = int(command[command.index("--main_process_port") + 1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    several = launch_command(RuntimeConfig(device="cpu", num_processes=4, num_machines=2, accelerate_config=str(config)),
                             "sft", [])
    assert "--main_process_port" not in several, "several machines meet at the port their config names"


def test_what_runs_in_this_process(monkeypatch, tmp_path):
    monkeypatch.delenv(LAUNCHED_ENV, raising=False)
    assert launch_command(RuntimeConfig(), "train", []) is None, "one process: no launcher"
    assert launch_command(RuntimeConfig(num_processes=2), "prepare", []) is None, "only stages that run a model"
    assert launch_command(RuntimeConfig(device="cpu", num_processes=2), "evaluate", []) is not None, \
        "evaluate and inspect run under the runtime too"
    # on Ray this process drives the ranks (tasks/runner.py): no local launcher, and no cluster named is not its
    # business (`rlhf stage` and `rlhf run` check the cluster beside it, tests/test_ray.py)
    assert launch_command(RuntimeConfig(launcher="ray", num_processes=2), "train", []) is None
    with pytest.raises(ValueError, match="no such file"):
        launch_command(RuntimeConfig(accelerate_config=str(tmp_path / "nope.yaml")), "train", [])
    monkeypatch.setenv(LAUNCHED_ENV, "1")
    assert launch_command(RuntimeConfig(num_processes=2), "train", []) is None, "a launched rank never relaunches"


# 64 episodes per update as 1 x (8 x 8) and as 2 x (8 x 4): the same global batch size and optimizer steps. With
# episode-keyed sampling each episode draws the same completion on either layout, so the runs train the same policy.
SAME_BATCH = ["train.per_device_train_batch_size=8", "train.local_rollout_forward_batch_size=32",
              "train.total_episodes=128", "train.learning_rate=1e-3", "train.sampling_seed=episode"]
LAYOUT_ACCUMULATION = {1: 8, 2: 4}
LAYOUTS = {n: [f"train.gradient_accumulation_steps={g}", f"runtime.num_processes={n}"]
           for n, g in LAYOUT_ACCUMULATION.items()}


def stage_train(root: Path, overrides: list[str], profile: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(LAUNCHED_ENV, None)
    args = [x for item in [*TINY, *SAME_BATCH, *overrides] for x in ("--set", item)]
    if profile is not None:  # profiles/<profile>.yaml of the repo, beside the workspace's params.yaml
        shutil.copytree(REPO / "profiles", root / "profiles", dirs_exist_ok=True)
        args = ["--profile", profile, *args]
    # its own process group (= its pid): whatever it leaves behind is found there, and nothing else on the machine
    with subprocess.Popen([RLHF, "stage", "train", *args], cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        stdout, stderr = proc.communicate(timeout=600)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    result.pid = proc.pid
    return result


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_train_stage_on_two_processes(workspace):
    """The real stage through the launcher under profiles/cpu-ddp.yaml (2 processes, torchrun, gloo): 2 ranks train,
    rank 0 alone writes one set of outputs and one MLflow run, and the policy is the 1-process run's (the same
    profile on one process) on the same global batches (episode-keyed sampling), within 1e-4."""
    for name in ("prepare", "validate", "sft", "reward-model", "inspect"):
        invoke("stage", name, *[x for item in TINY for x in ("--set", item)])
    alone = workspace.parent / f"{workspace.name}-one"
    shutil.copytree(workspace, alone)
    sft = load_file(workspace / "models" / "sft" / "model.safetensors")
    policies = {}
    layouts = {2: [f"train.gradient_accumulation_steps={LAYOUT_ACCUMULATION[2]}"],  # the profile's 2 processes
               1: [f"train.gradient_accumulation_steps={LAYOUT_ACCUMULATION[1]}", "runtime.num_processes=1"]}
    for processes, root in ((2, workspace), (1, alone)):
        proc = stage_train(root, layouts[processes], profile="cpu-ddp")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.stdout.count('"num_processes"') == 1, "one result printed, by rank 0"
        metrics = json.loads((root / "metrics" / "train.json").read_text())
        assert metrics["num_processes"] == processes and metrics["episode"] == 128
        log = [json.loads(line) for line in (root / "reports" / "execution" / "train_log.jsonl").read_text().splitlines()]
        assert [h["update"] for h in log] == [1, 2], "one line per update, written by one process"
        assert [h["update"] for h in json.loads((root / "metrics" / "train_history.json").read_text())] == [1, 2]
        policies[processes] = policy = load_file(root / "models" / "policy" / "model.safetensors")
        assert policy.keys() == sft.keys() and all(torch.isfinite(v).all() for v in policy.values())
        assert any(not torch.equal(policy[k], sft[k]) for k in sft), "the policy was trained"
        assert sorted(p.name for p in (root / "checkpoints" / "train").glob("update-*")) == \
            ["update-000001", "update-000002"], "every rank joined the checkpoints (save_state)"
    for name, weight in policies[1].items():
        torch.testing.assert_close(policies[2][name], weight, rtol=1e-4, atol=1e-5, msg=name)
    client = get_client(workspace)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, "tags.`rlhf.stage` = 'train'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", "one MLflow run, from rank 0"
    assert [p.name for p in (workspace / "models").iterdir() if p.name.startswith(".")] == [], "nothing half-written"


@pytest.mark.slow
def test_a_failing_rank_fails_the_stage_with_its_error_and_leaves_no_process(workspace, plain_stages):
    # plain: the launcher and its ranks in the stage's own process group, where the check looks
    for name in ("prepare", "validate"):
        invoke("stage", name, *[x for item in TINY for x in ("--set", item)])
    proc = stage_train(workspace, LAYOUTS[2])  # no SFT policy yet: every rank fails to load it
    assert proc.returncode != 0
    assert "could not load" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not group_alive(proc.pid), "every rank and the launcher are gone"


def test_a_batch_the_processes_cannot_fill_fails_before_any_model_loads(workspace):
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["stage", "train", "--set", "runtime.num_processes=3",
                                      "--set", "train.total_episodes=128"])
    assert result.exit_code == 2 and "error:" in result.output and "batch" in result.output, result.output


@pytest.mark.slow
def test_sft_and_reward_model_stages_on_two_processes(workspace):
    """DDP (torchrun, gloo). DeepSpeed runs them in the whole flows: ZeRO-3 in tests/test_cpu_profiles.py, ZeRO-2 in
    tests/test_lora.py (the supervised loop prepares no dataloader: the micro-batch and the clipping reach
    DeepSpeed's config)."""
    for name in ("prepare", "validate"):
        invoke("stage", name, *[x for item in TINY for x in ("--set", item)])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(LAUNCHED_ENV, None)
    args = [x for item in [*TINY, "runtime.num_processes=2"] for x in ("--set", item)]
    for stage, model, metrics_file in (("sft", "sft", "sft"), ("reward-model", "reward", "reward")):
        proc = subprocess.run([RLHF, "stage", stage, *args], cwd=workspace, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert (workspace / "models" / model / "model.safetensors").is_file()
        assert json.loads((workspace / "reports" / "execution" / f"{stage}.json").read_text())["train_seconds"] > 0
        metrics = json.loads((workspace / "metrics" / f"{metrics_file}.json").read_text())
        assert "train_seconds" not in metrics
        assert (metrics["num_processes"], metrics["distributed_type"]) == (2, "MULTI_CPU")
    client = get_client(workspace)
    experiments = [e.experiment_id for e in client.search_experiments()]
    for stage in ("sft", "reward-model"):
        assert len(client.search_runs(experiments, f"tags.`rlhf.stage` = '{stage}'")) == 1, stage


@pytest.mark.slow
def test_a_two_process_run_resumes_from_its_checkpoint(workspace):
    """Interrupted after update 1 (its checkpoint kept, the rest gone), the 2-process stage resumes there."""
    for name in ("prepare", "validate", "sft", "reward-model", "inspect"):
        invoke("stage", name, *[x for item in TINY for x in ("--set", item)])
    proc = stage_train(workspace, LAYOUTS[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = json.loads((workspace / "metrics" / "train.json").read_text())
    shutil.rmtree(workspace / "checkpoints" / "train" / "update-000002")
    shutil.rmtree(workspace / "models" / "policy")
    proc = stage_train(workspace, LAYOUTS[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((workspace / "metrics" / "train.json").read_text())
    assert again["num_processes"] == 2 and again["update"] == 2
    assert json.loads((workspace / "reports" / "execution" / "train.json").read_text())["resumed_from_update"] == 1
    history = (workspace / "reports" / "execution" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["update"] for line in history] == [1, 2], "update 2 redone, logged once"
    assert again["objective/scores"] == pytest.approx(first["objective/scores"], abs=1e-6), \
        "the resumed update 2 is the same update 2 (sampler, RNG and optimizer state restored on every rank)"


def test_a_launched_rank_leaves_its_process_group_and_a_callers_group_stays(monkeypatch, tmp_path):
    """A launched rank tears its (gloo) group down before exit; outside a launch the group is the caller's."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        monkeypatch.delenv(LAUNCHED_ENV, raising=False)
        leave_process_group()
        assert dist.is_initialized(), "not launched: the caller's group is left alone"
        monkeypatch.setenv(LAUNCHED_ENV, "1")
        leave_process_group()
        assert not dist.is_initialized()
        leave_process_group()  # no group: nothing to do
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_launched_rank_that_finished_exits_0_with_its_output_and_exit_handlers(workspace):
    """A finished rank skips the interpreter's teardown (os._exit), yet its buffered stdout (the stage's JSON, on a
    pipe) reaches the launcher, and the exit handlers ran: its entry in the registry of torch processes is gone."""
    from rlhf_core.threads import registry

    env = {**os.environ, LAUNCHED_ENV: "1", "RLHF_TRACKING": "off"}
    env.pop("RLHF_THREADS", None)  # the registry is kept unless the user fixes the threads
    with subprocess.Popen([RLHF, "stage", "prepare", *[x for item in TINY for x in ("--set", item)]], cwd=workspace,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(stdout[stdout.index("{"):])["stage_seconds"] > 0
    assert not (registry() / str(proc.pid)).exists(), "the exit handlers ran"
