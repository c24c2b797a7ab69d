"""Prefect settings for running here, set before prefect is imported (it reads them at import)."""

from __future__ import annotations

import os
from pathlib import Path


def use_local_prefect(root: str | Path) -> None:
    """No PREFECT_API_URL: a temporary local server whose state (runs, logs, artifacts) lives under the
    repo in .prefect/, where a later `prefect server start` finds it. Offline: no analytics."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_HOME", str(Path(root).resolve() / ".prefect"))
        # the temporary server starts in ~10 s; on a busy 2-core machine it can take longer than the default 20 s
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
