"""Which failures a retry can fix, told by their type, never by the words of a log.

A failure is transient when its exception, or one in its chain (`raise ... from`, or raised while handling),
is one of:
- a refused or reset connection, or a name that did not resolve for now (the server is down or restarting);
- a timeout;
- an HTTP 5xx or 429 answer (the server is up but cannot serve now), including MLflow's own retries giving up
  on them and a tracking server's JSON error for a failing database;
- DVC's repository lock held by another DVC process.
Anything else (a bad key, a missing file, a bug, a refused request) fails the same way on every try.

`Transient` names the condition and, where the exception knows it, the server (scheme://host:port, no
credentials), so that a retry and the message that gives up both say what was down. An exception of ours that
gave up on a server carries its `Transient` as the attribute `transient`.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

_NETWORK_ERRNOS = {errno.ECONNREFUSED: "connection refused", errno.ECONNRESET: "connection reset",
                   errno.ECONNABORTED: "connection aborted", errno.ETIMEDOUT: "timed out",
                   errno.EHOSTUNREACH: "host unreachable", errno.ENETUNREACH: "network unreachable",
                   errno.EPIPE: "connection closed"}
# MLflow's error codes for "the server cannot serve now" (its names of HTTP 503, 429, 500 from the server)
_MLFLOW_UNAVAILABLE = {"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED", "INTERNAL_ERROR"}


@dataclass(frozen=True)
class Transient:
    """A failure a retry may fix: what happened, and to which server when known."""

    condition: str
    server: str | None = None

    def __str__(self) -> str:
        return f"{self.condition} ({self.server})" if self.server else self.condition


def chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and the exceptions behind it: causes, contexts, and urllib3's `reason`, each once."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        reason = getattr(err, "reason", None)  # urllib3's MaxRetryError keeps the last failure here
        err = err.__cause__ or err.__context__ or (reason if isinstance(reason, BaseException) else None)


def transient_cause(err: BaseException) -> Transient | None:
    """Why a retry may fix `err`, or None when it would fail again the same way."""
    errors = list(chain(err))
    marked = next((e.transient for e in errors if isinstance(getattr(e, "transient", None), Transient)), None)
    if marked is not None:  # an error of ours that knows it (TrackingUnavailable: a server that stayed down)
        return marked
    server = next(filter(None, map(_server_of, errors)), None)
    # the most telling first: the socket's own errno ("connection refused") before a library's "connection failed"
    for condition_of in (_os_condition, _condition, _library_condition):
        condition = next(filter(None, map(condition_of, errors)), None)
        if condition:
            return Transient(condition, server)
    return None


def _os_condition(e: BaseException) -> str | None:
    if isinstance(e, socket.gaierror) and e.errno == socket.EAI_AGAIN:
        return "temporary failure in name resolution"
    if isinstance(e, OSError) and e.errno in _NETWORK_ERRNOS:
        return _NETWORK_ERRNOS[e.errno]
    if isinstance(e, TimeoutError | socket.timeout):
        return "timed out"
    return None


def _condition(e: BaseException) -> str | None:
    status = _http_status(e)
    if status is not None and (status >= 500 or status == 429):
        return f"HTTP {status}"
    if type(e).__name__ == "LockError" and type(e).__module__.startswith("dvc"):
        return "DVC's lock is held by another DVC process"
    if type(e).__name__ == "RestException" and getattr(e, "json", {}).get("error_code") in _MLFLOW_UNAVAILABLE:
        return f"the server answered {e.json['error_code']}"  # a tracking server whose database is down
    return None


def _library_condition(e: BaseException) -> str | None:
    """The HTTP libraries' own types (requests, urllib3, httpx, botocore), when they are installed."""
    for module, names in (("requests.exceptions", ("ConnectionError", "Timeout", "RetryError")),
                          ("urllib3.exceptions", ("NewConnectionError", "ProtocolError", "TimeoutError",
                                                  "ResponseError")),
                          ("httpx", ("TransportError",)),
                          ("botocore.exceptions", ("HTTPClientError",))):
        try:
            types = tuple(getattr(__import__(module, fromlist=list(names)), name) for name in names)
        except (ImportError, AttributeError):
            continue
        if isinstance(e, types):
            if "Timeout" in type(e).__name__:
                return "timed out"
            if type(e).__name__ in {"RetryError", "ResponseError"}:
                return "the server kept answering with an error status (5xx or 429)"
            return "connection failed"
    return None


def _http_status(e: BaseException) -> int | None:
    """The status of an HTTP answer the exception carries (requests, httpx, botocore), or None."""
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    if status is None and isinstance(response, dict):  # botocore's ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _server_of(e: BaseException) -> str | None:
    """scheme://host:port of the request the exception is about, without credentials; None when unknown."""
    request = getattr(e, "request", None)
    url = getattr(request, "url", None) or getattr(e, "url", None)
    if isinstance(url, str) and "://" in url:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    pool = getattr(e, "pool", None) or getattr(e, "conn", None)  # urllib3
    host, port = getattr(pool, "host", None), getattr(pool, "port", None)
    return f"{host}:{port}" if host else None


def redact(url: str) -> str:
    """The URL without a user:password part."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
