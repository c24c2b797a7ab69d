"""Intra-op threads that fit the machine: each torch process takes its share of the cores it may use.

torch starts as many intra-op threads as the machine has cores, whatever else runs. Two such processes on two
cores then fight over them: `rlhf bench` ran at 23.4 episodes/s alone and 6.7 each with another beside it
(x0.57 together), but 15.5 each with one thread apiece (x1.32). So each process takes cores // processes, where
processes is what its starters declared in `RLHF_TORCH_PROCESSES`, which multiplies down the process tree (the
launcher its ranks, `make test` its workers, a sweep its concurrent points).

The thread count changes a run's numbers (the sums split across threads round differently: a tiny model's
weights differ by ~1e-6 after 20 steps on 1 thread and on 2), so by default it depends on nothing but the machine
and the command: `dvc repro` gives the same bytes whatever else runs. `RLHF_THREADS=auto` trades that for
speed beside neighbours started apart (two pipelines a user runs at once): the process then also counts the
processes of this project running torch now, each registered under `$TMPDIR/rlhf-torch-<uid>/` while it lives,
and recounts at each `refit_threads()` (the training loops call it). `rlhf bench`, which measures speed and
writes no result, always adapts. `RLHF_THREADS=N` (or `OMP_NUM_THREADS` set by the user at the top) fixes the
count for the whole tree.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

PROCESSES_ENV = "RLHF_TORCH_PROCESSES"  # torch processes sharing this machine's cores at once, this one included
THREADS_ENV = "RLHF_THREADS"  # a user's fixed thread count per process, or "auto": adapt to the neighbours
ADAPT = "auto"
REFIT_EVERY_S = 2.0  # how often a running loop recounts its neighbours (a directory listing: ~0.1 ms)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container or `taskset` limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_process(cores: int, processes: int) -> int:
    """cores // processes, at least one: never more busy threads than cores."""
    return max(1, cores // max(1, processes))


def _positive_int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"environment variable {key}={value!r}: expected a whole number of at least 1"
                         + (f" or {ADAPT!r}" if key == THREADS_ENV else ""))
    return number


def processes_sharing(env: Mapping[str, str] = os.environ) -> int:
    """How many torch processes its starters said share the cores with this one (1 when nobody said)."""
    return _positive_int(env, PROCESSES_ENV) or 1


def adapts(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the user chose RLHF_THREADS=auto: a share among the processes running now, not a fixed one."""
    return env.get(THREADS_ENV, "").strip().lower() == ADAPT


def user_threads(env: Mapping[str, str] = os.environ) -> int | None:
    """The thread count a user fixed: RLHF_THREADS, or OMP_NUM_THREADS set above any process of ours (one we
    started carries RLHF_TORCH_PROCESSES, and the OMP_NUM_THREADS we gave it is our share, not a choice)."""
    if adapts(env):
        return None
    fixed = _positive_int(env, THREADS_ENV)
    if fixed is None and PROCESSES_ENV not in env:
        fixed = _positive_int(env, "OMP_NUM_THREADS")
    return fixed


def planned_threads(env: Mapping[str, str] = os.environ, cores: int | None = None, running: int = 1) -> int:
    """This process's intra-op threads: the user's count, else its share of the usable cores among the larger of
    the declared and the `running` processes."""
    fixed = user_threads(env)
    if fixed is not None:
        return fixed
    return threads_per_process(usable_cores() if cores is None else cores, max(processes_sharing(env), running))


# ---------------------------------------------------------------- the processes running torch on this machine

def registry() -> Path:
    return Path(tempfile.gettempdir()) / f"rlhf-torch-{os.getuid()}"


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (Linux), so that a reused pid is not taken for ours."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str) -> bool:
    if Path("/proc").is_dir():
        return _start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register_this_process() -> None:
    """Enter this process in the registry until it exits (idempotent)."""
    entry = registry() / str(os.getpid())
    if entry.exists():
        return
    entry.parent.mkdir(mode=0o700, exist_ok=True)
    entry.write_text(_start_time(os.getpid()) or "")
    atexit.register(entry.unlink, missing_ok=True)


def running_processes() -> int:
    """The registered processes alive now (this one included if registered); dead entries are removed."""
    alive = 0
    try:
        entries = list(registry().iterdir())
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            if entry.name.isdigit() and _alive(int(entry.name), entry.read_text()):
                alive += 1
            else:
                entry.unlink(missing_ok=True)
        except OSError:  # another process removed it meanwhile
            continue
    return alive


# ---------------------------------------------------------------- what processes call

_last_fit = 0.0  # when an adapting process last counted its neighbours; 0: it does not adapt


def fit_threads(adapt: bool = False) -> int:
    """Set this process's intra-op threads to its share now and return the count: among the declared processes,
    or with `adapt` (or RLHF_THREADS=auto) among those running now. Before torch is imported (a stage that may
    never need it), through OMP_NUM_THREADS, which torch reads at import. Every process registers, so that an
    adapting one counts it."""
    global _last_fit
    fixed = user_threads()
    adapt = fixed is None and (adapt or adapts())
    if fixed is None:
        register_this_process()
    threads = fixed or planned_threads(running=running_processes() if adapt else 1)
    torch = sys.modules.get("torch")
    if torch is None:
        # marked as ours (RLHF_TORCH_PROCESSES present), so that a child does not take it for a user's choice
        os.environ.update({PROCESSES_ENV: str(processes_sharing()), "OMP_NUM_THREADS": str(threads)})
    elif torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # the calling thread's OpenMP pool: call it from the thread that computes
    _last_fit = time.monotonic() if adapt else 0.0
    return threads


def refit_threads() -> None:
    """In a running loop of an adapting process: fit again if the last fit is older than REFIT_EVERY_S
    (neighbours come and go). A no-op otherwise: the count stays what it was at the start."""
    if _last_fit and time.monotonic() - _last_fit >= REFIT_EVERY_S:
        fit_threads(adapt=True)


def env_for_children(processes: int, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env` for `processes` torch processes started side by side from this one: the count of processes sharing
    the cores multiplied by them, OMP_NUM_THREADS set to each one's share (torchrun would set 1; OpenMP code
    outside torch reads it too), and a user's fixed count carried down as RLHF_THREADS."""
    out = dict(env)
    fixed = user_threads(env)
    out[PROCESSES_ENV] = str(processes_sharing(env) * max(1, processes))
    if fixed is not None:
        out[THREADS_ENV] = str(fixed)
    elif adapts(env):
        out[THREADS_ENV] = ADAPT
    out["OMP_NUM_THREADS"] = str(planned_threads(out))
    return out


def share_cores_with(processes: int) -> None:
    """Declare, in this process's own environment, that `processes` torch processes (this one among them) run
    side by side from here on, and take this one's share: what each pytest worker does once at its start."""
    os.environ.update(env_for_children(processes))
    fit_threads()
