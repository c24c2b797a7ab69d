"""Lineage of a run: which code (git commit, dirty flag), which pipeline state (dvc.lock) and which data
(md5 of the stage's data and model inputs) produced it, as MLflow tags."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from rlhf_core.jsonio import read_json_object
from tasks.dag.dvc_yaml import entry_paths, stage_entry
from tasks.parameters.params import PARAMS_FILE, RUN_PARAMS_NOTE


def file_md5(path: Path) -> str:
    """md5 of a file, or of a directory's sorted relative paths and file contents."""
    digest = hashlib.md5()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _git_raw(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _git(root: Path, *args: str) -> str | None:
    out = _git_raw(root, *args)
    return None if out is None else out.strip()


def _run_own_params_edit(root: Path) -> bool:
    """Whether params.yaml differs from git HEAD only by what `rlhf run` wrote into it for this run (its
    profile and overrides, recorded in the run's note): the committed file plus the run's parameters."""
    note = read_json_object(root / RUN_PARAMS_NOTE)
    if not note or not (root / PARAMS_FILE).is_file():
        return False
    committed = _git_raw(root, "show", f"HEAD:{PARAMS_FILE}")
    return committed == note.get("original") and (root / PARAMS_FILE).read_text() == note.get("written")


def lineage_tags(root: str | Path, profile: str) -> dict[str, str]:
    """Git commit and dirty flag of the code, the profile, and the md5 of dvc.lock."""
    root = Path(root).resolve()
    commit = _git(root, "rev-parse", "HEAD")
    # dvc.lock and metrics/ change as a consequence of running, and params.yaml by a run's own overrides (they
    # are in the run's params and tags); anything else uncommitted changes what runs
    excluded = [":(exclude)dvc.lock", ":(exclude)metrics"]
    if _run_own_params_edit(root):
        excluded.append(f":(exclude){PARAMS_FILE}")
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded)
    tags = {"rlhf.profile": profile, "rlhf.git_commit": commit or "unknown",
            "rlhf.git_dirty": "unknown" if status is None else str(bool(status)).lower()}
    if commit:
        tags["mlflow.source.git.commit"] = commit
    lock = root / "dvc.lock"
    if lock.is_file():
        tags["rlhf.dvc_lock_md5"] = file_md5(lock)
    return tags


def data_hashes(root: str | Path, name: str) -> dict[str, str]:
    """md5 of the stage's data and model inputs (its dvc.yaml deps under data/ and models/); code inputs
    are covered by the git commit."""
    root = Path(root)
    return {f"rlhf.data.{dep}": file_md5(root / dep) for dep in entry_paths(stage_entry(root, name), "deps")
            if dep.startswith(("data/", "models/")) and (root / dep).exists()}

