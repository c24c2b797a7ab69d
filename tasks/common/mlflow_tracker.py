"""`rlhf_core.tracking.Tracker` on one MLflow run, and every other write of a stage to that run: params, metrics,
tags, artifacts, tables, the run's end.

Against a tracking server (http) every write goes into one ordered queue that a background thread sends, each
call retried until it gets through while its failure is transient (tasks/common/transient.py: connection
refused, timeout, HTTP 5xx): training never waits on the network, and a server that drops for a while (a restart,
a network blip) loses nothing. `close()` waits for the queue to drain for up to RLHF_MLFLOW_RETRY_S seconds
(default 600) and then raises `TrackingUnavailable`, naming the server and each write not sent: the stage
fails (its outputs kept), and the flow retries it. A refusal a retry cannot fix (a bad value) is dropped and
said so, as before. An outage is logged as warnings (the stage's log): the first failed send ("... failed
(...); buffered, retried until the server takes them"), each write buffered behind it ("server down: ..."), and
the end ("the server takes metrics ... again after S s and K failed tries; backlog drained: B batches (M metrics)
sent, none lost"); no line carries a credential (a URL's user:password is cut out). A local sqlite store is
written in the caller's thread, errors logged and never raised: the local store must not stop a training run.

Reads and writes that must happen now (open a run, register a model) use `retrying`: the same retries, in line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tasks.common.mlflow_store import TrackingError
from tasks.common.params import flatten
from tasks.common.transient import Transient, transient_cause

log = logging.getLogger(__name__)

RETRY_ENV = "RLHF_MLFLOW_RETRY_S"  # how long a write may wait for a tracking server that is down
DEFAULT_RETRY_S = 600.0
MAX_BACKOFF_S = 15.0
FLUSH_EVERY = 10  # updates per log_batch: one round trip instead of ~50 per update (a server: 4.6 s / 50 calls)
# MLflow's own limits per log_batch call
_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAM_VALUE = 6000
T = TypeVar("T")


class TrackingUnavailable(TrackingError):
    """The tracking server did not take a stage's writes within RLHF_MLFLOW_RETRY_S: which server, and what. It
    carries the outage's last failure (`transient`): a retry of the stage, later, may well get through."""

    def __init__(self, message: str, transient: Transient | None = None):
        super().__init__(message)
        self.transient = transient


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics MLflow can plot: numbers and booleans of a flattened dict; text is left out."""
    return {k: float(v) for k, v in flatten(metrics).items()
            if isinstance(v, bool | int | float) and not (isinstance(v, float) and math.isinf(v))}


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, list | tuple) else str(value)
    return text[:_MAX_PARAM_VALUE]


@dataclass(frozen=True)
class Write:
    """One write to the run: what it is in words ("42 params", "artifacts reports/eval"), and the call."""

    what: str
    send: Callable[[], object]
    metrics: int = 0  # the metrics it carries (a metric batch): outage lines count them


class MlflowTracker:
    """`rlhf_core.tracking.Tracker` on one MLflow run, plus `write` for any other call on it. Metrics are
    buffered and sent with one `log_batch` every `flush_every` steps and at `close()`. With `background` (a
    tracking server) writes queue in order on a sending thread, retried through outages; else (a local store)
    each is written in line, its error logged, never raised."""

    def __init__(self, client, run_id: str, flush_every: int = FLUSH_EVERY, background: bool = False,
                 server: str = ""):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self.errors = 0
        self.last_step = 0
        self.logged: set[str] = set()  # metric keys with a history already
        self._pending: list = []
        self._steps = 0
        self._sender = _Sender(run_id, server) if background else None

    def safely(self, what: str, fn: Callable, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as err:  # logging must never fail the stage
            self.errors += 1
            if self.errors == 1:
                log.warning("MLflow %s failed for run %s (%s); the stage goes on without it", what, self.run_id, err)

    def write(self, what: str, fn: Callable, *args, metrics: int = 0, **kwargs) -> None:
        """`fn(*args, **kwargs)`, a write to this run: queued for the server, or done now on a local store."""
        if self._sender is not None:
            self._sender.put(Write(what, lambda: fn(*args, **kwargs), metrics))
        else:
            self.safely(what, fn, *args, **kwargs)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_value(v)) for k, v in flatten(params).items()]
        for start in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            batch = items[start:start + _MAX_PARAMS_PER_BATCH]
            self.write(f"{len(batch)} params", self.client.log_batch, self.run_id, params=batch, synchronous=True)

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
        where = f"{artifact_path}/{path.name}" if artifact_path else path.name
        self.write(f"artifact {where}", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), _MAX_METRICS_PER_BATCH):
            batch = pending[start:start + _MAX_METRICS_PER_BATCH]
            self.write(f"{len(batch)} metrics", _log_metric_batch, self.client, self.run_id, batch,
                       metrics=len(batch))

    def close(self) -> None:
        """Send what is buffered; with a server, wait up to RLHF_MLFLOW_RETRY_S for it to take every write.
        Raises TrackingUnavailable naming what it never took."""
        self.flush()
        if self._sender is None:
            return
        unsent, cause = self._sender.drain(retry_seconds())
        if unsent:
            self.errors += 1
            metrics = sum(w.metrics for w in unsent)
            what = ", ".join(dict.fromkeys(w.what for w in unsent if not w.metrics))
            listed = f"{metrics} metrics" + (f", {what}" if what else "") if metrics else what
            raise TrackingUnavailable(
                f"MLflow at {self._sender.server or 'the tracking server'} did not take run {self.run_id}'s writes "
                f"within {retry_seconds():.0f} s ({RETRY_ENV}; last failure: {cause or 'none recorded'}). Not sent: "
                f"{listed}. The stage's outputs are kept: run it again (the flow retries it) once the server is "
                f"back.", cause)


def _log_metric_batch(client, run_id: str, batch: list) -> None:
    client.log_batch(run_id, metrics=batch, synchronous=True)


def retry_seconds() -> float:
    raw = os.environ.get(RETRY_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_RETRY_S
    except ValueError:
        raise ValueError(f"{RETRY_ENV}={raw!r}: expected a number of seconds") from None


def retrying(what: str, fn: Callable[..., T], *args, server: str = "",
             landed: Callable[[], T | None] | None = None, **kwargs) -> T:
    """`fn(*args, **kwargs)` now, retried with backoff while its failure is transient, for up to
    RLHF_MLFLOW_RETRY_S; then TrackingUnavailable naming the server and `what`. Other failures raise as they are.

    `landed`, for a call that creates something: a try that timed out may have been done by the server with
    its reply lost, and a second try would then fail (RESOURCE_ALREADY_EXISTS) or make a duplicate. So after a
    transient failure `landed()` is asked first; what it finds (not None) is what the failed try made."""
    give_up_at, delay, warned, failed = time.monotonic() + retry_seconds(), 1.0, False, False
    while True:
        try:
            if failed and landed is not None and (made := landed()) is not None:
                return made
            return fn(*args, **kwargs)
        except Exception as err:
            cause = transient_cause(err)
            if cause is None:
                raise
            failed = True
            where = server or cause.server or "the tracking server"
            if time.monotonic() >= give_up_at:
                raise TrackingUnavailable(f"MLflow at {where} did not answer within {retry_seconds():.0f} s "
                                          f"({RETRY_ENV}; {cause}): {what} not done", cause) from err
            if not warned:
                log.warning("MLflow at %s: %s failed (%s); retried until it answers (up to %.0f s, %s)", where, what,
                            _describe(err), retry_seconds(), RETRY_ENV)
                warned = True
        time.sleep(min(delay, max(give_up_at - time.monotonic(), 0)))
        delay = min(delay * 2, MAX_BACKOFF_S)


CREATE_REQUEST_TAG = "rlhf.create_request"  # one id per create_run call: how a retry finds the run a lost reply made


class RetryingClient:
    """An MlflowClient whose every call is `retrying`: for the stages' calls that must happen now (registering
    a model, reading the registry) against a server that may be restarting. Its creations happen once, however
    many tries they take."""

    def __init__(self, client, server: str):
        self._client, self._server = client, server

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            return retrying(name, attr, *args, server=self._server, **kwargs)

        return call

    def create_run(self, experiment_id: str, start_time: int | None = None, tags: dict | None = None,
                   run_name: str | None = None):
        request = uuid.uuid4().hex

        def landed():
            found = self._client.search_runs([experiment_id], f"tags.`{CREATE_REQUEST_TAG}` = '{request}'",
                                             max_results=1)
            return found[0] if found else None

        return retrying("create_run", self._client.create_run, experiment_id, start_time,
                        {**(tags or {}), CREATE_REQUEST_TAG: request}, run_name, server=self._server, landed=landed)

    def create_registered_model(self, name: str, *args, **kwargs):
        return retrying("create_registered_model", self._client.create_registered_model, name, *args,
                        server=self._server, landed=lambda: registered_model_or_none(self._client, name), **kwargs)


def registered_model_or_none(client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def _describe(err: Exception) -> str:
    """The error's first line, short, without any user:password of a URL in it."""
    first = (str(err).splitlines() or [""])[0]
    text = f"{type(err).__name__}: {first}"
    if len(text) > 200:  # a connection error's story is long: its start and its cause ("[Errno 111] ...")
        cause = re.search(r"\[Errno \d+\][^'\")]*", first)
        text = text[:160] + "..." + (f" {cause.group(0).strip()}" if cause else "")
    return re.sub(r"(\w+://)[^/@\s]+@", r"\1", text)[:300]


class _Sender:
    """One background thread that sends a run's writes in order, each retried (backoff up to 15 s) while its
    failure is transient; started on the first write. An outage (from the first failed send until the queue is
    empty again) is logged: when it starts, each write buffered meanwhile, and when the backlog has drained."""

    def __init__(self, run_id: str, server: str):
        self.run_id, self.server = run_id, server
        self._queue: deque[Write] = deque()
        self._cond = threading.Condition()
        self._busy = False  # a write is being sent
        self._closing = False
        self._give_up_at = math.inf
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None  # monotonic time of the outage's first failed send
        self._cause: Transient | None = None  # the outage's last failure
        self._failures = 0  # failed sends in this outage
        self._backlog = [0, 0]  # writes, metrics sent since the outage began

    def put(self, write: Write) -> None:
        with self._cond:
            self._queue.append(write)
            if self._down_since is not None:
                waiting = sum(w.metrics for w in self._queue)
                if write.metrics:
                    log.warning("MLflow: server down: %d more metrics of run %s buffered (%d batches, %d metrics "
                                "waiting)", write.metrics, self.run_id, len(self._queue), waiting)
                else:
                    log.warning("MLflow: server down: %s of run %s buffered (%d writes waiting)", write.what,
                                self.run_id, len(self._queue))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"mlflow-writes-{self.run_id[:8]}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> tuple[list[Write], Transient | None]:
        """Wait until every write is sent or `timeout_s` passes: (the writes not sent, the last failure)."""
        with self._cond:
            self._closing = True
            self._give_up_at = time.monotonic() + timeout_s
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < self._give_up_at:
                self._cond.wait(timeout=0.5)
            unsent = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            return unsent, self._cause

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closing:
                        return
                    self._cond.wait()
                write = self._queue[0]
                self._busy = True
            sent = self._send(write)
            with self._cond:
                if sent is not None and self._queue and self._queue[0] is write:
                    self._queue.popleft()  # sent, or refused for good (said so); else it stays: not sent
                if self._down_since is not None and sent:
                    self._backlog[0] += 1
                    self._backlog[1] += write.metrics
                    if not self._queue:
                        log.warning("MLflow: the server takes metrics of run %s again after %.0f s and %d failed "
                                    "tries; backlog drained: %d batches (%d metrics) sent, none lost", self.run_id,
                                    time.monotonic() - self._down_since, self._failures, *self._backlog)
                        self._down_since, self._failures, self._backlog = None, 0, [0, 0]
                self._busy = False
                self._cond.notify_all()

    def _send(self, write: Write) -> bool | None:
        """True: sent; False: refused for good (dropped); None: still failing when the deadline came."""
        delay = 1.0
        while True:
            try:
                write.send()
                return True
            except Exception as err:
                cause = transient_cause(err)
                if cause is None:
                    log.error("MLflow refused %s of run %s (%s); they are dropped", write.what, self.run_id,
                              _describe(err))
                    return False
                with self._cond:
                    self._failures += 1
                    self._cause = cause
                    if self._down_since is None:
                        self._down_since = time.monotonic()
                        log.warning("MLflow: sending %s of run %s failed (%s); buffered, retried until the "
                                    "server takes them", write.what, self.run_id, _describe(err))
            with self._cond:
                if time.monotonic() >= self._give_up_at:
                    return None
                self._cond.wait(timeout=min(delay, max(self._give_up_at - time.monotonic(), 0)))
            delay = min(delay * 2, MAX_BACKOFF_S)
