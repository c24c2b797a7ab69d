"""Servers the user named, checked before anything runs: `PREFECT_API_URL` and an http(s) `MLFLOW_TRACKING_URI`.

One short request each (no client retries: MLflow's would take minutes to give up), with the credentials the
clients would send (`PREFECT_API_AUTH_STRING`; `MLFLOW_TRACKING_USERNAME`/`PASSWORD` or `MLFLOW_TRACKING_TOKEN`).
A server that is wrong fails at once, in one message naming the variable, the URL (without any user:password in
it) and what to do: it refuses those credentials (401/403), or answers but not as MLflow does. A tracking server
that cannot answer for now (connection refused, a timeout, HTTP 5xx or 429: tasks/execution/transient.py, as for
the stages' writes) is waited for, saying so, up to RLHF_MLFLOW_RETRY_S, the limit of the writes' retries: a
server that is restarting as `rlhf run` starts does not fail the run. Unset variables are the local defaults:
nothing to check.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

from tasks.execution.transient import redact

TIMEOUT_ENV = "RLHF_SERVER_CHECK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0


class ServerUnreachable(RuntimeError):
    """A server the environment names cannot be used."""


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ServerUnreachable(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None


def _get(variable: str, url: str, fix: str, **kwargs):
    import httpx

    try:
        return httpx.get(url, timeout=_timeout(), follow_redirects=True, **kwargs)
    except httpx.HTTPError as err:
        raise ServerUnreachable(f"{variable}={redact(os.environ[variable])} is not reachable ({_said(err)}). "
                                f"{fix}") from None


def check_prefect() -> None:
    """PREFECT_API_URL answers, and accepts PREFECT_API_AUTH_STRING (its health check needs no credentials, so a
    read of the work pools says whether they are accepted)."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if not url:
        return
    if not url.startswith(("http://", "https://")):
        raise ServerUnreachable(f"PREFECT_API_URL={redact(url)}: expected an http(s) URL ending in /api, e.g. "
                                "http://127.0.0.1:4200/api")
    fix = "Start the server (`infra/stack.sh up`, `prefect server start`) or unset PREFECT_API_URL to run on a " \
          "temporary local server."
    base = url.rstrip("/")
    health = _get("PREFECT_API_URL", f"{base}/health", fix)
    if health.status_code != 200:
        raise ServerUnreachable(f"PREFECT_API_URL={redact(url)}: {base}/health answered HTTP {health.status_code}, "
                                f"not a Prefect API (it ends in /api). {fix}")
    auth = os.environ.get("PREFECT_API_AUTH_STRING", "")
    import httpx

    try:
        probe = httpx.post(f"{base}/work_pools/filter", json={"limit": 1}, timeout=_timeout(),
                           auth=tuple(auth.split(":", 1)) if ":" in auth else None)
    except httpx.HTTPError as err:
        raise ServerUnreachable(f"PREFECT_API_URL={redact(url)} stopped answering ({type(err).__name__}). {fix}") from None
    if probe.status_code in (401, 403):
        said = "refused PREFECT_API_AUTH_STRING" if auth else "needs credentials and PREFECT_API_AUTH_STRING is unset"
        raise ServerUnreachable(f"PREFECT_API_URL={redact(url)} {said} (HTTP {probe.status_code}): set "
                                "PREFECT_API_AUTH_STRING to the server's PREFECT_SERVER_API_AUTH_STRING (user:password).")


def check_mlflow(on_wait: Callable[[str], object] | None = None, wait: bool = True) -> None:
    """An http(s) MLFLOW_TRACKING_URI answers a search of experiments, as MLflow does, with the credentials MLflow
    would send; while it cannot answer for now, waited for (`on_wait` says so once; stderr by default), unless
    not `wait` (the run cannot start anyway: one try)."""
    import httpx

    from tasks.tracking.mlflow_store import TRACKING_ENV, tracking_enabled
    from tasks.tracking.mlflow_tracker import RETRY_ENV, TrackingUnavailable, retry_seconds, retrying

    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri or not tracking_enabled() or not uri.startswith(("http://", "https://")):
        return
    fix = f"Start the server (`infra/stack.sh up`), unset MLFLOW_TRACKING_URI for the local store, or set {TRACKING_ENV}=off."
    try:
        answer = retrying("a search of experiments", _search_experiments, uri, server=redact(uri),
                          on_wait=on_wait or _to_stderr) if wait else _search_experiments(uri)
    except TrackingUnavailable as err:
        raise ServerUnreachable(f"MLFLOW_TRACKING_URI={redact(uri)} is not reachable: no answer within "
                                f"{retry_seconds():.0f} s ({RETRY_ENV}; last: {err.transient}). {fix}") from None
    except httpx.HTTPError as err:  # not a failure a wait fixes (a malformed URL, a refused protocol)
        raise ServerUnreachable(f"MLFLOW_TRACKING_URI={redact(uri)} is not reachable ({_said(err)}). {fix}") from None
    if answer.status_code in (401, 403):
        said = "refused MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD" if _mlflow_auth() else \
            "needs credentials and MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD are unset"
        raise ServerUnreachable(f"MLFLOW_TRACKING_URI={redact(uri)} {said} (HTTP {answer.status_code}).")
    if answer.status_code != 200 or not _is_json_object(answer):
        got = f"HTTP {answer.status_code}" if answer.status_code != 200 else "HTTP 200 but not MLflow's JSON"
        raise ServerUnreachable(f"MLFLOW_TRACKING_URI={redact(uri)} answered {got} to a search of experiments: "
                                f"not an MLflow tracking server. {fix}")


def _search_experiments(uri: str):
    """One search of experiments, no client retries; an answer a wait may fix (5xx, 429) raised as an error."""
    import httpx

    answer = httpx.get(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search", params={"max_results": 1},
                       timeout=_timeout(), follow_redirects=True, **_mlflow_auth())
    if answer.status_code >= 500 or answer.status_code == 429:  # restarting, its database down, overloaded
        answer.raise_for_status()
    return answer


def _mlflow_auth() -> dict:
    """httpx's arguments for the credentials MLflow's client would send (none when unset)."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return {"auth": (user, password or "")} if user else {"headers": {"Authorization": f"Bearer {token}"}} if token \
        else {}


def _is_json_object(answer) -> bool:
    try:
        return isinstance(answer.json(), dict)
    except ValueError:
        return False


def _said(err: Exception) -> str:
    """The error in one line: its type and its words."""
    words = re.sub(r"\s+", " ", str(err)) or type(err).__name__
    return f"{type(err).__name__}: {words}"


def _to_stderr(line: str) -> None:
    print(f"waiting: {line}", file=sys.stderr, flush=True)


def check_servers() -> None:
    """Both checks; raises ServerUnreachable with every problem found, one per line."""
    problems = []
    for check in (check_prefect, lambda: check_mlflow(wait=not problems)):  # no wait when Prefect already failed
        try:
            check()
        except ServerUnreachable as err:
            problems.append(str(err))
    if problems:
        raise ServerUnreachable("\n".join(problems))
