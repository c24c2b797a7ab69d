"""A model stage's ranks on a Ray cluster (`runtime.launcher: ray`): the stage process DVC starts is the driver.

The driver stays where the DVC workspace is. It
1. checks that the cluster answers at `runtime.ray_address` and that `runtime.ray_storage` is usable, before any
   output is touched (`check_cluster`, also `rlhf run`'s preflight);
2. puts the stage's inputs (its dvc.yaml deps that are not code, params.yaml, the profile, the accelerate and
   DeepSpeed configs, a checkpoint to resume from) in a folder of its own on the storage every node shares;
3. runs `runtime.num_processes` ranks as a Ray Train `TorchTrainer` worker group (gloo on CPUs, NCCL on GPUs), the
   code shipped with the job (`py_modules`): each rank copies the inputs to a scratch workspace on its node and runs
   the very stage a torchrun or accelerate rank runs (`tasks.runner.run_stage`, accelerate and DeepSpeed included) on
   the process group Ray set up; each checkpoint the stage completes is reported to Ray Train, every rank its own
   files (a ZeRO shard stays with its rank), so a worker group that lost a rank or a node restarts from it
   (`runtime.ray_max_failures` times);
4. lands rank 0's outputs in the workspace, each whole before it replaces the old one; the stage's MLflow run is the
   driver's alone (the ranks run untracked), and the runner replays train's per-update metrics into it.

A stage that fails for good brings its last checkpoint home (checkpoints/), so the next run, on Ray or not, resumes
from it; Ctrl-C, SIGTERM or a cancel aborts the run through its controller, which stops the workers on every node,
and the last checkpoint comes home too.
Only this module imports Ray, and only a stage whose runtime asks for it imports this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from rlhf_core.config import RuntimeConfig
from tasks.dag.dvc_yaml import CODE_DIRS, entry_paths, stage_entry
from tasks.execution.errors import StageFailed
from tasks.execution.launcher import LAUNCHED_ENV, on_checkpoint, raise_interrupt
from tasks.execution.ray_worker import quiet_the_cleaners_state_api_warning
from tasks.execution.shared_storage import STORAGE_ENV, RunFolder, is_remote, land
from tasks.parameters.params import PROFILES_DIR
from tasks.parameters.paths import Paths

ADDRESS_ENV = "RAY_ADDRESS"
# what the driver's environment decides about a rank's results or its offline-ness (never a credential)
PASSED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM",
              "RLHF_KEEP_FREED_MEMORY")
CONNECT_TIMEOUT_S = 5.0
RANK_RECORDS = "ranks"  # rank-N.json: where each rank of the current attempt runs (node, pid, working directory)


class ClusterUnreachable(ValueError):
    """No Ray cluster answers at the address the run names (a ValueError: the CLI exits 2 with its message)."""


# ------------------------------------------------------------------ the driver

def cluster_address(runtime: RuntimeConfig) -> str:
    address = runtime.ray_address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise ClusterUnreachable("runtime.launcher is 'ray' but no cluster is named: set runtime.ray_address "
                                 f"(HOST:PORT of its head, or ray://HOST:10001) or {ADDRESS_ENV}")
    return address


def storage_uri(runtime: RuntimeConfig) -> str:
    uri = runtime.ray_storage or os.environ.get(STORAGE_ENV)
    if not uri:
        raise ClusterUnreachable("runtime.launcher is 'ray' but no shared storage is named: set runtime.ray_storage "
                                 f"(a path every node mounts, or s3://BUCKET/PREFIX) or {STORAGE_ENV}")
    if not is_remote(uri) and not Path(uri).is_absolute():
        raise ClusterUnreachable(f"runtime.ray_storage {uri}: give an absolute path (the nodes do not share this "
                                 "process's working directory)")
    return uri


def check_cluster(runtime: RuntimeConfig) -> str:
    """The cluster's address, once its head answers and the shared storage can be listed; else ClusterUnreachable
    with one message naming what does not answer. Touches nothing."""
    address = cluster_address(runtime)
    if address not in ("auto", "local"):
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
                pass
        except (OSError, ValueError) as err:
            reason = err.strerror or str(err) if isinstance(err, OSError) else "expected HOST:PORT"
            raise ClusterUnreachable(f"runtime.ray_address {address}: no Ray cluster answers there ({reason}); "
                                     "start one (infra/stack.sh up, or `ray start --head`) or name yours") from None
    uri = storage_uri(runtime)
    try:
        RunFolder(uri).folders()
    except Exception as err:  # noqa: BLE001 (a bad bucket, no credentials, a missing mount: all one message)
        raise ClusterUnreachable(f"runtime.ray_storage {uri}: not usable from here ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0] if str(err) else ''})") from None
    return address


def stage_inputs(root: Path, stage: str, params) -> list[str]:
    """Workspace-relative paths a rank needs: the stage's dvc.yaml deps that are not code, the parameters and their
    profile, the launch configs, and what a resumed run starts from."""
    paths, runtime = Paths.at(root), params.runtime
    deps = [d for d in entry_paths(stage_entry(root, stage), "deps") if Path(d).parts[0] not in CODE_DIRS]
    wanted = ["params.yaml", "dvc.yaml", *deps, f"{PROFILES_DIR}/{params.base.profile}.yaml"]
    if runtime.accelerate_config and not Path(runtime.accelerate_config).is_absolute():
        wanted += _launch_configs(root, runtime.accelerate_config)
    if stage == "train":  # a checkpoint of these inputs resumes on the cluster as it does here
        wanted += [_relative(paths.checkpoints, root), _relative(paths.train_log, root)]
    return [p for p in dict.fromkeys(wanted) if (root / p).exists()]


def stage_outputs(root: Path, stage: str) -> list[str]:
    """What rank 0 brings back: the stage's dvc.yaml outputs, its execution figures and, for train, the log."""
    paths = Paths.at(root)
    outs = entry_paths(stage_entry(root, stage), "outs", "metrics", "plots")
    extra = [_relative(paths.execution_file(stage), root)]
    if stage == "train":
        extra.append(_relative(paths.train_log, root))
    return list(dict.fromkeys([*outs, *extra]))


def resume_state(root: Path, stage: str) -> list[str]:
    """What a failed stage brings home from its last checkpoint so that the next run resumes."""
    paths = Paths.at(root)
    return [_relative(paths.checkpoints, root), _relative(paths.train_log, root)] if stage == "train" else []


def _relative(path: Path, root: Path) -> str:
    return str(path.relative_to(root.resolve()))


def _launch_configs(root: Path, config: str) -> list[str]:
    """The accelerate config and the DeepSpeed JSON it names (relative to it)."""
    import yaml

    found = [config]
    with contextlib.suppress(OSError, yaml.YAMLError):
        launch = yaml.safe_load((root / config).read_text()) or {}
        ds_file = (launch.get("deepspeed_config") or {}).get("deepspeed_config_file")
        if ds_file and not Path(ds_file).is_absolute():
            found.append(str(Path(config).parent / ds_file))
    return found


def accelerate_env(runtime: RuntimeConfig, root: Path) -> dict[str, str]:
    """The ACCELERATE_* variables `accelerate launch` would give each rank for this runtime (the DeepSpeed plugin, the
    precision), computed by accelerate itself; a plain DDP launch needs none."""
    if runtime.accelerate_config is None:
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args([
        "--config_file", str(root / runtime.accelerate_config), "--num_processes", str(runtime.num_processes),
        "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", runtime.mixed_precision,
        "--no_python", "rlhf"])
    args, defaults, precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join([*fields, *(["mixed_precision"] if precision_from_config
                                                                           else [])])
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        env = {}
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}


def run_stage_on_ray(name: str, root: Path, params, profile: str | None, overrides: list[str],
                     run_rank: Callable[..., dict]) -> dict:
    """Run stage `name`'s ranks on the cluster, each through `run_rank(name, root, profile, overrides)` (the runner's
    `run_stage`, handed down: a room of tasks/ never imports it); returns rank 0's metrics once its outputs are in
    the workspace."""
    runtime = params.runtime
    root = Path(root).resolve()
    address = check_cluster(runtime)
    run_id = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    storage = storage_uri(runtime)
    folder = RunFolder(f"{storage}/{run_id}")  # this stage's inputs, rank records, outputs
    ray_folder = RunFolder(f"{storage}/{run_id}-ray")  # Ray Train's own records and checkpoints of this run
    import ray

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_interrupt) if on_main_thread else None  # SIGTERM unwinds as Ctrl-C
    try:
        folder.put(root, stage_inputs(root, name, params), under="inputs")
        context = _connect(ray, address)
        use_gpu = _uses_gpus(ray, runtime)
        env = {LAUNCHED_ENV: "1", "RLHF_TRACKING": "off",  # rank 0 writes outputs; the driver's MLflow run takes the rest
               "RLHF_THREADS": str(max(1, int(runtime.ray_cpus_per_worker))),
               **({} if use_gpu else {"DS_ACCELERATOR": "cpu"}),
               **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}, **accelerate_env(runtime, root)}
        config = {"stage": name, "profile": profile, "overrides": list(overrides), "run_folder": folder.uri,
                  "env": env, "outputs": stage_outputs(root, name), "run_rank": run_rank}
        dashboard = getattr(context, "dashboard_url", None)
        print(f"stage {name}: {runtime.num_processes} rank(s) on the Ray cluster at {address}"
              + (f" (dashboard: http://{dashboard})" if dashboard else "") + f"; storage {folder.uri}",
              file=sys.stderr, flush=True)
        try:
            error = _fit(config, runtime, storage, run_id, use_gpu)
        except BaseException:  # Ctrl-C, a cancel: the workers stop with the driver, the last checkpoint comes home
            ray.shutdown()
            with contextlib.suppress(Exception):
                _bring_home_resume_state(root, name, ray_folder)
            raise
        ranks = _rank_records(folder)
        if error is not None:
            kept = _bring_home_resume_state(root, name, ray_folder)
            raise StageFailed(f"stage {name} failed on the Ray cluster at {address}: {_who_failed(ranks, error)}; "
                              + (f"checkpoint {kept} kept in {_relative(Paths.at(root).checkpoints, root)}: run the "
                                 "stage again to resume from it" if kept else "no checkpoint was kept"))
        metrics = folder.read_json("result/metrics.json")
        if metrics is None:
            raise StageFailed(f"stage {name} on the Ray cluster at {address} ended without rank 0's result "
                              f"({folder.uri}/result/metrics.json)")
        with tempfile.TemporaryDirectory(prefix=f".rlhf-{name}-", dir=root) as incoming:
            folder.get("outputs", Path(incoming))
            land(Path(incoming), root, config["outputs"])
        return {**metrics, "ray": {"address": address, "ranks": ranks}}
    finally:
        ray.shutdown()  # the job ends with its driver: Ray stops every worker it started, on every node
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
        for leftover in (folder, ray_folder):
            with contextlib.suppress(Exception):  # storage gone too: nothing more to lose
                leftover.remove()


def _uses_gpus(ray, runtime: RuntimeConfig) -> bool:
    """Whether each rank reserves GPUs: as runtime.ray_gpus_per_worker says, else when the device is CUDA, or 'auto'
    on a cluster that has GPUs."""
    if runtime.ray_gpus_per_worker is not None:
        return runtime.ray_gpus_per_worker > 0
    if runtime.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return runtime.device == "cuda"


def _connect(ray, address: str):
    """Join the cluster as a driver, the rank code shipped with the job (`py_modules`: the driver's own, whatever the
    nodes have installed), each of the job's worker processes first running ray_worker's hook."""
    import rlhf_core
    import tasks

    modules = [str(Path(module.__file__).parent) for module in (rlhf_core, tasks)]  # what a rank imports
    setup = f"{quiet_the_cleaners_state_api_warning.__module__}.{quiet_the_cleaners_state_api_warning.__name__}"
    return ray.init(address=address, logging_level=logging.WARNING, configure_logging=True,
                    runtime_env={"py_modules": modules, "excludes": ["__pycache__", "*.pyc"],
                                 "worker_process_setup_hook": setup},
                    **({"_node_ip_address": _node_ip()} if not address.startswith("ray://") and _node_ip() else {}))


def _node_ip() -> str | None:
    """RAY_NODE_IP_ADDRESS: the address this machine's node joined the cluster with when it is not the one Ray would
    pick (a cluster on loopback: 127.0.0.2), which the driver must give to find its node."""
    return os.environ.get("RAY_NODE_IP_ADDRESS")


def _fit(config: dict, runtime: RuntimeConfig, storage: str, run_id: str, use_gpu: bool):
    """The worker group's run: None when it finished, else the error that ended it (after the restarts allowed)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    resources = {"CPU": runtime.ray_cpus_per_worker}
    if use_gpu:
        resources["GPU"] = runtime.ray_gpus_per_worker or 1
    trainer = _stage_trainer()(
        rank_main, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=runtime.num_processes, use_gpu=use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name=f"{run_id}-ray", storage_path=storage,
                             failure_config=FailureConfig(max_failures=runtime.ray_max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    try:
        trainer.fit()
    except KeyboardInterrupt:  # Ctrl-C, a cancel, SIGTERM: the run's controller stops its workers everywhere
        trainer.abort()
        raise
    except Exception as err:  # noqa: BLE001 (Ray's TrainingFailedError and what it wraps)
        return err
    finally:
        trainer.end_controller()
    return None


def _stage_trainer():
    """Ray Train's TorchTrainer, leaving SIGINT to the stage. On the main thread TorchTrainer.fit installs a handler
    that aborts the run and exits the process (0 or 1, whatever the stage was doing); this one only keeps the run's
    controller, and the stage aborts it on its own KeyboardInterrupt, as every stage stops. Aborting matters beyond
    the driver's exit: the controller's helpers (a detached placement-group cleaner) outlive a driver that just
    leaves, and without the dashboard's state API the cleaner never learns that the run is gone. Once the run is over
    its controller is killed, not left to the handle's release: a graceful actor exit can hang in the interpreter's
    teardown and leave the process alive, marked dead (ray-project/ray#59872, fixed there for the workers only; a
    make test run found an idle TrainController of an earlier stage minutes later)."""
    import ray
    from ray.train.torch import TorchTrainer

    class StageTrainer(TorchTrainer):
        controller = None

        def _register_sigint_handler(self, controller) -> None:
            self.controller = controller

        def abort(self, timeout_s: float = 60) -> None:
            if self.controller is not None:
                with contextlib.suppress(Exception):  # an already dead controller has nothing left to stop
                    ray.get(self.controller.abort.remote(), timeout=timeout_s)

        def end_controller(self) -> None:
            if self.controller is not None:
                with contextlib.suppress(Exception):  # gone already: nothing to end
                    ray.kill(self.controller, no_restart=True)
                self.controller = None

    return StageTrainer


def _bring_home_resume_state(root: Path, name: str, ray_folder: RunFolder) -> str | None:
    """Copy the newest checkpoint Ray Train kept into the workspace (checkpoints/, the train log); its name."""
    wanted = resume_state(root, name)
    newest = registered_checkpoint(ray_folder) if wanted else None
    if newest is None:
        return None
    with tempfile.TemporaryDirectory(prefix=f".rlhf-{name}-", dir=root) as incoming:
        ray_folder.get(newest, Path(incoming))
        land(Path(incoming), root, wanted)
    return newest.removeprefix("checkpoint-")


def registered_checkpoint(ray_folder: RunFolder) -> str | None:
    """The folder name of the newest checkpoint Ray Train registered: every rank reported it, so it is whole. A
    folder still being written when a rank died is on the storage too, and is not one; nor is any before the
    first registration (what a restarted worker group resumes from is this one)."""
    from ray.train import Result

    try:
        checkpoint = Result.from_path(ray_folder.uri).checkpoint
    except RuntimeError:  # no run folder, or no checkpoint manager's snapshot in it yet
        return None
    return PurePosixPath(checkpoint.path).name if checkpoint is not None else None


def _rank_records(folder: RunFolder) -> list[dict]:
    """Where each rank of the last attempt ran: rank, node, pid, working directory (rank_main writes them)."""
    records = (folder.read_json(f"{RANK_RECORDS}/{name}") for name in folder.files(RANK_RECORDS))
    return sorted((r for r in records if r), key=lambda r: r["rank"])


def _who_failed(ranks: list[dict], error: Exception) -> str:
    """The error in one line, with the rank and node it came from where Ray says."""
    text = " ".join(str(error).split())
    by_rank = {r["rank"]: r for r in ranks}
    failures = getattr(error, "worker_failures", None) or {}
    where = [f"rank {rank} on node {by_rank[rank]['node_ip']} ({by_rank[rank]['node_id'][:12]})"
             for rank in sorted(failures) if rank in by_rank]
    return (", ".join(where) + ": " if where else "") + (text[:600] + " ..." if len(text) > 600 else text)


# ------------------------------------------------------------------ a rank, on a worker of the cluster

def rank_main(config: dict) -> None:
    """One rank of the stage (Ray Train's train_loop_per_worker): a scratch workspace on this node holding the
    inputs (and the checkpoint a restarted group resumes from), the stage run there as a launched rank runs it, and
    rank 0's outputs put back on the shared storage."""
    import ray.train

    context = ray.train.get_context()
    rank = context.get_world_rank()
    folder = RunFolder(config["run_folder"])
    scratch = Path(tempfile.mkdtemp(prefix=f"rlhf-{config['stage']}-rank{rank}-"))
    folder.write_json(f"{RANK_RECORDS}/rank-{rank}.json", {
        "rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(), "pid": os.getpid(), "cwd": os.getcwd(), "scratch": str(scratch)})
    previous_cwd = os.getcwd()
    try:
        folder.get("inputs", scratch)
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:  # a restarted worker group: every rank resumes from the last reported checkpoint
            with checkpoint.as_directory() as saved:
                shutil.copytree(saved, scratch, dirs_exist_ok=True)
        os.environ.update(config["env"])
        os.chdir(scratch)
        with on_checkpoint(lambda path: _report_checkpoint(scratch, path, rank)):
            metrics = config["run_rank"](config["stage"], scratch, config["profile"], config["overrides"])
        if rank == 0:
            folder.put(scratch, [p for p in config["outputs"] if (scratch / p).exists()], under="outputs")
            folder.write_json("result/metrics.json", metrics)
    finally:
        os.chdir(previous_cwd)
        shutil.rmtree(scratch, ignore_errors=True)


def _report_checkpoint(scratch: Path, checkpoint: Path, rank: int) -> None:
    """Hand this rank's files of a complete checkpoint to Ray Train, which merges every rank's into one folder on the
    shared storage; rank 0 adds what resuming reads beside it (the inputs' fingerprint, the traces, the train log).
    Every rank calls it at the same point: Ray's report is a barrier."""
    import ray.train

    paths = Paths.at(scratch)
    with tempfile.TemporaryDirectory(prefix="rlhf-checkpoint-") as staging:
        staged = Path(staging)
        own = [_relative(checkpoint, scratch)]
        if rank == 0:
            own += [_relative(p, scratch) for p in (paths.checkpoints / "inputs.sha256", paths.checkpoints / "trace",
                                                    paths.train_log) if p.exists()]
        for relative in own:
            source, target = scratch / relative, staged / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, copy_function=os.link)
            else:
                os.link(source, target)
        ray.train.report({"update": int(checkpoint.name.split("-")[-1])},
                         checkpoint=ray.train.Checkpoint.from_directory(staging),
                         checkpoint_dir_name=f"checkpoint-{checkpoint.name}")
