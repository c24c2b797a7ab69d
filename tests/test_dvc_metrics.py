"""`dvc metrics diff` as the README shows it works in a clone: every DVC metric dvc.yaml declares is a file git
keeps, and the registry's verdict (git-ignored, this clone's own) is no metric of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DVC = [sys.executable, "-m", "dvc"]


def declared(stage: dict, kind: str) -> list[str]:
    return [next(iter(item)) if isinstance(item, dict) else item for item in stage.get(kind) or []]


def test_every_dvc_metric_is_a_file_git_keeps():
    """metrics/register.json was a DVC metric and git-ignored at 2a5c0fd."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    metrics = [path for stage in stages.values() for path in declared(stage, "metrics")]
    assert "metrics/eval.json" in metrics and "metrics/register.json" in declared(stages["register"], "outs")
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *metrics], cwd=REPO, capture_output=True, text=True)
    assert ignored.stdout.split() == [], f"DVC metrics that git ignores: {ignored.stdout.split()}"


def test_metrics_diff_after_a_clean_repro_in_a_fresh_clone(tmp_path):
    """A repro in a clone whose cache lacks the committed register.json (a fresh clone, or another machine's
    commit): `dvc metrics diff` printed "DVC failed to load some metrics for following revisions: 'HEAD'" and its
    only row was metrics/register.json. The stages here write their files as the real ones do, declared as
    dvc.yaml declares them, with this repository's .gitignore."""
    real = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    write = "import json, random; json.dump({key!r}, open({path!r}, 'w'))"
    stages = {
        "evaluate": {"cmd": f"{sys.executable} -c \"import os; os.makedirs('metrics', exist_ok=True); "
                            f"{write.format(key={'win_rate_gold': 0.9}, path='metrics/eval.json')}\"",
                     "metrics": real["evaluate"]["metrics"]},
        "register": {**{k: v for k, v in real["register"].items() if k not in ("cmd", "deps", "params")},
                     "cmd": f"{sys.executable} -c \"import json, random; "
                            "json.dump({'version': random.randint(1, 10**6)}, open('metrics/register.json', 'w'))\"",
                     "deps": ["metrics/eval.json"]}}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "DVC_NO_ANALYTICS": "1"})
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    run("git", "init", "-q")
    run(*DVC, "init", "-q")
    run(*DVC, "repro", "-q")
    run("git", "add", "-A")
    run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a run")
    shutil.rmtree(tmp_path / ".dvc" / "cache")  # as a fresh clone: committed files only, no cache
    run(*DVC, "repro", "-q")  # register runs again, as it does in a fresh clone
    diff = run(*DVC, "metrics", "diff")
    assert "failed to load" not in diff.stderr + diff.stdout, diff.stderr
    assert "register.json" not in diff.stdout, diff.stdout
    changed = tmp_path / "metrics" / "eval.json"
    changed.write_text('{"win_rate_gold": 0.95}')
    diff = run(*DVC, "metrics", "diff")
    assert "metrics/eval.json" in diff.stdout and "0.95" in diff.stdout and "failed" not in diff.stderr, diff
