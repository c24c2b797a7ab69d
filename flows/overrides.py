"""A run's profile and `section.key=value` overrides, written into params.yaml the way `dvc exp run -S` does.

DVC decides what to rerun from params.yaml, so overrides must be in that file for the stages (and a later
`dvc repro` or `dvc status`) to see them. They stay there after the run, as with `dvc exp run`: the
workspace then matches dvc.lock, `dvc status` is clean, and `git diff params.yaml` shows what the run
changed. Each run also leaves a record under reports/runs/, so earlier overrides are never lost.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from rlhf_core.jsonio import write_json
from tasks.common.params import PARAMS_FILE, deep_merge, flatten, load_params, parse_override

RUNS_DIR = "reports/runs"


def _get(data: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _set(data, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[last] = value


def apply_overrides(root: str | Path, profile: str, overrides: list[str]) -> list[tuple[str, Any, Any]]:
    """Validate `profile` + `overrides`, then write them into params.yaml; returns (key, old, new) per change.

    Raises tasks.common.params.ParamsError (naming the key) before anything is written."""
    load_params(root, profile, list(overrides))
    wanted: dict = {}
    for item in overrides:
        wanted = deep_merge(wanted, parse_override(item))
    settings = {**flatten(wanted), "base.profile": profile}
    path = Path(root) / PARAMS_FILE
    current = yaml.safe_load(path.read_text()) or {}
    changes = [(key, _get(current, key), value) for key, value in settings.items() if _get(current, key) != value]
    if changes:
        from dvc.utils.serialize import modify_yaml  # what `dvc exp run -S` uses: keeps comments and layout

        with modify_yaml(path) as data:
            for key, _, value in changes:
                _set(data, key, value)
    return changes


def write_run_record(root: str | Path, record: dict) -> Path:
    """reports/runs/<started>-<run>.json: who ran what with which overrides, and how it ended."""
    started = record.setdefault("started", datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    path = Path(root) / RUNS_DIR / f"{started}-{str(record.get('flow_run_id', 'local'))[:8]}.json"
    write_json(path, record)
    return path
