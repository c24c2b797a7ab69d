"""Threads that fit the machine (rlhf_core/threads.py): each torch process takes cores // processes side by side,
the count multiplies down the process tree, depends on no neighbour unless the user asks it to adapt
(RLHF_THREADS=auto), and a user's fixed count wins everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.config import RuntimeConfig
from rlhf_core.threads import (
    PROCESSES_ENV,
    THREADS_ENV,
    env_for_children,
    planned_threads,
    threads_per_process,
    usable_cores,
)
from tasks.execution.launcher import run_launched

# a child that reports the threads it would take and the torch count it set
REPORT = ("import json, os, sys, torch; from rlhf_core.threads import fit_threads; "
          "n = fit_threads(); json.dump({'fit': n, 'torch': torch.get_num_threads(), "
          "'processes': os.environ.get('RLHF_TORCH_PROCESSES'), 'omp': os.environ.get('OMP_NUM_THREADS')}, "
          "open(sys.argv[1] + '.' + os.environ.get('RANK', '0'), 'w'))")


def bare(env: dict[str, str] | None = None, tmp: Path | None = None) -> dict[str, str]:
    """The environment of a process nobody told anything: none of the thread variables, and with `tmp` a
    registry of its own (TMPDIR), apart from the test workers'."""
    clean = {k: v for k, v in os.environ.items() if k not in (PROCESSES_ENV, THREADS_ENV, "OMP_NUM_THREADS")}
    return {**clean, **({"TMPDIR": str(tmp)} if tmp else {}), **(env or {})}


@pytest.mark.parametrize("cores, processes, expected", [(2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 2, 8), (16, 3, 5),
                                                        (1, 4, 1), (8, 0, 8)])
def test_each_process_takes_its_share_and_never_less_than_one(cores, processes, expected):
    assert threads_per_process(cores, processes) == expected


def test_the_share_multiplies_down_the_process_tree():
    top = bare()
    assert planned_threads(top, cores=16) == 16
    workers = env_for_children(2, top)  # make test's two workers
    assert workers[PROCESSES_ENV] == "2" and planned_threads(workers, cores=16) == 8
    ranks = env_for_children(2, workers)  # a worker's test launches a 2-rank stage
    assert ranks[PROCESSES_ENV] == "4" and planned_threads(ranks, cores=16) == 4
    assert ranks["OMP_NUM_THREADS"] == str(planned_threads(ranks)), "OpenMP outside torch gets the same share"


def test_a_users_count_wins_over_the_share_all_the_way_down():
    fixed = env_for_children(4, bare({THREADS_ENV: "3"}))
    assert planned_threads(fixed, cores=16) == 3 and planned_threads(env_for_children(2, fixed), cores=16) == 3
    # OMP_NUM_THREADS set above us is the user's choice; the one we set for a child is only its share
    users_omp = bare({"OMP_NUM_THREADS": "5"})
    assert planned_threads(users_omp, cores=16) == 5
    child = env_for_children(2, users_omp)
    assert child[THREADS_ENV] == "5" and planned_threads(child, cores=16) == 5
    assert planned_threads(bare({PROCESSES_ENV: "2", "OMP_NUM_THREADS": "7"}), cores=16) == 8


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_count_names_the_variable(value):
    with pytest.raises(ValueError, match=f"{THREADS_ENV}={value!r}: expected a whole number of at least 1 or 'auto'"):
        planned_threads(bare({THREADS_ENV: value}))


def test_adapting_is_carried_down_the_tree():
    ranks = env_for_children(2, bare({THREADS_ENV: "auto"}))
    assert ranks[THREADS_ENV] == "auto" and planned_threads(ranks, cores=16) == 8


@pytest.mark.skipif(usable_cores() < 2, reason="one core: every share is one thread")
def test_launched_ranks_take_their_share_of_the_cores(tmp_path, monkeypatch):
    """The launcher's ranks (here: torchrun's, as a CPU launch runs them) each set cores // ranks threads, where
    torchrun alone gives every rank one thread and a bare torch takes every core."""
    for key in (PROCESSES_ENV, THREADS_ENV, "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a registry apart from the test workers'
    processes = 2
    out = tmp_path / "threads"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               "--no-python", sys.executable, "-c", REPORT, str(out)]
    assert run_launched(command, RuntimeConfig(num_processes=processes, device="cpu")) == 0
    reports = [json.loads(out.with_name(f"threads.{rank}").read_text()) for rank in range(processes)]
    share = max(1, usable_cores() // processes)
    assert all(r["fit"] == r["torch"] == share and r["processes"] == str(processes) for r in reports), reports


def test_a_stage_process_fits_its_threads_before_torch_work(tmp_path):
    """What `rlhf stage` and `rlhf bench` call first: a bare process takes every usable core; one told it shares
    the machine with another takes half."""
    runs = {}
    for name, env in (("alone", bare(tmp=tmp_path)), ("beside", env_for_children(2, bare(tmp=tmp_path)))):
        subprocess.run([sys.executable, "-c", REPORT, str(tmp_path / name)], env=env, check=True)
        runs[name] = json.loads((tmp_path / f"{name}.0").read_text())
    assert runs["alone"]["torch"] == usable_cores()
    assert runs["beside"]["torch"] == max(1, usable_cores() // 2)


WAIT_FOR = "[time.sleep(0.05) for _ in range(600) if not pathlib.Path({}).exists()]"


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="one core: every share is one thread")
def test_by_default_a_neighbour_changes_nothing_so_a_rerun_gives_the_same_bytes(tmp_path):
    """A pipeline started beside another one a user runs takes the same count as alone (the count changes the
    numbers); with RLHF_THREADS=auto it takes half, and so does `rlhf bench`, which adapts always."""
    neighbour = subprocess.Popen([sys.executable, "-c", "; ".join([
        "import time, pathlib; from rlhf_core import threads", "threads.fit_threads()",
        f"pathlib.Path({str(tmp_path / 'ready')!r}).touch()", "time.sleep(60)"])], env=bare(tmp=tmp_path))
    try:
        for _ in range(600):
            if (tmp_path / "ready").exists():
                break
            time.sleep(0.05)
        runs = {}
        for name, env in (("default", bare(tmp=tmp_path)), ("auto", bare({THREADS_ENV: "auto"}, tmp=tmp_path))):
            subprocess.run([sys.executable, "-c", REPORT, str(tmp_path / name)], env=env, check=True)
            runs[name] = json.loads((tmp_path / f"{name}.0").read_text())["torch"]
        bench = subprocess.run([str(Path(sys.executable).parent / "rlhf"), "bench", "--updates", "1", "--json"],
                               env=bare(tmp=tmp_path), capture_output=True, text=True, check=True, timeout=600)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert runs == {"default": usable_cores(), "auto": max(1, usable_cores() // 2)}
    assert json.loads(bench.stdout)["threads"] == max(1, usable_cores() // 2), bench.stdout


@pytest.mark.skipif(usable_cores() < 2, reason="one core: every share is one thread")
def test_processes_started_apart_find_each_other_and_share_the_cores(tmp_path):
    """Two benches or pipelines a user starts apart with RLHF_THREADS=auto declare nothing: the first takes every
    core while alone and halves at its next refit once the second runs; the second starts at half; once the
    second has exited the first takes every core again."""
    started, refit, exited = tmp_path / "second-started", tmp_path / "first-refit", tmp_path / "second-exited"

    def refit_now() -> str:
        return "threads._last_fit -= threads.REFIT_EVERY_S; threads.refit_threads(); seen.append(torch.get_num_threads())"

    first_script = "; ".join([
        "import json, sys, time, pathlib, torch; from rlhf_core import threads", "seen = [threads.fit_threads()]",
        WAIT_FOR.format(repr(str(started))), refit_now(), f"pathlib.Path({str(refit)!r}).touch()",
        WAIT_FOR.format(repr(str(exited))), refit_now(), "print(json.dumps(seen))"])
    second_script = "; ".join([
        "import json, time, pathlib; from rlhf_core import threads", "n = threads.fit_threads()",
        f"pathlib.Path({str(started)!r}).touch()", WAIT_FOR.format(repr(str(refit))), "print(json.dumps(n))"])
    env = bare({THREADS_ENV: "auto"}, tmp=tmp_path)
    first = subprocess.Popen([sys.executable, "-c", first_script], env=env, stdout=subprocess.PIPE, text=True)
    for _ in range(600):  # the first has registered
        if any(p.name.isdigit() for p in (tmp_path / f"rlhf-torch-{os.getuid()}").glob("*")):
            break
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-c", second_script], env=env, capture_output=True, text=True,
                            check=True, timeout=60)
    exited.touch()
    seen = json.loads(first.communicate(timeout=60)[0])
    cores, half = usable_cores(), max(1, usable_cores() // 2)
    assert json.loads(second.stdout) == half, "the second started beside the first"
    assert seen == [cores, half, cores], "alone, beside the second, alone again"
