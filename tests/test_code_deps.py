"""dvc.yaml's code deps cannot go stale: they are generated from the stages' imports, every module a stage
loads is one of them, and editing one makes `dvc status` report the stages that run it."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.dag.code_deps import PACKAGES, RUNNER, closure, stage_code_deps, stale
from tasks.dag.dvc_yaml import entry_paths, load_stages
from tasks.dag.stage_modules import STAGES

ROOT = Path(__file__).resolve().parent.parent
DVC = (sys.executable, "-m", "dvc")  # this venv's DVC, whatever is on PATH
LOADED = """
import importlib, json, sys
importlib.import_module({runner!r}); importlib.import_module({module!r})
print(json.dumps(sorted(getattr(m, "__file__", None) or "" for n, m in list(sys.modules.items())
                        if n.split(".")[0] in {packages!r})))
"""


@functools.cache  # a stage's imports do not change within a session; two tests read them (~50 s of imports)
def loaded_files(stage: str) -> frozenset[str]:
    """Project source files a fresh interpreter has loaded after importing the stage the way `rlhf stage` does."""
    code = LOADED.format(runner=RUNNER, module=STAGES[stage], packages=PACKAGES)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return frozenset(Path(f).resolve().relative_to(ROOT).as_posix() for f in json.loads(out) if f)


def test_dvc_yaml_code_deps_are_the_generated_ones():
    assert stale(ROOT / "dvc.yaml") == {}, "run `make dvc-deps` and commit dvc.yaml"


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_project_module_a_stage_loads_is_among_its_deps(stage):
    deps = set(entry_paths(load_stages(ROOT / "dvc.yaml")[stage], "deps"))
    assert loaded_files(stage) - deps == set()


def test_function_level_imports_count():
    """train imports its plots inside a function (matplotlib only when a trace is due): still a dep."""
    assert "tasks.reports.plots" in closure([STAGES["train"]])
    assert "tasks/reports/plots.py" in stage_code_deps("train")
    assert "rlhf_core/rl_trainer.py" not in stage_code_deps("prepare"), "only what a stage imports"


def _workspace(tmp_path: Path) -> Path:
    """The repo's code, dvc.yaml and params.yaml in a fresh git + DVC repo, every data/model dep and output a
    placeholder, and dvc.lock recorded by `dvc commit` (no stage runs)."""
    for item in ("dvc.yaml", "params.yaml", ".gitignore"):
        shutil.copy(ROOT / item, tmp_path / item)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    for stage in load_stages(tmp_path / "dvc.yaml").values():
        for path in entry_paths(stage, "deps", "outs", "metrics", "plots"):
            target = tmp_path / path
            if target.exists():
                continue
            if target.suffix:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text("{}\n")
            else:
                target.mkdir(parents=True)
                (target / "placeholder").write_text("x\n")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], [*DVC, "init", "-q"], [*DVC, "commit", "-f", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    return tmp_path


def _changed_stages(repo: Path) -> set[str]:
    out = subprocess.run([*DVC, "status", "--json"], cwd=repo, capture_output=True, text=True, check=True,
                         env={**os.environ, "DVC_NO_ANALYTICS": "1"}).stdout
    return set(json.loads(out))


@pytest.mark.slow
def test_editing_a_module_makes_dvc_status_report_the_stages_that_run_it(tmp_path):
    repo = _workspace(tmp_path)
    assert _changed_stages(repo) == set(), "placeholders committed: nothing changed yet"
    users = {stage: loaded_files(stage) | set(stage_code_deps(stage)) for stage in STAGES}
    for module in ("rlhf_core/ops.py", "rlhf_core/world/gold.py", "rlhf_core/batching.py",
                   "tasks/checks/gx_suites.py", "tasks/reports/plots.py", "tasks/stages/register.py",
                   "tasks/parameters/params.py"):
        path = repo / module
        original = path.read_text()
        path.write_text(original + "\n# an edit\n")
        expected = {stage for stage, files in users.items() if module in files}
        assert expected, f"{module} is run by some stage"
        assert _changed_stages(repo) == expected, module
        path.write_text(original)
    assert _changed_stages(repo) == set()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES)
