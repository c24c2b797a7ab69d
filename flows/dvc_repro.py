"""Run one stage of dvc.yaml through DVC, in a subprocess, the way `dvc repro --single-item NAME` does.

A Prefect run and a `dvc repro` thus share the same dvc.lock, cache and skipping of unchanged stages. The
subprocess (`python -m flows.dvc_repro NAME RESULT_JSON`) calls DVC's API rather than its CLI so that it
can say whether the stage ran or was skipped without parsing messages. Its output (the stage's own, with
its progress bars) is relayed to this process's stdout as it comes and kept in a log file, whose tail
names the failure when the stage fails.

A stage that does not finish puts its last good outputs back itself (tasks/execution/put_back.py, in the stage
process, whichever way it was started). What it cannot do is left here: finish a put-back whose process was
killed outright (`finish_abandoned`, before and after each stage), and give a put-back in progress its time when
the stage is stopped (stop_stages).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rlhf_core.jsonio import read_json_object, write_json
from tasks.execution.launcher import stop_group
from tasks.execution.outcome import OUTCOME_ENV, retry_reason
from tasks.execution.put_back import finish_abandoned, in_progress
from tasks.execution.transient import transient_cause

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STOP_GRACE_S = 5.0  # a stopped stage's time to end its MLflow run and DVC's lock before the next signal
RUNNING: dict[subprocess.Popen, Path] = {}  # the stage subprocesses of this process now running: their workspace
STOPPED: set[subprocess.Popen] = set()  # those stop_stages() stopped


@dataclass(frozen=True)
class ReproResult:
    """How one `dvc repro --single-item` of a stage went."""

    name: str
    returncode: int
    ran: bool  # False: DVC found it unchanged and skipped it, or restored it from its run cache
    seconds: float
    log: Path
    restored: bool = False  # DVC restored its outputs from the run cache: an earlier run had these inputs
    retry_reason: str | None = None  # a failure a retry may fix: why (tasks/execution/transient.py), else None


def stage_env(extra: Mapping[str, str], terminal: bool) -> dict[str, str]:
    """The environment of a stage subprocess: this venv's `rlhf` first on PATH, output unbuffered."""
    env = {**os.environ, **extra, "DVC_NO_ANALYTICS": "1", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if terminal:  # the relay is a pipe: tell rich the far end is a terminal so progress bars stay live
        env.update(TTY_COMPATIBLE="1", TTY_INTERACTIVE="1", COLUMNS=str(shutil.get_terminal_size().columns))
    return env


class LineSplitter:
    """Complete lines of a relayed terminal output, each as its last redraw left it (see clean_lines)."""

    MAX_PENDING = 1 << 16  # a progress bar redrawn for minutes without a newline keeps only its last redraw

    def __init__(self, on_line: Callable[[str], object]):
        self.on_line, self.pending = on_line, b""

    def feed(self, chunk: bytes) -> None:
        *complete, self.pending = (self.pending + chunk).split(b"\n")
        if len(self.pending) > self.MAX_PENDING:
            self.pending = self.pending.rsplit(b"\r", 1)[-1][-self.MAX_PENDING:]
        for raw in complete:
            for line in clean_lines(raw.decode(errors="replace")):
                self.on_line(line)

    def close(self) -> None:
        self.feed(b"\n")


def repro_stage(root: str | Path, name: str, log: Path, env: Mapping[str, str],
                echo: BinaryIO | None = None, on_line: Callable[[str], object] | None = None) -> ReproResult:
    """Reproduce stage `name` (if changed) with `root` as the working directory; output to `log` (+ `echo`,
    and each complete line to `on_line`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    _finish_abandoned(root)
    fd, result_file = tempfile.mkstemp(prefix=f"rlhf-{name}-", suffix=".json")
    os.close(fd)
    outcome_file = Path(result_file).with_suffix(".outcome.json")  # the stage's own (tasks/execution/outcome.py)
    env = {**env, OUTCOME_ENV: str(outcome_file)}
    start = time.monotonic()
    try:
        # its own session: a terminal's Ctrl-C reaches only the flow, which stops the stage (stop_stages)
        with log.open("wb", buffering=0) as out, subprocess.Popen(  # unbuffered: the log reads as the stage runs
                [sys.executable, "-m", "flows.dvc_repro", name, result_file], cwd=root, env=dict(env),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True) as proc:
            RUNNING[proc] = Path(root)
            lines = LineSplitter(on_line or (lambda line: None))
            try:
                for chunk in iter(lambda: proc.stdout.read1(1 << 16), b""):  # read1: relay redraws as they come
                    out.write(chunk)
                    lines.feed(chunk)
                    if echo is not None and proc not in STOPPED:  # once stopped, its dying words go to the log only
                        echo.write(chunk)
                        echo.flush()
            finally:
                lines.close()
                RUNNING.pop(proc, None)
                STOPPED.discard(proc)
        outcome = read_json_object(result_file) or {}
        why = None if proc.returncode == 0 else outcome.get("retry_reason") or retry_reason(outcome_file)
    finally:
        Path(result_file).unlink(missing_ok=True)
        outcome_file.unlink(missing_ok=True)
    if proc.returncode != 0:  # a stage killed outright (stop_stages' SIGKILL, the OOM killer) left its put-back here
        _finish_abandoned(root, log)
    return ReproResult(name, proc.returncode, bool(outcome.get("ran", False)), time.monotonic() - start, log,
                       restored=bool(outcome.get("restored", False)), retry_reason=why)


def stop_stages(grace_s: float = STOP_GRACE_S) -> None:
    """Stop every running stage subprocess with its children: SIGINT first (the stage marks its MLflow run
    KILLED and puts its last good outputs back), then SIGTERM and SIGKILL to the process group after `grace_s`
    each; never SIGKILL while the stage is putting its outputs back (it waits for that, up to an hour)."""
    for proc, root in list(RUNNING.items()):
        STOPPED.add(proc)
        steps = [(sig, grace_s) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)]
        threading.Thread(target=stop_group, args=(proc, steps, lambda root=root: in_progress(root)),
                         daemon=True).start()


def _finish_abandoned(root: str | Path, log: Path | None = None) -> None:
    """Finish the put-back of any stage of `root` whose process was killed before finishing it (put_back.py); said
    on stderr and at the end of the stage's `log`."""
    try:
        finished = finish_abandoned(root)
        line = f"dvc_repro: put back the outputs of {', '.join(finished)}, whose process was killed" if finished else ""
    except Exception as err:  # noqa: BLE001 - said; the stage's next run clears what is left
        line = f"dvc_repro: could not finish a killed stage's put-back in {root}: {err}"
    if line:
        print(line, file=sys.stderr, flush=True)
        if log is not None:
            with log.open("a") as out:
                out.write(line + "\n")


def clean_lines(raw: str) -> list[str]:
    """Text lines of a terminal log: ANSI codes dropped, each line as its last redraw left it."""
    lines = (_ANSI.sub("", line).rsplit("\r", 1)[-1].rstrip() for line in raw.split("\n"))
    return [line for line in lines if line]


def log_tail(log: Path, lines: int = 25) -> str:
    return "\n".join(clean_lines(log.read_text(errors="replace"))[-lines:]) if log.is_file() else ""


def _error_chain(err: BaseException) -> str:
    parts = []
    while err is not None:
        parts.append(str(err))
        err = err.__cause__ or err.__context__
    return ": ".join(dict.fromkeys(p for p in parts if p))


def main(argv: list[str]) -> int:
    """`python -m flows.dvc_repro NAME RESULT_JSON`: reproduce NAME; write {"ran": bool, "restored": bool}, or on
    DVC's failure {"ran": false, "retry_reason": why a retry may fix it, or null}.

    A stage that fails or is stopped (Ctrl-C, SIGTERM, a cancel from the UI: stop_stages) puts its last good
    outputs back itself, before its command exits (tasks/execution/put_back.py)."""
    name, result_file = argv
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    # SIGTERM (stop_stages after its grace, or a kill of the group) goes to the stage too: this process lives on
    # until the stage has exited (put its outputs back), so that DVC's lock is released in order
    signal.signal(signal.SIGTERM, lambda signum, frame: print("dvc_repro: SIGTERM; waiting for the stage to end",
                                                               file=sys.stderr, flush=True))
    restored: list[str] = []
    try:
        with Repo(".") as repo:
            repo.scm_context.quiet = True  # no "git add dvc.lock" hint after every stage
            _note_run_cache_restores(repo, restored)
            ran = repo.reproduce(name, single_item=True)
    except DvcException as err:  # DVC's own failure (its lock, a missing dep), or the stage command's exit
        print(f"dvc: {_error_chain(err)}", file=sys.stderr)
        cause = transient_cause(err)
        write_json(result_file, {"ran": False, "retry_reason": str(cause) if cause else None})
        return 1
    # a stage DVC restored from its run cache "ran" for DVC (dvc.lock rewritten) but its command did not run
    write_json(result_file, {"ran": bool(ran) and not restored, "restored": bool(restored)})
    return 0


def _note_run_cache_restores(repo, restored: list[str]) -> None:
    """Append to `restored` each stage this repo restores from DVC's run cache instead of running its command.

    A wrapper on this Repo instance's StageCache.restore (DVC's stage.run calls it first, and it raises
    RunCacheNotFoundError when no earlier run had the same params, deps and command), since reproduce() returns
    restored and executed stages alike."""
    restore = repo.stage_cache.restore

    def noting_restore(stage, *args, **kwargs):
        result = restore(stage, *args, **kwargs)
        if not kwargs.get("dry"):
            restored.append(stage.addressing)
        return result

    repo.stage_cache.restore = noting_restore


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
