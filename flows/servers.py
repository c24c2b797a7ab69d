"""Servers the user named, checked before anything runs: `PREFECT_API_URL` and an http(s) `MLFLOW_TRACKING_URI`.

One short request each (no client retries: MLflow's would take minutes to give up), with the credentials the
clients would send (`PREFECT_API_AUTH_STRING`; `MLFLOW_TRACKING_USERNAME`/`PASSWORD` or `MLFLOW_TRACKING_TOKEN`).
A server that does not answer, or refuses those credentials, is one message naming the variable, the URL
(without any user:password in it) and what to do. Unset variables are the local defaults: nothing to check.
"""

from __future__ import annotations

import os
import re

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
        reason = re.sub(r"\s+", " ", str(err)) or type(err).__name__
        raise ServerUnreachable(f"{variable}={redact(os.environ[variable])} is not reachable ({type(err).__name__}: "
                                f"{reason}). {fix}") from None


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


def check_mlflow() -> None:
    """An http(s) MLFLOW_TRACKING_URI answers a search of experiments with the credentials MLflow would send."""
    from tasks.tracking.mlflow_store import TRACKING_ENV, tracking_enabled

    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if not uri or not tracking_enabled() or not uri.startswith(("http://", "https://")):
        return
    fix = f"Start the server (`infra/stack.sh up`), unset MLFLOW_TRACKING_URI for the local store, or set {TRACKING_ENV}=off."
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    kwargs = {"auth": (user, password or "")} if user else {"headers": {"Authorization": f"Bearer {token}"}} if token else {}
    answer = _get("MLFLOW_TRACKING_URI", f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/search",
                  fix, params={"max_results": 1}, **kwargs)
    if answer.status_code in (401, 403):
        said = "refused MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD" if user or token else \
            "needs credentials and MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD are unset"
        raise ServerUnreachable(f"MLFLOW_TRACKING_URI={redact(uri)} {said} (HTTP {answer.status_code}).")
    if answer.status_code != 200:
        raise ServerUnreachable(f"MLFLOW_TRACKING_URI={redact(uri)} answered HTTP {answer.status_code} to a search of "
                                f"experiments: not an MLflow tracking server? {fix}")


def check_servers() -> None:
    """Both checks; raises ServerUnreachable with every problem found, one per line."""
    problems = []
    for check in (check_prefect, check_mlflow):
        try:
            check()
        except ServerUnreachable as err:
            problems.append(str(err))
    if problems:
        raise ServerUnreachable("\n".join(problems))
