"""The model stages on a Ray cluster (`runtime.launcher: ray`, profiles/cpu-ray.yaml) on two real Ray nodes of this
machine (tests/ray_cluster.py: 127.0.0.2 and 127.0.0.3, 1 CPU each, no dashboard).

One whole pipeline runs on the cluster (`rlhf run --profile cpu-ray`); its workspace is then copied for the rest:
train on Ray writes the bytes the 2-process local launch writes (DDP against torchrun; DeepSpeed ZeRO-3 against
accelerate, through a rank killed mid-train and a restart from the last checkpoint), a stage out of restarts brings
its checkpoint home and the next run resumes from it (in the long tier, `make test-slow`), a cluster that does not answer fails before anything
is touched, and Ctrl-C leaves no Ray worker on either node. Every rank runs in a scratch folder of its own node,
never in the workspace.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cpu_profiles import with_profiles
from test_flow import BIN, base_env, build_pipeline_repo

from tasks.execution.launcher import MODEL_STAGES
from tasks.execution.ray_worker import CLEANER_LOGGER, STATE_API_WARNING, quiet_the_cleaners_state_api_warning

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from ray_cluster import HEAD_IP, WORKER_IP, LocalRayCluster, free_port  # noqa: E402

pytestmark = pytest.mark.usefixtures("ctrl_c_reaches_children")

MODEL_METRICS = {"sft": "sft", "reward-model": "reward", "inspect": "inspect", "train": "train", "evaluate": "eval"}
UPDATES = 4  # of 32 episodes, each checkpointed: room to kill a rank after one and resume before the end
EPISODES = f"train.total_episodes={32 * UPDATES}"
TRAIN_OUTPUTS = ("models/policy", "reports/trace", "metrics/train.json", "metrics/train_history.json")
WAIT_S = 900  # a bound on waiting, not a timing assertion


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LocalRayCluster(tmp_path_factory.mktemp("ray")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def ray_run(cluster, tmp_path_factory, mlflow_db_template):
    """`rlhf run --profile cpu-ray` in a fresh git + DVC repo: every model stage on the cluster."""
    repo = with_profiles(build_pipeline_repo(tmp_path_factory.mktemp("ray-repo"), mlflow_db_template))
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "profiles"], cwd=repo, check=True)
    proc = subprocess.run([BIN / "rlhf", "run", "--profile", "cpu-ray", "--set", EPISODES], cwd=repo,
                          env=ray_env(cluster), capture_output=True, text=True, timeout=2400)
    return repo, proc


def ray_env(cluster: LocalRayCluster, **extra: str) -> dict[str, str]:
    return base_env(COLUMNS="200", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{**cluster.env, **extra})


def copy_of(repo: Path, tmp_path: Path, name: str) -> Path:
    copy = tmp_path / name
    shutil.copytree(repo, copy, symlinks=True, ignore=shutil.ignore_patterns("checkpoints"))
    return copy


def stage_train(root: Path, env: dict[str, str], *sets: str, wait: bool = True, episodes: str = EPISODES):
    args = [BIN / "rlhf", "stage", "train", "--profile", "cpu-ray", "--set", episodes,
            *[x for item in sets for x in ("--set", item)]]
    proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    if not wait:
        return proc
    output, _ = proc.communicate(timeout=WAIT_S)
    return subprocess.CompletedProcess(args, proc.returncode, output)


def torchrun_train(root: Path, *sets: str) -> subprocess.CompletedProcess:
    """The same stage on 2 local processes (torchrun, or accelerate with a config): the reference bytes."""
    return stage_train(root, base_env(OMP_NUM_THREADS="1"), "runtime.launcher=local", *sets)


def assert_same_bytes(a: Path, b: Path, paths=TRAIN_OUTPUTS) -> None:
    for relative in paths:
        files = sorted(p.relative_to(a) for p in (a / relative).rglob("*") if p.is_file()) if (a / relative).is_dir() \
            else [Path(relative)]
        assert files, f"{a / relative}: nothing there"
        for file in files:
            assert (a / file).read_bytes() == (b / file).read_bytes(), f"{file} differs between {a} and {b}"


def checkpoints_in(cluster: LocalRayCluster) -> list[str]:
    """The checkpoints Ray Train has registered on the shared storage (every rank reported them), over every run
    folder: a folder still being written is not one, and a rank killed then leaves nothing to resume from."""
    from tasks.execution.ray_launch import registered_checkpoint
    from tasks.execution.shared_storage import RunFolder

    runs = {run.name: registered_checkpoint(RunFolder(str(run))) for run in cluster.storage.glob("*-ray")}
    return sorted(f"{run}/{name}" for run, name in runs.items() if name)


def wait_for(condition, what: str, proc: subprocess.Popen, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the stage ended before {what}:\n{proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.2)


def train_workers(cluster: LocalRayCluster, node: str | None = None) -> list:
    return [p for p in cluster.ray_processes(node) if "RayTrainWorker" in p.name() + " ".join(p.cmdline()[:1])]


def no_ray_workers_left(cluster: LocalRayCluster, workers, timeout_s: float = 60) -> list:
    """The processes `workers(cluster)` still lists after up to `timeout_s`: Ray reaps a job's workers after its
    driver has left, seconds later on a loaded machine (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while (left := workers(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_the_whole_pipeline_runs_every_model_stage_on_two_ray_nodes(ray_run, cluster):
    from mlflow import MlflowClient

    repo, proc = ray_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "rlhf-policy v1" in proc.stdout, proc.stdout[-3000:]
    assert set(MODEL_METRICS) == set(MODEL_STAGES)
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    for stage, metrics_file in MODEL_METRICS.items():
        metrics = json.loads((repo / "metrics" / f"{metrics_file}.json").read_text())
        assert (metrics["num_processes"], metrics["distributed_type"]) == (2, "MULTI_CPU"), (stage, metrics)
        ray = json.loads((repo / "reports" / "execution" / f"{stage}.json").read_text())["ray"]
        assert ray["address"] == cluster.address
        ranks = ray["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and {r["node_ip"] for r in ranks} == {HEAD_IP, WORKER_IP}, ranks
        for rank in ranks:  # a rank works in its node's scratch folder, never in the workspace
            for folder in (rank["cwd"], rank["scratch"]):
                assert not Path(folder).resolve().is_relative_to(repo.resolve()), (stage, rank)
        [run] = client.search_runs(experiments, f"tags.`rlhf.stage` = '{stage}'")
        assert run.info.status == "FINISHED" and run.data.params["num_processes"] == "2", (stage, run.data.params)
    [train] = client.search_runs(experiments, "tags.`rlhf.stage` = 'train'")
    history = client.get_metric_history(train.info.run_id, "objective/kl")
    assert [m.step for m in history] == list(range(1, UPDATES + 1)), "every update's figures reach the driver's MLflow run"
    assert f"rank(s) on the Ray cluster at {cluster.address}" in proc.stdout + proc.stderr
    assert STATE_API_WARNING not in proc.stdout + proc.stderr, "a cluster without the dashboard: the cleaner unheard"
    assert list(cluster.storage.iterdir()) == [], "each stage's folder on the shared storage is gone after it"
    left = no_ray_workers_left(cluster, LocalRayCluster.ray_processes)  # ranks, each stage's controller and its helpers
    assert left == [], ("nothing of a stage outlives it", [p.name() for p in left])


def test_ddp_on_ray_writes_the_torchrun_launchs_bytes(ray_run, tmp_path):
    """The pipeline's train stage (DDP across the two nodes) against `torchrun --nproc_per_node 2` of the same
    parameters: the same policy, traces and metrics, byte for byte."""
    repo, _ = ray_run
    local = copy_of(repo, tmp_path, "torchrun")
    proc = torchrun_train(local)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert_same_bytes(repo, local)


def test_zero3_on_ray_writes_the_accelerate_launchs_bytes_through_a_killed_rank(ray_run, cluster, tmp_path):
    """DeepSpeed ZeRO-3 (the GPU config file itself) across the two nodes against `accelerate launch` on 2 local
    processes, through a fault: each rank's shards go into the checkpoints of its own node and Ray Train merges them
    on the shared storage. The rank on the worker node is killed (kill -9) mid-train: the worker group restarts from
    the last checkpoint (runtime.ray_max_failures 1) and ends with the uninterrupted local launch's policy, byte for
    byte."""
    repo, _ = ray_run
    zero3 = "runtime.accelerate_config=infra/accelerate/deepspeed_zero3.yaml"
    local, killed = copy_of(repo, tmp_path, "local"), copy_of(repo, tmp_path, "killed")
    proc = torchrun_train(local, zero3)
    assert proc.returncode == 0, proc.stdout[-4000:]

    seen = set(checkpoints_in(cluster))
    run = stage_train(killed, ray_env(cluster), zero3, wait=False)
    [registered] = kill_a_rank_after_a_new_checkpoint(cluster, run, seen=seen) - seen
    output, _ = run.communicate(timeout=WAIT_S)
    assert run.returncode == 0, output[-4000:]
    assert json.loads((killed / "metrics" / "train.json").read_text())["distributed_type"] == "DEEPSPEED"
    metrics = json.loads((killed / "reports" / "execution" / "train.json").read_text())
    assert metrics["resumed_from_update"] >= int(registered.split("-")[-1]), (registered, metrics)
    assert_same_bytes(local, killed)
    assert no_ray_workers_left(cluster, train_workers) == [], "no rank outlives its stage"


@pytest.mark.slow
def test_a_stage_out_of_restarts_brings_its_checkpoint_home_and_the_next_run_resumes(ray_run, cluster, tmp_path):
    """DDP across the two nodes with no restart allowed (runtime.ray_max_failures 0): the rank on the worker node
    killed (kill -9) mid-train fails the stage naming the node and the checkpoint it brought home; the next run, the
    same command, resumes from it to the uninterrupted pipeline's policy, byte for byte."""
    repo, _ = ray_run
    killed = copy_of(repo, tmp_path, "killed")
    run = stage_train(killed, ray_env(cluster), "runtime.ray_max_failures=0", wait=False)
    kill_a_rank_after_a_new_checkpoint(cluster, run, seen=set(checkpoints_in(cluster)))
    output, _ = run.communicate(timeout=WAIT_S)
    assert run.returncode == 1, output[-4000:]
    error = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "failed on the Ray cluster" in error[0], output[-4000:]
    assert f"on node {WORKER_IP}" in error[0] and "kept in checkpoints/train" in error[0], error[0]
    kept = sorted(p.name for p in (killed / "checkpoints" / "train").glob("update-*"))
    assert kept and kept[-1] in error[0], (kept, error[0])
    assert no_ray_workers_left(cluster, train_workers) == [], "no rank outlives its failed stage"

    rerun = stage_train(killed, ray_env(cluster), "runtime.ray_max_failures=0")
    assert rerun.returncode == 0, rerun.stdout[-4000:]
    metrics = json.loads((killed / "reports" / "execution" / "train.json").read_text())
    assert metrics["resumed_from_update"] == int(kept[-1].split("-")[-1]), metrics
    assert_same_bytes(repo, killed)


def kill_a_rank_after_a_new_checkpoint(cluster: LocalRayCluster, run: subprocess.Popen, seen: set[str]) -> set[str]:
    """kill -9 the train rank on the worker node once a checkpoint not in `seen` is registered on the shared storage;
    what is registered then."""
    wait_for(lambda: set(checkpoints_in(cluster)) - seen and train_workers(cluster, "worker"),
             "a new checkpoint", run)
    for worker in train_workers(cluster, "worker"):
        worker.kill()
    return set(checkpoints_in(cluster))


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
            for folder in ("data", "models", "metrics", "reports") for p in (root / folder).rglob("*") if p.is_file()}


def test_a_cluster_that_does_not_answer_fails_the_run_before_anything_is_touched(ray_run, cluster, tmp_path):
    repo, _ = ray_run
    copy = copy_of(repo, tmp_path, "nobody")
    before, lock = snapshot(copy), (copy / "dvc.lock").read_bytes()
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    for command in (["run", "--profile", "cpu-ray", "--set", "train.kl_coef=0.2"], ["stage", "train", "--profile", "cpu-ray"]):
        proc = subprocess.run([BIN / "rlhf", *command], cwd=copy, env=ray_env(cluster, RAY_ADDRESS=address),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and address in lines[0], proc.stderr
        assert "no Ray cluster answers there" in lines[0], lines[0]
        assert snapshot(copy) == before and (copy / "dvc.lock").read_bytes() == lock


def test_ctrl_c_stops_every_rank_on_both_nodes_and_keeps_the_last_good_outputs(ray_run, cluster, tmp_path):
    repo, _ = ray_run
    copy = copy_of(repo, tmp_path, "interrupted")
    policy = {p.name: p.read_bytes() for p in (copy / "models" / "policy").iterdir()}
    seen = set(checkpoints_in(cluster))
    # long enough that the interrupt always lands mid-train, whatever the machine's load
    run = stage_train(copy, ray_env(cluster), "train.kl_coef=0.2", wait=False, episodes="train.total_episodes=4096")
    wait_for(lambda: set(checkpoints_in(cluster)) - seen and len(train_workers(cluster)) == 2, "a checkpoint", run)
    assert {n for n in ("head", "worker") if train_workers(cluster, n)} == {"head", "worker"}, "a rank on each node"
    os.killpg(run.pid, signal.SIGINT)
    output, _ = run.communicate(timeout=WAIT_S)  # a bound: on a loaded machine Ray takes minutes to stop its actors
    assert run.returncode == 130, output[-4000:]
    left = no_ray_workers_left(cluster, LocalRayCluster.ray_processes)
    assert left == [], [p.name() for p in left]
    assert {p.name: p.read_bytes() for p in (copy / "models" / "policy").iterdir()} == policy
    assert sorted((copy / "checkpoints" / "train").glob("update-*")), "the last checkpoint came home: a rerun resumes"


# ------------------------------------------------------------------ the driver's parts, without a cluster

def test_the_job_hook_drops_the_cleaners_state_api_warning_and_nothing_else(caplog):
    """Ray Train's placement-group cleaner warns each second that the dashboard's state API does not answer, on a
    cluster without the dashboard for as long as the stage runs: each worker of the job drops that warning first."""
    cleaner = logging.getLogger(CLEANER_LOGGER)
    filters = list(cleaner.filters)
    try:
        quiet_the_cleaners_state_api_warning()
        with caplog.at_level(logging.WARNING, logger=CLEANER_LOGGER):
            cleaner.warning(f"{STATE_API_WARNING}. State API may be temporarily unavailable. Continuing to monitor.")
            cleaner.warning("Detected that the Ray Train controller actor (abc) is dead.")
    finally:
        cleaner.filters[:] = filters
    assert [r.getMessage() for r in caplog.records] == ["Detected that the Ray Train controller actor (abc) is dead."]


def test_a_stage_ships_its_non_code_deps_the_parameters_and_its_resume_state(tmp_path):
    from tasks.execution.ray_launch import stage_inputs, stage_outputs
    from tasks.parameters.params import load_params

    root = with_profiles(tmp_path)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    for folder in ("data", "models/sft", "models/reward", "reports/validation", "reports/inspection",
                   "checkpoints/train/update-000001", "reports/execution"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for file in ("data/prompts_train.jsonl", "reports/validation/report.json", "reports/inspection/report.json",
                 "reports/execution/train_log.jsonl"):
        (root / file).write_text("{}\n")
    params = load_params(root, "cpu-ray", ["runtime.accelerate_config=infra/accelerate/deepspeed_zero3.yaml"])
    inputs = stage_inputs(root, "train", params)
    assert {"params.yaml", "dvc.yaml", "profiles/cpu-ray.yaml", "infra/accelerate/deepspeed_zero3.yaml",
            "data/prompts_train.jsonl", "models/sft", "models/reward", "checkpoints/train",
            "reports/execution/train_log.jsonl"} <= set(inputs), inputs
    assert not [p for p in inputs if p.split("/")[0] in ("rlhf_core", "tasks", "flows", "cli")], "code travels as code"
    assert stage_outputs(root, "train") == ["models/policy", "reports/trace", "metrics/train.json",
                                            "metrics/train_history.json", "reports/execution/train.json",
                                            "reports/execution/train_log.jsonl"]
    assert "checkpoints/train" not in stage_inputs(root, "sft", params)


def test_each_rank_gets_the_accelerate_settings_accelerate_launch_gives_it(tmp_path):
    """The DeepSpeed plugin reaches a Ray rank as it reaches an `accelerate launch` rank: the same ACCELERATE_*
    variables, computed by accelerate from the same config file (read here from a real launched process)."""
    from rlhf_core.config import RuntimeConfig
    from tasks.execution.ray_launch import accelerate_env

    config = "infra/accelerate/deepspeed_zero3.yaml"
    root = with_profiles(tmp_path)
    runtime = RuntimeConfig(device="cpu", num_processes=1, accelerate_config=config)
    probe = root / "probe.py"
    probe.write_text("import json, os\nprint(json.dumps({k: v for k, v in os.environ.items() if k.startswith('ACCELERATE_')}))\n")
    launched = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                               "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", str(probe)],
                              cwd=root, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                              timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    seen = json.loads(launched.stdout.strip().splitlines()[-1])
    ours = accelerate_env(runtime, root)
    assert ours["ACCELERATE_USE_DEEPSPEED"] == "true" and ours["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert {k: v for k, v in seen.items() if k in ours} == ours and set(ours) <= set(seen), (ours, seen)
    assert accelerate_env(RuntimeConfig(device="cpu", num_processes=2), root) == {}, "DDP needs no plugin"


def test_the_cluster_and_its_storage_are_checked_with_one_message_each(monkeypatch, tmp_path):
    from rlhf_core.config import RuntimeConfig
    from tasks.execution.ray_launch import ClusterUnreachable, check_cluster

    for name in ("RAY_ADDRESS", "RLHF_RAY_STORAGE"):
        monkeypatch.delenv(name, raising=False)
    ray = RuntimeConfig(launcher="ray", num_processes=2)
    with pytest.raises(ClusterUnreachable, match="no cluster is named: set runtime.ray_address"):
        check_cluster(ray)
    port = free_port("127.0.0.1")
    with pytest.raises(ClusterUnreachable, match=f"runtime.ray_address 127.0.0.1:{port}: no Ray cluster answers"):
        check_cluster(ray.model_copy(update={"ray_address": f"127.0.0.1:{port}"}))
    with pytest.raises(ClusterUnreachable, match="expected HOST:PORT"):
        check_cluster(ray.model_copy(update={"ray_address": "head-without-port"}))
    import socket

    with socket.socket() as listening:  # something answers: then the storage is checked
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        answering = ray.model_copy(update={"ray_address": f"127.0.0.1:{listening.getsockname()[1]}"})
        with pytest.raises(ClusterUnreachable, match="no shared storage is named"):
            check_cluster(answering)
        with pytest.raises(ClusterUnreachable, match="runtime.ray_storage relative/dir: give an absolute path"):
            check_cluster(answering.model_copy(update={"ray_storage": "relative/dir"}))
        assert check_cluster(answering.model_copy(update={"ray_storage": str(tmp_path)})) == answering.ray_address
    with pytest.raises(ValueError, match="num_machines is for the local launcher"):
        RuntimeConfig(launcher="ray", num_processes=4, num_machines=2)


def test_outputs_land_whole_in_place_of_the_old_ones(tmp_path):
    from tasks.execution.shared_storage import RunFolder, land

    root, incoming = tmp_path / "ws", tmp_path / "incoming"
    (root / "models" / "policy").mkdir(parents=True)
    (root / "models" / "policy" / "stale.bin").write_text("old")
    (root / "metrics").mkdir()
    (root / "metrics" / "train.json").write_text("old")
    source = tmp_path / "rank0"
    (source / "models" / "policy").mkdir(parents=True)
    (source / "models" / "policy" / "model.safetensors").write_bytes(b"\x00new")
    (source / "metrics").mkdir()
    (source / "metrics" / "train.json").write_text("new")
    folder = RunFolder(str(tmp_path / "storage" / "run"))
    folder.put(source, ["models/policy", "metrics/train.json"], under="outputs")
    assert folder.files("outputs") == ["metrics/train.json", "models/policy/model.safetensors"]
    folder.get("outputs", incoming)
    land(incoming, root, ["models/policy", "metrics/train.json", "reports/trace"])  # one not made: left as it was
    assert sorted(p.name for p in (root / "models" / "policy").iterdir()) == ["model.safetensors"]
    assert (root / "metrics" / "train.json").read_text() == "new"
    assert not [p for p in root.rglob(".*")], "no staged or replaced copy left behind"
    folder.remove()
    assert not (tmp_path / "storage" / "run").exists()
