"""`rlhf_core.tracking.Tracker` on one MLflow run, and every other write of a stage to that run: params, metrics,
tags, artifacts, tables, the run's end.

Against a tracking server (http) every write goes into one ordered queue that a background thread sends, each
call retried until it gets through while its failure is transient (tasks/execution/transient.py: connection
refused, timeout, HTTP 5xx): training never waits on the network, and a server that drops for a while (a restart,
a network blip, its database down) loses nothing. `close()` waits for the queue to drain for up to
RLHF_MLFLOW_RETRY_S seconds (default 600) and then raises `TrackingUnavailable`, naming the server and each write
not sent: the stage or run fails, and the flow retries it. A write in flight when the time is up is waited for:
it is either confirmed or reported unsent, never both. A refusal a retry cannot fix (a bad value, a run that is
not there) is never swallowed: the writes after it still go, the run's end becomes FAILED, and `close()` raises
`TrackingRefused` naming each refused write.

An outage is logged as warnings (the stage's log): the first failed send ("... failed (...); buffered, retried
until the server takes them"), each write buffered behind it ("server down: ..."), and the end ("the server takes
metrics ... again after S s and K failed tries; backlog drained: B batches (M metrics) sent, none lost"), which
the run also keeps as its tag `rlhf.tracking_outages`; no line carries a credential (a URL's user:password is cut
out). A local sqlite store is written in the caller's thread; a write it refuses is logged at once and fails the
run at `close()`, as above.

A write sent twice (a retry after a timeout whose reply was lost) lands once: metrics carry the time they were
logged, and MLflow's stores drop a metric equal in key, step, value and time; params, tags, the run's end and
artifacts are set to the same value again.

Reads and writes that must happen now (open a run, register a model, promote, read a run or the registry) use
`retrying` (`retrying_client`: a client whose every call is): the same retries and limit, in line.
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

from tasks.execution.transient import Transient, redact, transient_cause
from tasks.parameters.params import flatten
from tasks.tracking.mlflow_store import TrackingError, get_client, is_remote, tracking_uri

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


class TrackingRefused(TrackingError):
    """The tracking store refused writes of a run for good (a retry would fail the same way): which, and why."""


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
    each is written in line. Either way a refused write is kept in `refused` and fails `close()`."""

    def __init__(self, client, run_id: str, flush_every: int = FLUSH_EVERY, background: bool = False,
                 server: str = ""):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self.refused: list[str] = []  # "what (why)" of each write the store refused for good
        self.sent: deque[str] = deque(maxlen=64)  # the latest writes the store took, in order
        self.last_step = 0
        self.logged: set[str] = set()  # metric keys with a history already
        self._pending: list = []
        self._steps = 0
        self._lock = threading.Lock()  # log_metrics from a monitor's thread and the stage's
        self._sender = _Sender(run_id, server, self) if background else None

    @property
    def errors(self) -> int:
        return len(self.refused)

    def write(self, what: str, fn: Callable, *args, metrics: int = 0, **kwargs) -> None:
        """`fn(*args, **kwargs)`, a write to this run: queued for the server, or done now on a local store."""
        write = Write(what, lambda: fn(*args, **kwargs), metrics)
        if self._sender is not None:
            self._sender.put(write)
            return
        try:
            write.send()
            self.sent.append(what)
        except Exception as err:  # the local store: training goes on, close() fails naming it
            self.refuse(what, err)

    def refuse(self, what: str, err: Exception) -> None:
        self.refused.append(f"{what} ({_describe(err)})")
        log.error("MLflow refused %s of run %s (%s); the run fails at its end", what, self.run_id, _describe(err))

    def end(self, status: str) -> None:
        """Queue the run's end, last: FAILED instead of FINISHED when a write before it was refused."""
        def send():
            self.client.set_terminated(self.run_id, "FAILED" if self.refused and status == "FINISHED" else status)

        self.write(f"the run's end ({status})", send)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_value(v)) for k, v in flatten(params).items()]
        for start in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            batch = items[start:start + _MAX_PARAMS_PER_BATCH]
            self.write(f"{len(batch)} params", self.client.log_batch, self.run_id, params=batch, synchronous=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """`timestamp_ms`: the metrics' time; a fixed one makes logging them again a no-op (the store drops
        equal metrics)."""
        from mlflow.entities import Metric

        now = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        values = numeric(metrics)
        with self._lock:
            self._pending += [Metric(k, v, now, step) for k, v in values.items()]
            self.logged.update(values)
            self.last_step = max(self.last_step, step)
            self._steps += 1
            due = self._steps % self.flush_every == 0
        if due:
            self.flush()

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        where = f"{artifact_path}/{path.name}" if artifact_path else path.name
        self.write(f"artifact {where}", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for start in range(0, len(pending), _MAX_METRICS_PER_BATCH):
            batch = pending[start:start + _MAX_METRICS_PER_BATCH]
            self.write(f"{len(batch)} metrics", _log_metric_batch, self.client, self.run_id, batch,
                       metrics=len(batch))

    def close(self) -> None:
        """Send what is buffered; with a server, wait up to RLHF_MLFLOW_RETRY_S for it to take every write.
        Raises TrackingUnavailable naming what it never took, TrackingRefused naming what it refused."""
        self.flush()
        unsent, cause = self._sender.drain(retry_seconds()) if self._sender is not None else ([], None)
        refused = f" Refused for good: {'; '.join(self.refused)}." if self.refused else ""
        where = self._sender.server if self._sender is not None and self._sender.server else "the tracking store"
        if unsent:
            metrics = sum(w.metrics for w in unsent)
            what = ", ".join(dict.fromkeys(w.what for w in unsent if not w.metrics))
            listed = f"{metrics} metrics" + (f", {what}" if what else "") if metrics else what
            raise TrackingUnavailable(
                f"MLflow at {where} did not take run {self.run_id}'s writes within {retry_seconds():.0f} s "
                f"({RETRY_ENV}; last failure: {cause or 'none recorded'}{server_says(self.client)}). Not sent: "
                f"{listed}.{refused} Run it again once the server is back (the flow retries a stage).", cause)
        if self.refused:
            raise TrackingRefused(f"MLflow at {where} refused writes of run {self.run_id}: "
                                  f"{'; '.join(self.refused)}. The run ends FAILED.")


def _log_metric_batch(client, run_id: str, batch: list) -> None:
    client.log_batch(run_id, metrics=batch, synchronous=True)


def retry_seconds() -> float:
    raw = os.environ.get(RETRY_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_RETRY_S
    except ValueError:
        raise ValueError(f"{RETRY_ENV}={raw!r}: expected a number of seconds") from None


def retrying(what: str, fn: Callable[..., T], *args, server: str = "",
             landed: Callable[[], T | None] | None = None, on_wait: Callable[[str], object] | None = None,
             **kwargs) -> T:
    """`fn(*args, **kwargs)` now, retried with backoff while its failure is transient, for up to
    RLHF_MLFLOW_RETRY_S; then TrackingUnavailable naming the server and `what`. Other failures raise as they are.

    `landed`, for a call that creates something: a try that timed out may have been done by the server with
    its reply lost, and a second try would then fail (RESOURCE_ALREADY_EXISTS) or make a duplicate. So after a
    transient failure `landed()` is asked first; what it finds (not None) is what the failed try made.
    `on_wait`: where the one line saying that it waits goes (a warning of this module's logger by default)."""
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
                said = server_says(getattr(fn, "__self__", None))
                raise TrackingUnavailable(f"MLflow at {where} did not answer within {retry_seconds():.0f} s "
                                          f"({RETRY_ENV}; {cause}{said}): {what} not done", cause) from err
            if not warned:
                (on_wait or log.warning)(f"MLflow at {where}: {what} failed ({_describe(err)}); retried until it "
                                         f"answers (up to {retry_seconds():.0f} s, {RETRY_ENV})")
                warned = True
        time.sleep(min(delay, max(give_up_at - time.monotonic(), 0)))
        delay = min(delay * 2, MAX_BACKOFF_S)


OUTAGES_TAG = "rlhf.tracking_outages"  # the outages a run's writes met, each drained with nothing lost (JSON)
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


def retrying_client(root: str | Path = "."):
    """The store's client for calls that must happen now, reads included: on a tracking server every call
    retried through an outage as the stages' writes are (RetryingClient), else the local store's plain client."""
    uri = tracking_uri(root)
    return RetryingClient(get_client(root), redact(uri)) if is_remote(uri) else get_client(root)


def registered_model_or_none(client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def server_says(client) -> str:
    """What a tracking server that keeps failing says when asked once, without retries: "; the server says:
    its database does not answer (TEMPORARILY_UNAVAILABLE: ...)" for a server up whose database is down, else
    ''. (A client's retries give up on a 5xx without reading its body, which names the cause.)"""
    uri = getattr(client, "tracking_uri", None) or getattr(getattr(client, "_client", None), "tracking_uri", None)
    if not isinstance(uri, str) or not uri.startswith(("http://", "https://")):
        return ""
    try:
        from mlflow.utils.credentials import get_default_host_creds
        from mlflow.utils.rest_utils import http_request

        answer = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/experiments/search", "GET",
                              params={"max_results": 1}, max_retries=0, raise_on_status=False, timeout=10)
        if answer.status_code < 500:
            return ""
        body = answer.json()
    except Exception:  # not answering at all, or not JSON: the failure already says it
        return ""
    message = re.sub(r"(\w+://)[^/@\s]+@", r"\1", " ".join(str(body.get("message", "")).split()))[:300]
    database = "OperationalError" in message or "database" in message.lower()
    return (f"; the server says: {'its database does not answer ' if database else ''}"
            f"({body.get('error_code', answer.status_code)}: {message})")


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

    def __init__(self, run_id: str, server: str, tracker: MlflowTracker):
        self.run_id, self.server, self._tracker = run_id, server, tracker
        self._queue: deque[Write] = deque()
        self._cond = threading.Condition()
        self._busy = False  # a write is being sent
        self._closing = False
        self._stopped = False  # the deadline passed: no new send starts
        self._give_up_at = math.inf
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None  # monotonic time of the outage's first failed send
        self._cause: Transient | None = None  # the outage's last failure
        self._failures = 0  # failed sends in this outage
        self._backlog = [0, 0]  # writes, metrics sent since the outage began
        self._outages: list[dict] = []  # the outages met and drained, for the run's tag OUTAGES_TAG

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

    def _outage_record(self) -> Write:
        """The run's tag OUTAGES_TAG: each outage it met, as JSON (how long, failed sends, the backlog sent)."""
        text = json.dumps(self._outages)
        return Write("the outage record", lambda: self._tracker.client.set_tag(self.run_id, OUTAGES_TAG, text))

    def drain(self, timeout_s: float) -> tuple[list[Write], Transient | None]:
        """Wait until every write is sent or `timeout_s` passes: (the writes not sent, the last failure). A send
        in flight at the deadline is waited for (MLflow's HTTP timeout bounds it): if it got through it is not
        reported unsent, so a rerun never sends it a second time."""
        with self._cond:
            self._closing = True
            self._give_up_at = time.monotonic() + timeout_s
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < self._give_up_at:
                self._cond.wait(timeout=0.5)
            self._stopped = True
            while self._busy:  # the write in flight: confirmed, or failed and still queued
                self._cond.wait(timeout=0.5)
            unsent = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            return unsent, self._cause

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._stopped:
                    if self._closing and (self._stopped or not self._queue):
                        return
                    self._cond.wait()
                write = self._queue[0]
                self._busy = True
            sent = self._send(write)
            with self._cond:
                if sent is not None and self._queue and self._queue[0] is write:
                    self._queue.popleft()  # sent, or refused for good (kept in refused); else it stays: not sent
                if sent:
                    self._tracker.sent.append(write.what)
                if self._down_since is not None and sent:
                    self._backlog[0] += 1
                    self._backlog[1] += write.metrics
                    if not self._queue:
                        down_s = time.monotonic() - self._down_since
                        log.warning("MLflow: the server takes metrics of run %s again after %.0f s and %d failed "
                                    "tries; backlog drained: %d batches (%d metrics) sent, none lost", self.run_id,
                                    down_s, self._failures, *self._backlog)
                        self._outages.append({"down_s": round(down_s, 1), "failed_sends": self._failures,
                                              "writes": self._backlog[0], "metrics": self._backlog[1]})
                        self._queue.append(self._outage_record())
                        self._down_since, self._failures, self._backlog = None, 0, [0, 0]
                self._busy = False
                self._cond.notify_all()

    def _send(self, write: Write) -> bool | None:
        """True: sent; False: refused for good (kept in the tracker's refused); None: still failing when the
        deadline came."""
        delay = 1.0
        while True:
            try:
                write.send()
                return True
            except Exception as err:
                cause = transient_cause(err)
                if cause is None:
                    self._tracker.refuse(write.what, err)
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
