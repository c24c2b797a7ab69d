"""A running stage's progress in the Prefect UI: its task's log every few steps, and progress artifacts.

The stage runs in a `dvc repro` subprocess, where its bars (tasks/tracking/progress.py) append their moves to the
file named by RLHF_PROGRESS_FILE. While the stage runs, two threads read that file every second:

- the task's (`forwarded_progress`): a log line at the first move, every tenth of the bar and the last
  ("train: update 3/8  reward 0.41  kl 0.02  episodes/s 12  length 7  (38%, eta 0:00:05)"), and a progress
  artifact of the task run (key `rlhf-progress-<stage>`, on the stage's task-run page) that moves with it. A stage
  without a terminal writes those lines itself, into its log and the relay to this task's log, as they happen:
  they are not logged twice.
- the flow's (`run_progress`): one progress artifact of the flow run, `rlhf-run-progress`, that says where the whole
  run is ("stage 6/8 train: 38%, eta 0:00:05, update 3/8  reward 0.41 ..."), then how it ended. It is the one a
  person finds on the flow run's page (its Artifacts tab, under "Flow run" in Prefect's V1 UI, where a task run's
  artifacts sit apart under "Task runs"). Both UIs show an artifact's description, not its value: the description
  leads with the stage and its percentage, which a card's one line keeps.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.tracking.progress import PROGRESS_FILE_ENV, move_line, progress_label

POLL_S = 1.0  # how often the file is read: a second's delay in the UI, one API call a second at most
LOG_FRACTION = 0.1  # a log line each tenth of a bar (and its first and last moves)

log = logging.getLogger(__name__)


def progress_line(stage: str, move: dict) -> str:
    """`train: update 3/8  reward 0.41 ...  (38%, eta 0:00:05)` from one move of a bar."""
    return move_line(progress_label(stage, move.get("bar", stage)), float(move["done"]), float(move["total"]),
                     move.get("info") or "", move.get("eta_s"))


def _read_moves(path: Path, offset: int) -> tuple[list[dict], int]:
    """The bar moves written to `path` after `offset`, complete lines only, and the offset after them."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return [], offset
    complete = chunk[:chunk.rfind(b"\n") + 1]  # a line the stage is still writing waits for the next poll
    moves = []
    for line in complete.splitlines():
        try:
            moves.append(json.loads(line))
        except ValueError:
            continue
    return moves, offset + len(complete)


class _Follower:
    """Reads new complete lines of the progress file; forwards them to `logger` and the artifact."""

    def __init__(self, path: Path, stage: str, logger, offset: int = 0):
        self.path, self.stage, self.logger = path, stage, logger
        self.offset, self.artifact, self.percent, self.logged = offset, None, None, None

    def poll(self) -> None:
        moves, self.offset = _read_moves(self.path, self.offset)
        for move in moves:
            self._log(move)
        if moves:
            self._artifact(moves[-1])

    def _log(self, move: dict) -> None:
        if move.get("own_lines"):  # the stage wrote its progress lines itself: they are in the log with its output
            return
        done, total = float(move["done"]), float(move["total"]) or 1.0
        due = self.logged is None or done >= total or done - self.logged >= LOG_FRACTION * total
        if due and done != self.logged:
            self.logger.info("%s", progress_line(self.stage, move))
            self.logged = done

    def _artifact(self, move: dict) -> None:
        percent = round(min(100.0, 100 * float(move["done"]) / (float(move["total"]) or 1.0)), 1)
        if percent == self.percent:
            return
        info = move.get("info") or f"{float(move['done']):g}/{float(move['total']):g}"
        description = f"{progress_label(self.stage, move.get('bar', self.stage))}: {info}"  # "train: update 5/30 ..."
        try:
            if self.artifact is None:
                self.artifact = create_progress_artifact(percent, key=f"rlhf-progress-{self.stage}",
                                                         description=description)
            else:
                update_progress_artifact(self.artifact, percent, description=description)
            self.percent = percent
        except Exception as err:  # the UI's view of progress never fails a stage
            log.warning("progress artifact of stage %s not updated: %s", self.stage, err)


@contextmanager
def forwarded_progress(stage: str, logger, path: str = "") -> Iterator[dict[str, str]]:
    """Yields the environment that makes the stage's bars report (RLHF_PROGRESS_FILE): the file `path` (the flow's,
    from `RunProgress.stage`), else a file of its own; forwards their moves from a thread while the block runs, then
    once more after it. Call inside the Prefect task: the thread runs in a copy of its context, so the artifact
    belongs to the task run. A retry of the task forwards only its own moves (it reads on from the file's end)."""
    own = not path
    if own:
        fd, path = tempfile.mkstemp(prefix=f"rlhf-progress-{stage}-", suffix=".jsonl")
        os.close(fd)
    start = Path(path).stat().st_size if Path(path).is_file() else 0
    follower, stop = _Follower(Path(path), stage, logger, start), threading.Event()

    def follow() -> None:
        while not stop.wait(POLL_S):
            follower.poll()
        follower.poll()  # what came after the last poll

    thread = threading.Thread(target=contextvars.copy_context().run, args=(follow,), daemon=True,
                              name=f"rlhf-progress-{stage}")
    thread.start()
    try:
        yield {PROGRESS_FILE_ENV: path}
    finally:
        stop.set()
        thread.join(timeout=30)
        if own:
            Path(path).unlink(missing_ok=True)


RUN_PROGRESS_KEY = "rlhf-run-progress"
RUN_JOIN_S = 10.0  # at the run's end, how long its last word may take to reach the server (a dead one: not waited on)


class RunProgress:
    """Where the run is, as the flow run's progress artifact `rlhf-run-progress`: its value the share of the run's
    stages done (the running one counted by its bar), its description the running stage and its bar
    ("stage 6/8 train: 38%, eta 0:00:05, update 3/8  reward 0.41 ..."), then how the run ended.

    The flow says where the run is (`stage`, `done`, `stopped`); a thread in the flow's context reads the running
    stage's progress file and sends what changed, at most once a POLL_S: the flow never waits on the Prefect server
    for it, and a server that stopped answering costs this view, not the run (one warning, then no more calls)."""

    def __init__(self, names: list[str]):
        self.names, self.lock = list(names), threading.Lock()
        self.index, self.path, self.offset, self.move, self.ended = 0, None, 0, None, None
        self.artifact, self.sent, self.warned = None, None, False

    @contextmanager
    def stage(self, index: int) -> Iterator[str]:
        """While stage `index` of the run runs: yields the progress file its bars write to (the task's
        `forwarded_progress` reads it too)."""
        fd, path = tempfile.mkstemp(prefix=f"rlhf-progress-{self.names[index]}-", suffix=".jsonl")
        os.close(fd)
        with self.lock:
            self.index, self.path, self.offset, self.move = index, Path(path), 0, None
        try:
            yield path
        finally:
            self.poll()  # its last moves, before the file goes
            with self.lock:
                self.path = None
            Path(path).unlink(missing_ok=True)

    def done(self, results: list[dict]) -> None:
        """Every stage got through: how many ran, came back from DVC's run cache, or were unchanged."""
        ran = sum(1 for r in results if r.get("ran"))
        restored = sum(1 for r in results if r.get("restored"))
        parts = [f"{ran} ran", f"{restored} restored from DVC's run cache" if restored else "",
                 f"{len(results) - ran - restored} unchanged" if len(results) > ran + restored else ""]
        self._end(100.0, f"done: {len(results)} stages, " + ", ".join(p for p in parts if p))

    def stopped(self, how: str, index: int | None = None) -> None:
        """The run ended at a stage (`how`: "failed at", "cancelled at", "cancelled before")."""
        with self.lock:
            if index is not None:
                self.index, self.move = index, None
            percent, _ = self._view()
        self._end(percent, f"{how} {self._where()}")

    def _end(self, percent: float, text: str) -> None:
        with self.lock:
            self.ended = (percent, text)

    def _where(self) -> str:
        return f"stage {self.index + 1}/{len(self.names)} {self.names[self.index]}"

    def _view(self) -> tuple[float, str]:
        """(value, description) of the artifact now."""
        if self.ended is not None:
            return self.ended
        if self.move is None:
            return 100 * self.index / len(self.names), f"{self._where()}: started"
        done, total = float(self.move["done"]), float(self.move["total"]) or 1.0
        share = min(1.0, done / total)
        eta = self.move.get("eta_s")
        when = "" if eta is None else f", eta {timedelta(seconds=round(eta))}"
        info = self.move.get("info") or f"{done:g}/{total:g}"
        return 100 * (self.index + share) / len(self.names), f"{self._where()}: {100 * share:.0f}%{when}, {info}"

    def poll(self) -> None:
        with self.lock:
            path, offset = self.path, self.offset
        if path is None:
            return
        moves, offset = _read_moves(path, offset)
        with self.lock:
            if path == self.path:
                self.offset = offset
                self.move = moves[-1] if moves else self.move

    def send(self) -> None:
        """The artifact as it is now, if that changed since the last send (made on the first). After a failure, no
        more: a server that stopped answering is not called again and again up to the run's end (nor then, from a
        thread still waiting on it as the process exits)."""
        if self.warned:
            return
        with self.lock:
            percent, text = self._view()
        view = (round(min(100.0, percent), 1), text)
        if view == self.sent:
            return
        try:
            if self.artifact is None:
                self.artifact = create_progress_artifact(view[0], key=RUN_PROGRESS_KEY, description=view[1])
            else:
                update_progress_artifact(self.artifact, view[0], description=view[1])
            self.sent = view
        except Exception as err:  # the UI's view of progress never fails the run
            log.warning("the run's progress artifact (%s) not updated, nor will it be in this run: %s",
                        RUN_PROGRESS_KEY, err)
            self.warned = True


@contextmanager
def run_progress(names: list[str]) -> Iterator[RunProgress]:
    """The run's progress artifact over `names` (dvc.yaml's stages), sent from a thread while the block runs, and its
    last word when it ends. Call in the flow, not in a task: the thread runs in a copy of the flow's context, so the
    artifact belongs to the flow run."""
    progress, stop = RunProgress(names), threading.Event()

    def follow() -> None:
        while not stop.wait(POLL_S):
            progress.poll()
            progress.send()
        progress.poll()
        progress.send()

    thread = threading.Thread(target=contextvars.copy_context().run, args=(follow,), daemon=True,
                              name="rlhf-run-progress")
    thread.start()
    try:
        yield progress
    except BaseException:
        if progress.ended is None:
            progress.stopped("stopped at")
        raise
    finally:
        stop.set()
        thread.join(timeout=RUN_JOIN_S)
