"""`rlhf serve`: the deployments prefect.yaml lists (the pipeline on demand and nightly, the sweep), served from this
process against the Prefect server at PREFECT_API_URL. One file describes them for both `rlhf serve` and
`prefect deploy`."""

from __future__ import annotations

from pathlib import Path

import yaml

PREFECT_YAML = "prefect.yaml"


def deployment_specs(root: str | Path) -> list[dict]:
    path = Path(root) / PREFECT_YAML
    specs = (yaml.safe_load(path.read_text()) or {}).get("deployments") or []
    if not specs:
        raise ValueError(f"{path}: no deployments listed")
    return specs


def flow_of(entrypoint: str):
    """The flow an entrypoint names, e.g. flows/sweep.py:rlhf_sweep."""
    import importlib

    path, _, name = entrypoint.partition(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def runner_deployments(root: str | Path) -> list:
    from prefect.schedules import Cron

    return [flow_of(spec["entrypoint"]).to_deployment(
        name=spec["name"], description=spec.get("description"), tags=spec.get("tags"),
        parameters=spec.get("parameters") or {}, concurrency_limit=spec.get("concurrency_limit"),
        schedules=[Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True))
                   for s in spec.get("schedules") or []])
        for spec in deployment_specs(root)]


def serve_deployments(root: str | Path) -> None:
    """Blocks, running each triggered or scheduled flow run in a subprocess, one at a time."""
    from prefect import serve

    serve(*runner_deployments(root), limit=1)
