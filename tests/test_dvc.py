"""`dvc repro` on the real dvc.yaml in a fresh git repo: runs every stage, then skips what is unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_pipeline import TINY

from tasks.common.params import deep_merge, parse_override

REPO = Path(__file__).resolve().parent.parent


def sh(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture
def dvc_repo(tmp_path, mlflow_db_template):
    shutil.copy(mlflow_db_template, tmp_path / "mlflow.db")  # git-ignored; stages track into it, nothing else
    for item in ("dvc.yaml", ".gitignore"):
        shutil.copy(REPO / item, tmp_path / item)
    for package in ("rlhf_core", "tasks"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for item in TINY:
        params = deep_merge(params, parse_override(item))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    sh("git", "init", "-q", cwd=tmp_path)
    sh("dvc", "init", "-q", cwd=tmp_path)
    sh("git", "add", "-A", cwd=tmp_path)
    sh("git", "commit", "-qm", "init", cwd=tmp_path)
    return tmp_path


@pytest.mark.slow
def test_repro_runs_skips_and_reruns_downstream(dvc_repo):
    sh("dvc", "repro", cwd=dvc_repo)
    assert json.loads((dvc_repo / "metrics" / "eval.json").read_text())["win_rate_rm"] >= 0
    assert json.loads((dvc_repo / "metrics" / "register.json").read_text())["version"] == 1, "tracked in mlflow.db"
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=dvc_repo)
    second = sh("dvc", "repro", cwd=dvc_repo)
    assert "Running stage" not in second, second

    experiment = sh("dvc", "exp", "run", "-S", "train.kl_coef=0.2", cwd=dvc_repo)
    assert yaml.safe_load((dvc_repo / "params.yaml").read_text())["train"]["kl_coef"] == 0.2
    ran = {stage for stage in ("prepare", "sft", "reward-model", "train", "evaluate", "register")
           if f"Running stage '{stage}'" in experiment}
    # register reruns only when the policy or its evaluation changed (one update at kl 0 may change neither)
    assert {"train", "evaluate"} <= ran <= {"train", "evaluate", "register"}, experiment
    shown = sh("dvc", "metrics", "show", "--json", cwd=dvc_repo)
    assert "win_rate_rm" in shown
