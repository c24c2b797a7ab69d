"""Run one stage by name in a workspace: params loaded and validated once, the stage inside its MLflow run, its
outputs guarded (a run that does not finish puts back the last good ones: tasks/execution/put_back.py).

`rlhf stage NAME` (what dvc.yaml calls) comes here.
"""

from __future__ import annotations

import atexit
import difflib
import importlib
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from rlhf_core.threads import fit_threads
from tasks.dag.dvc_yaml import missing_inputs
from tasks.dag.stage_modules import STAGES
from tasks.execution.errors import StageFailed
from tasks.execution.figures import write_execution
from tasks.execution.launcher import LAUNCHED_ENV, MODEL_STAGES, is_main_process
from tasks.execution.put_back import guarded_outputs
from tasks.parameters.params import load_params
from tasks.parameters.paths import Paths
from tasks.tracking.stage_tracking import log_history, track_stage


class UnknownStage(ValueError):
    """A stage name dvc.yaml does not have; the message lists the stages and the closest one."""


def check_stage_name(name: str) -> None:
    if name not in STAGES:
        close = difflib.get_close_matches(name, STAGES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownStage(f"unknown stage {name!r}{hint}; stages: {', '.join(STAGES)}")


def run_stage(name: str, root: str | Path = ".", profile: str | None = None, overrides: Sequence[str] = ()) -> dict:
    check_stage_name(name)
    # the process that writes the outputs guards them, from before params load (DVC has deleted them by now). Rank 0
    # of a torchrun/accelerate launch keeps SIGTERM's default: its launcher sends it to stop the ranks, and a rank
    # blocked in a collective would not unwind before the launcher's SIGKILL; its put-back is finished after it.
    guard = guarded_outputs(name, root, sigterm=not os.environ.get(LAUNCHED_ENV))
    with guard if is_main_process() else nullcontext():
        return _run(name, root, profile, overrides)


def _run(name: str, root: str | Path, profile: str | None, overrides: Sequence[str]) -> dict:
    if missing := missing_inputs(root, name):  # a message naming them and their stages, not a traceback
        raise StageFailed(f"stage {name}: its input{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                          f"{'are' if len(missing) > 1 else 'is'} missing; `dvc repro {name}` runs what makes "
                          f"{'them' if len(missing) > 1 else 'it'} first (or `rlhf stage` that stage)")
    threads = fit_threads()  # before any torch work: this stage's share of the cores (rlhf_core/threads.py)
    params = load_params(root, profile, list(overrides))
    if on_ray(params.runtime, name):  # this process is the driver; the ranks run this function on the cluster
        from tasks.execution.ray_launch import run_stage_on_ray

        def stage_run(params, paths) -> dict:
            metrics = run_stage_on_ray(name, paths.root, params, profile, list(overrides), run_rank=run_stage)
            if name == "train":  # its ranks ran untracked: every update's figures go to this process's MLflow run
                log_history(paths.train_log)
            return metrics
    else:
        stage_run = importlib.import_module(STAGES[name]).run

    def work() -> dict:
        start = time.perf_counter()
        paths = Paths.at(root)
        metrics = {**stage_run(params, paths), "stage_seconds": time.perf_counter() - start, "threads": threads}
        if is_main_process():  # seconds and the like: printed, in MLflow, in reports/execution/, never in DVC's outputs
            write_execution(paths, name, metrics)
        return metrics

    if not is_main_process():  # a launched stage's other ranks: rank 0 alone tracks (and writes)
        metrics = work()
    else:
        metrics = track_stage(name, root, params, work, overrides)  # an MLflow run per stage, unless RLHF_TRACKING=off
    leave_process_group()
    return metrics


def on_ray(runtime, name: str) -> bool:
    """Whether this process drives stage `name`'s ranks on a Ray cluster (and is not one of them)."""
    return runtime.launcher == "ray" and name in MODEL_STAGES and not os.environ.get(LAUNCHED_ENV)


def leave_process_group() -> None:
    """A launched rank's last act after a finished stage: tear its process group down while Python still runs.
    Left to the interpreter's exit, the threads of the gloo group (and DeepSpeed's on top of it) could outlive
    it and abort a rank that had finished ("terminate called without an active exception": one run in three of
    the 2-process ZeRO-3 test). A no-op outside a launch, where a caller may own the group."""
    dist = sys.modules.get("torch.distributed")  # a stage that never imported torch has no group
    if os.environ.get(LAUNCHED_ENV) == "1" and dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank leaves while another may still be taking in a last collective's data
        dist.destroy_process_group()


def end_launched_rank() -> None:
    """Leave a launched rank whose stage succeeded without the interpreter's teardown. The group is gone, but the
    C++ objects of gloo and DeepSpeed (and their threads) live on in Python references until the interpreter frees
    them in no set order, and one exit in a few hundred still aborted there (CI, 2026-11-27, ZeRO-3 + LoRA: rank 1
    SIGABRT after its last update). The stage's files and its MLflow run are closed by now: what is left is the
    exit handlers (logging's flush, the thread registry's entry) and the buffers."""
    if os.environ.get(LAUNCHED_ENV) != "1":
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
