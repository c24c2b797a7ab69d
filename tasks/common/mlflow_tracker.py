"""`rlhf_core.tracking.Tracker` on one MLflow run: params and metrics flattened, metrics sent in batches.

Logging never fails a stage: after a stage has started, MLflow errors are logged as warnings.

Against a tracking server (http), metric batches go out from a background thread that retries each one until
it gets through, in order: training never waits on the network, and a server that drops for a while (a
restart, a network blip) loses no metric. `close()` waits for the buffer to drain for up to
RLHF_MLFLOW_RETRY_S seconds (default 600), then says how many metrics were lost. An outage is logged as warnings
(the stage's log): the first failed send ("... failed (...); buffered, retried until the server takes them"), each
batch buffered behind it ("server down: N more metrics ... buffered"), and the end ("the server takes metrics ...
again after S s and K failed tries; backlog drained: B batches (M metrics) sent, none lost"); no line carries a
credential (a URL's user:password is cut out). A local sqlite store is written in the caller's thread, as before.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tasks.common.params import flatten

log = logging.getLogger(__name__)

RETRY_ENV = "RLHF_MLFLOW_RETRY_S"  # how long close() waits for buffered metrics to reach a server that is down
DEFAULT_RETRY_S = 600.0
MAX_BACKOFF_S = 15.0
# MLflow error codes a retry cannot fix: the batch is dropped (and said so) rather than retried for ever
_PERMANENT = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "PERMISSION_DENIED",
              "UNAUTHENTICATED", "BAD_REQUEST"}
FLUSH_EVERY = 10  # updates per log_batch: one round trip instead of ~50 per update (a server: 4.6 s / 50 calls)
# MLflow's own limits per log_batch call
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_VALUE = 6000


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics MLflow can plot: numbers and booleans of a flattened dict; text is left out."""
    return {k: float(v) for k, v in flatten(metrics).items()
            if isinstance(v, bool | int | float) and not (isinstance(v, float) and math.isinf(v))}


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, list | tuple) else str(value)
    return text[:_MAX_PARAM_VALUE]



class MlflowTracker:
    """`rlhf_core.tracking.Tracker` on one MLflow run. Metrics are buffered and sent with one `log_batch`
    every `flush_every` steps and at `close()`. Errors are logged, never raised: a broken store must not
    stop a training run."""

    def __init__(self, client, run_id: str, flush_every: int = FLUSH_EVERY, background: bool = False):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self.errors = 0
        self.last_step = 0
        self.logged: set[str] = set()  # metric keys with a history already
        self._pending: list = []
        self._steps = 0
        self._sender = _Sender(client, run_id) if background else None

    def safely(self, what: str, fn: Callable, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as err:  # logging must never fail the stage
            self.errors += 1
            if self.errors == 1:
                log.warning("MLflow %s failed for run %s (%s); the stage goes on without it", what, self.run_id, err)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_value(v)) for k, v in flatten(params).items()]
        for start in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self.safely("log params", self.client.log_batch, self.run_id,
                         params=items[start:start + _MAX_PARAMS_PER_BATCH], synchronous=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = numeric(metrics)
        self._pending += [Metric(k, v, now, step) for k, v in values.items()]
        self.logged.update(values)
        self.last_step = max(self.last_step, step)
        self._steps += 1
        if self._steps % self.flush_every == 0:
            self.flush()

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.safely("log artifact", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), _MAX_METRICS_PER_BATCH):
            batch = pending[start:start + _MAX_METRICS_PER_BATCH]
            if self._sender is not None:
                self._sender.put(batch)
            else:
                self.safely("log metrics", self.client.log_batch, self.run_id, metrics=batch, synchronous=True)

    def close(self) -> None:
        self.flush()
        if self._sender is not None:
            lost = self._sender.drain(retry_seconds())
            if lost:
                self.errors += 1
                log.error("MLflow: %d metrics of run %s not sent: the server did not take them within %s s (%s)",
                          lost, self.run_id, retry_seconds(), RETRY_ENV)


def retry_seconds() -> float:
    raw = os.environ.get(RETRY_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_RETRY_S
    except ValueError:
        raise ValueError(f"{RETRY_ENV}={raw!r}: expected a number of seconds") from None


def _permanent(err: Exception) -> bool:
    return getattr(err, "error_code", None) in _PERMANENT


def _describe(err: Exception) -> str:
    """The error's first line, short, without any user:password of a URL in it."""
    first = (str(err).splitlines() or [""])[0]
    text = f"{type(err).__name__}: {first}"
    if len(text) > 200:  # a connection error's story is long: its start and its cause ("[Errno 111] ...")
        cause = re.search(r"\[Errno \d+\][^'\")]*", first)
        text = text[:160] + "..." + (f" {cause.group(0).strip()}" if cause else "")
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1", text)[:300]


class _Sender:
    """One background thread that sends metric batches in order, each retried (backoff up to 15 s) until it
    gets through; started on the first batch. An outage (from the first failed send until the queue is empty
    again) is logged: when it starts, each batch buffered meanwhile, and when the backlog has drained."""

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id
        self._queue: deque[list] = deque()
        self._cond = threading.Condition()
        self._busy = False  # a batch is being sent
        self._closing = False
        self._give_up_at = math.inf
        self._lost = 0
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None  # monotonic time of the outage's first failed send
        self._failures = 0  # failed sends in this outage
        self._backlog = [0, 0]  # batches, metrics sent since the outage began

    def put(self, batch: list) -> None:
        with self._cond:
            self._queue.append(batch)
            if self._down_since is not None:
                log.warning("MLflow: server down: %d more metrics of run %s buffered (%d batches, %d metrics waiting)",
                            len(batch), self.run_id, len(self._queue), sum(len(b) for b in self._queue))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"mlflow-metrics-{self.run_id[:8]}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> int:
        """Wait until every batch is sent or `timeout_s` passes; returns the number of metrics not sent."""
        with self._cond:
            self._closing = True
            self._give_up_at = time.monotonic() + timeout_s
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < self._give_up_at:
                self._cond.wait(timeout=0.5)
            self._lost += sum(len(batch) for batch in self._queue)
            self._queue.clear()
            self._cond.notify_all()
            return self._lost

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closing:
                        return
                    self._cond.wait()
                batch = self._queue[0]
                self._busy = True
            sent = self._send(batch)
            with self._cond:
                if self._queue and self._queue[0] is batch:
                    self._queue.popleft()
                    if not sent:
                        self._lost += len(batch)
                if self._down_since is not None and sent:
                    self._backlog[0] += 1
                    self._backlog[1] += len(batch)
                    if not self._queue:
                        log.warning("MLflow: the server takes metrics of run %s again after %.0f s and %d failed "
                                    "tries; backlog drained: %d batches (%d metrics) sent, none lost", self.run_id,
                                    time.monotonic() - self._down_since, self._failures, *self._backlog)
                        self._down_since, self._failures, self._backlog = None, 0, [0, 0]
                self._busy = False
                self._cond.notify_all()

    def _send(self, batch: list) -> bool:
        delay = 1.0
        while True:
            try:
                self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
                return True
            except Exception as err:
                if _permanent(err):
                    log.error("MLflow refused %d metrics of run %s (%s); they are dropped", len(batch), self.run_id,
                              _describe(err))
                    return False
                with self._cond:
                    self._failures += 1
                    if self._down_since is None:
                        self._down_since = time.monotonic()
                        log.warning("MLflow: sending %d metrics of run %s failed (%s); buffered, retried until the "
                                    "server takes them", len(batch), self.run_id, _describe(err))
            with self._cond:
                if time.monotonic() >= self._give_up_at:
                    return False
                self._cond.wait(timeout=min(delay, max(self._give_up_at - time.monotonic(), 0)))
            delay = min(delay * 2, MAX_BACKOFF_S)
