"""A running stage's progress in the Prefect UI: its task's log every few steps, and a progress artifact.

The stage runs in a `dvc repro` subprocess, where its bars (tasks/tracking/progress.py) append their moves to the
file named by RLHF_PROGRESS_FILE. While the stage runs, a thread of the flow reads that file every second and
forwards what it finds: a log line at the first move, every tenth of the bar and the last
("train: update 3/8  reward 0.41  kl 0.02  episodes/s 12  length 7  (38%, eta 0:00:05)"), and the percentage
to a progress artifact (key `rlhf-progress-<stage>`) that moves with it. A stage without a terminal writes
those lines itself, into its log and the relay to this task's log, as they happen: they are not logged twice.
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


class _Follower:
    """Reads new complete lines of the progress file; forwards them to `logger` and the artifact."""

    def __init__(self, path: Path, stage: str, logger):
        self.path, self.stage, self.logger = path, stage, logger
        self.offset, self.artifact, self.percent, self.logged = 0, None, None, None

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line the stage is still writing waits for the next poll
        self.offset += len(complete)
        moves = []
        for line in complete.splitlines():
            try:
                moves.append(json.loads(line))
            except ValueError:
                continue
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
def forwarded_progress(stage: str, logger) -> Iterator[dict[str, str]]:
    """Yields the environment that makes the stage's bars report (RLHF_PROGRESS_FILE), and forwards their
    moves from a thread while the block runs, then once more after it. Call inside the Prefect task: the thread
    runs in a copy of its context, so the artifact belongs to the task run."""
    fd, name = tempfile.mkstemp(prefix=f"rlhf-progress-{stage}-", suffix=".jsonl")
    os.close(fd)
    follower, stop = _Follower(Path(name), stage, logger), threading.Event()

    def follow() -> None:
        while not stop.wait(POLL_S):
            follower.poll()
        follower.poll()  # what came after the last poll

    thread = threading.Thread(target=contextvars.copy_context().run, args=(follow,), daemon=True,
                              name=f"rlhf-progress-{stage}")
    thread.start()
    try:
        yield {PROGRESS_FILE_ENV: name}
    finally:
        stop.set()
        thread.join(timeout=30)
        Path(name).unlink(missing_ok=True)
