"""A run's profile and `section.key=value` overrides: in params.yaml for the run, restored after it.

DVC decides what to rerun from params.yaml, so overrides must be in that file while the stages run. They
are per run, not sticky: when the run ends (finished, failed or interrupted) params.yaml is put back byte
for byte, so a later plain run uses the parameters the user wrote, not the previous run's overrides. (Kept
as DVC experiments instead, each run would have to be one `dvc exp run`: one process for all stages, no
Prefect task per stage; and `dvc exp run` also leaves the overrides in the workspace's params.yaml.)
A run killed before it could restore the file leaves a note in .dvc/tmp/; the next run restores from it. A
note while another process holds the workspace lock (flows/lock.py) is a live run's, not an interrupted one's.

The edit goes through ruamel.yaml, round trip: comments, quotes, flow mappings and line layout stay as
written (DVC's own writer rewrapped long lines and unquoted "no", which PyYAML then reads as False).
Every run leaves a record under reports/runs/, so its overrides are never lost.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from rlhf_core.jsonio import read_json_object, write_json
from rlhf_core.sources import LOCAL_SUFFIXES, SourceError, check_dataset_folder
from tasks.checks.model_checks import check_lora_settings
from tasks.parameters.params import (
    PARAMS_FILE,
    PROFILES_DIR,
    RUN_PARAMS_NOTE,
    Params,
    ParamsError,
    deep_merge,
    dotted,
    flatten,
    load_params,
    parse_override,
)

RUNS_DIR = "reports/runs"
RESTORE_NOTE = RUN_PARAMS_NOTE  # {"original": text, "written": text} while a run has them
SOURCE_ONLY = ("prepare.sft", "prepare.preferences", "prepare.prompts", "prepare.eval_fraction")  # not the world's


def _round_trip_yaml():
    from ruamel.yaml import YAML

    rt = YAML()  # round trip: keeps comments, quotes and flow style
    rt.preserve_quotes = True
    rt.width = 4096  # never rewrap a line
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return rt


def _yaml_value(value: Any) -> Any:
    """A string PyYAML would read back as something else ("no", "1e-3", "null") is written quoted."""
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    if isinstance(value, str) and yaml.safe_load(value) != value:
        return DoubleQuotedScalarString(value)
    return value


def edited_yaml(text: str, settings: dict[str, Any]) -> str:
    """`text` with each dotted key set to its value; every other line as it was."""
    rt = _round_trip_yaml()
    data = rt.load(text) or {}
    for key, value in settings.items():
        *parents, last = key.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = _yaml_value(value)
    out = io.StringIO()
    rt.dump(data, out)
    return out.getvalue()


def check_run_inputs(params: Params, root: str | Path, overrides: list[str]) -> None:
    """What the stages cannot check before DVC deletes their outputs: an override the data source ignores,
    and a local source file that is not there. ParamsError naming every such key."""
    prepare, errors = params.prepare, []
    for key in (item.partition("=")[0] for item in overrides):
        if prepare.source == "world" and key in SOURCE_ONLY:
            errors.append(f"{key}: read only when prepare.source is not 'world' (it is 'world'); set "
                          f"prepare.source too, e.g. --set prepare.source=files")
        elif prepare.source != "world" and key.startswith("prepare.world."):
            errors.append(f"{key}: read only when prepare.source is 'world' (it is {prepare.source!r})")
    if prepare.source != "world":
        errors += [f"prepare.{name}: required when prepare.source is {prepare.source!r}"
                   for name in ("sft", "preferences") if not getattr(prepare, name)]
        errors += [f"prepare.{name}: {value}: no such file or directory (in {Path(root).resolve()})"
                   for name in ("sft", "preferences", "prompts") if (value := getattr(prepare, name))
                   and _looks_local(value) and not (Path(root) / value).exists()]
        errors += _confinement_errors(prepare, root)
    if errors:
        raise ParamsError("invalid parameters for this run:\n  " + "\n  ".join(errors))
    check_lora_settings(params, root, planned=True)  # before sft and reward-model spend minutes
    if params.runtime.launcher == "ray":  # a cluster that does not answer fails the run, not its first model stage
        from tasks.execution.ray_launch import ClusterUnreachable, check_cluster

        try:
            check_cluster(params.runtime)
        except ClusterUnreachable as err:
            raise ParamsError(str(err)) from None


def _confinement_errors(prepare, root: str | Path) -> list[str]:
    """A local dataset folder whose card or saved state names files outside it (rlhf_core.sources), per key."""
    errors = []
    for name in ("sft", "preferences", "prompts"):
        folder = Path(root) / value if (value := getattr(prepare, name)) else None
        if folder is not None and folder.is_dir():
            try:
                check_dataset_folder(folder)
            except SourceError as err:
                errors.append(f"prepare.{name}: {err}")
    return errors


def _looks_local(source: str) -> bool:
    """A path, not a hub id: as rlhf_core.sources.load_rows tells them apart."""
    return source.startswith((".", "/")) or Path(source).suffix in LOCAL_SUFFIXES


def planned_changes(root: str | Path, profile: str, overrides: list[str]) -> list[tuple[str, Any, Any]]:
    """Validate `profile` + `overrides` (ParamsError naming the key, a missing source file, an override the
    source ignores) and return the (key, old, new) changes they make to params.yaml."""
    params = load_params(root, profile, list(overrides))
    check_run_inputs(params, root, overrides)
    wanted: dict = {}
    for item in overrides:
        wanted = deep_merge(wanted, parse_override(item))
    # The profile's values go into params.yaml for the run too: DVC tracks params.yaml alone, so an edit of
    # profiles/<name>.yaml reruns exactly the stages whose params sections it changes (the stages apply the
    # same profile over params.yaml again: the values they read are the same).
    profile_values = flatten(yaml.safe_load((Path(root) / PROFILES_DIR / f"{profile}.yaml").read_text()) or {}
                             ) if profile != "demo" else {}
    profile_values.pop("base.profile", None)
    settings = {**profile_values, **flatten(wanted), "base.profile": profile}
    # the stages apply the profile over params.yaml: name the overridden keys it sets, so they keep the run's value
    if outranked := sorted(key for key in flatten(wanted) if key in profile_values):
        settings["base.run_overrides"] = outranked
    current = yaml.safe_load((Path(root) / PARAMS_FILE).read_text()) or {}
    return [(key, dotted(current, key), value) for key, value in settings.items() if dotted(current, key) != value]


@contextmanager
def overrides_applied(root: str | Path, profile: str, overrides: list[str]) -> Iterator[list[tuple[str, Any, Any]]]:
    """params.yaml with the run's overrides while the block runs, as it was afterwards; yields the changes.

    Raises tasks.parameters.params.ParamsError before anything is written."""
    root = Path(root)
    changes = planned_changes(root, profile, overrides)
    if not changes:
        yield changes
        return
    path, note = root / PARAMS_FILE, root / RESTORE_NOTE
    original = path.read_text()
    written = edited_yaml(original, {key: new for key, _, new in changes})
    write_json(note, {"original": original, "written": written})
    path.write_text(written)
    try:
        yield changes
    finally:
        _restore(path, note)


def _restore(path: Path, note: Path) -> str | None:
    """Put params.yaml back as the note says it was; a message when it cannot, None when done."""
    saved = read_json_object(note)
    if saved is None:
        return None
    message = None
    if path.read_text() == saved["written"]:
        path.write_text(saved["original"])
    else:  # edited by hand during the run: the user's edit wins
        message = (f"{path} changed during the run; left as it is. Before the run it was:\n"
                   f"{saved['original']}")
    note.unlink()
    return message


def restore_after_killed_run(root: str | Path) -> str | None:
    """A run killed before it restored params.yaml left its note: restore now. A message saying what was
    done, or None when there was nothing to do."""
    from flows.lock import held_by_another

    path, note = Path(root) / PARAMS_FILE, Path(root) / RESTORE_NOTE
    if not note.is_file() or held_by_another(root):  # a run in progress holds its overrides: it restores them
        return None
    return _restore(path, note) or f"{path}: restored; an interrupted run had left its overrides in it"


def local_edits(root: str | Path) -> list[tuple[str, Any, Any]]:
    """(key, committed, now) for each value of params.yaml that differs from the committed file (git HEAD);
    empty outside git or when the file is not committed."""
    try:
        committed = subprocess.run(["git", "show", f"HEAD:{PARAMS_FILE}"], cwd=root, capture_output=True,
                                   text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if committed.returncode != 0:
        return []
    before = flatten(yaml.safe_load(committed.stdout) or {})
    now = flatten(yaml.safe_load((Path(root) / PARAMS_FILE).read_text()) or {})
    return [(key, before.get(key), now.get(key)) for key in sorted(set(before) | set(now))
            if before.get(key) != now.get(key)]


def write_run_record(root: str | Path, record: dict) -> Path:
    """reports/runs/<started>-<run>.json: who ran what with which overrides, and how it ended."""
    started = record.setdefault("started", datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    path = Path(root) / RUNS_DIR / f"{started}-{str(record.get('flow_run_id', 'local'))[:8]}.json"
    write_json(path, record)
    return path


def save_experiment(root: str | Path, name: str) -> str:
    """`dvc exp save --name NAME --force`: the workspace as this run left it (params.yaml with the run's
    overrides, dvc.lock, metrics/, the outputs in DVC's cache) as a DVC experiment, so `dvc exp show` and
    `rlhf exps` pair the run's params with its results after params.yaml is restored. The workspace is left
    as it is. Returns the experiment's name; raises ExperimentNotSaved with DVC's message."""
    import sys

    root = Path(root)
    try:
        # metrics/ written by a first run is untracked: the experiment holds it (git-ignored files stay out)
        untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", "metrics",
                                    "dvc.lock"], cwd=root, capture_output=True, text=True, timeout=60).stdout.split()
        include = [arg for path in untracked for arg in ("--include-untracked", path)]
        proc = subprocess.run([sys.executable, "-m", "dvc", "exp", "save", "--quiet", "--force", "--name", name,
                               *include], cwd=root, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ExperimentNotSaved(f"not saved as a DVC experiment: {err}") from None
    if proc.returncode != 0:
        raise ExperimentNotSaved(f"not saved as a DVC experiment: {(proc.stderr or proc.stdout).strip()[-500:]}")
    return name


class ExperimentNotSaved(RuntimeError):
    """`dvc exp save` refused (no git commit yet, no git identity...): the run's results are still in the
    workspace, MLflow and reports/runs/."""


def experiment_name(run_name: str, started: str) -> str:
    """A git-ref-safe DVC experiment name: the run's (profile, algorithm, overrides, start time), e.g.
    demo-ppo-kl_coef-0-07-1126-150207; a name without the start time (no Prefect run) gets `started`'s."""
    name = run_name if re.search(r"\d{4}-\d{6}(-\d+)?$", run_name) else f"{run_name}-{started[4:15]}"
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower()


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, old, new in changes)
