"""Several processes for one stage: `rlhf stage NAME` re-executes itself under a launcher, so DVC and Prefect
keep calling one command whatever the hardware.

- `runtime.num_processes > 1` on the CPU: `torchrun --standalone` (a gloo world; `accelerate launch --cpu`
  starts one process only).
- on GPUs, or with `runtime.accelerate_config` (multi-GPU, DeepSpeed ZeRO-2/3, several machines):
  `accelerate launch --config_file ... --num_processes N --num_machines M`.

The launched ranks see RLHF_LAUNCHED=1 and never relaunch. Only rank 0 writes files, metrics and the MLflow
run (`is_main_process`). The launcher runs in its own process group: when it fails, is interrupted or
terminated, every rank goes with it, and its exit status is the stage's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.config import RuntimeConfig
from rlhf_core.threads import env_for_children

LAUNCHED_ENV = "RLHF_LAUNCHED"
# the stages that run a model, all under the runtime's launch: sft, reward-model and train train on every rank;
# inspect and evaluate run on rank 0 (they record the launch they ran under, and prove it works before train)
MODEL_STAGES = ("sft", "reward-model", "inspect", "train", "evaluate")
GRACE_S = 30  # after SIGTERM, how long the ranks get to exit before SIGKILL
BUSY_LIMIT_S = 3600  # the longest stop_group waits for a put-back before SIGKILL (a 1 GiB one takes seconds)
BUSY_EXIT_S = 30  # after a put-back, the time a stopped stage (and DVC) gets to exit before SIGKILL


_checkpoint_listeners: list[Callable[[Path], None]] = []


@contextmanager
def on_checkpoint(listener: Callable[[Path], None]) -> Iterator[None]:
    """Inside the block, call `listener(checkpoint_dir)` on this rank after each checkpoint the stage completes (the
    Ray launcher persists it to the cluster's storage: tasks/execution/ray_launch.py)."""
    _checkpoint_listeners.append(listener)
    try:
        yield
    finally:
        _checkpoint_listeners.remove(listener)


def checkpoint_saved(path: Path) -> None:
    """What a stage calls on every rank once a checkpoint is complete."""
    for listener in _checkpoint_listeners:
        listener(path)


def is_main_process() -> bool:
    """Rank 0 of a launched stage, or the only process of a plain one (torchrun and accelerate set RANK)."""
    return int(os.environ.get("RANK", "0")) == 0


def launch_command(runtime: RuntimeConfig, stage: str, stage_args: list[str]) -> list[str] | None:
    """The command that runs `rlhf stage <stage> <stage_args>` on runtime.num_processes processes, or None
    when the stage runs in this process (one process, no accelerate config, a stage that runs no model, already
    launched, or on Ray: this process drives the ranks on the cluster, tasks/runner.py)."""
    if not runtime.launched or stage not in MODEL_STAGES or os.environ.get(LAUNCHED_ENV) or runtime.launcher == "ray":
        return None
    from rlhf_core.runtime import check, device_of  # torch + accelerate: only when launching

    check(runtime)  # a missing config file or an impossible precision fails here, before any rank starts
    rlhf = str(Path(sys.executable).parent / "rlhf")
    command = [rlhf, "stage", stage, *stage_args]
    if runtime.accelerate_config is None and device_of(runtime) == "cpu":
        if runtime.num_machines > 1:
            raise ValueError("runtime.num_machines > 1 needs runtime.accelerate_config (machine rank, main "
                             "process address); see infra/accelerate/README.md")
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(runtime.num_processes), "--no-python", *command]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(runtime.num_processes),
              "--num_machines", str(runtime.num_machines)]
    if runtime.accelerate_config is not None:
        launch += ["--config_file", runtime.accelerate_config]
    if runtime.num_machines == 1:  # the configs' fixed 29500 would meet another launch on this machine
        launch += ["--main_process_port", str(free_port())]
    launch += ["--mixed_precision", runtime.mixed_precision]  # params are the truth, over the config file
    return [*launch, "--no_python", *command]


def free_port() -> int:
    """A TCP port free on this machine now, for a one-machine launch's rendezvous (as torchrun --standalone picks)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_launched(command: list[str], runtime: RuntimeConfig) -> int:
    """Run the launcher in its own process group and return its exit status; on an interrupt or SIGTERM,
    terminate the whole group (no orphan rank), then re-raise."""
    from rlhf_core.runtime import device_of

    # the ranks share this machine's cores: each takes its share (torchrun alone would give each one thread)
    env = {**env_for_children(runtime.num_processes), LAUNCHED_ENV: "1"}
    if device_of(runtime) == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on the CPU (a test, a laptop) must not probe for CUDA
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        stop_group(proc, [(signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5)])
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def raise_interrupt(signum, frame) -> None:
    """A SIGTERM handler that unwinds as a Ctrl-C does, so `finally` blocks and `except BaseException` run."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stop_group(proc: subprocess.Popen, steps: Sequence[tuple[signal.Signals, float]],
               busy: Callable[[], bool] | None = None, busy_limit_s: float = BUSY_LIMIT_S) -> None:
    """Signal `proc`'s whole process group with each (signal, seconds to wait) of `steps` in turn, until it exits.
    No SIGKILL while `busy()` says the group does what must not be cut (a stage putting its outputs back:
    tasks/execution/put_back.py): it waits for that to end, up to `busy_limit_s`."""
    for sig, wait_s in steps:
        if sig == signal.SIGKILL and busy is not None and _waited_out(proc, busy, busy_limit_s):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _waited_out(proc: subprocess.Popen, busy: Callable[[], bool], limit_s: float) -> bool:
    """Wait while `busy()`, up to `limit_s`, then the time it takes to exit after it (BUSY_EXIT_S); whether it
    exited."""
    give_up, was_busy = time.monotonic() + limit_s, False
    while busy() and time.monotonic() < give_up:
        was_busy = True
        try:
            proc.wait(timeout=0.5)
            return True
        except subprocess.TimeoutExpired:
            continue
    try:
        proc.wait(timeout=BUSY_EXIT_S if was_busy else 0)
        return True
    except subprocess.TimeoutExpired:
        return False
