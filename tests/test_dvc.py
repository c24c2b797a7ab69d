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

from tasks.parameters.params import deep_merge, parse_override
from tasks.reports.offline_plots import TEMPLATE, template_html

REPO = Path(__file__).resolve().parent.parent


def sh(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def make_repo(root: Path, mlflow_db: Path) -> Path:
    """The repo's dvc.yaml, code and shrunken params in a fresh git + DVC repo at `root`, committed."""
    root.mkdir(parents=True)
    shutil.copy(mlflow_db, root / "mlflow.db")  # git-ignored; stages track into it, nothing else
    for item in ("dvc.yaml", ".gitignore"):
        shutil.copy(REPO / item, root / item)
    for package in ("rlhf_core", "tasks"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for item in TINY:
        params = deep_merge(params, parse_override(item))
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    sh("git", "init", "-q", cwd=root)
    sh("dvc", "init", "-q", cwd=root)
    for item in ("config", "offline-plots.html"):  # `dvc plots show` offline (tasks/reports/offline_plots.py)
        shutil.copy(REPO / ".dvc" / item, root / ".dvc" / item)
    sh("git", "add", "-A", cwd=root)
    sh("git", "commit", "-qm", "init", cwd=root)
    return root


@pytest.fixture(scope="module")
def reproduced(tmp_path_factory, mlflow_db_template) -> Path:
    """`dvc repro` of the whole pipeline, run once for this module, and its results committed with
    `git add -A` as a user would (dvc.lock, and metrics/: git-tracked, not ignored)."""
    root = make_repo(tmp_path_factory.mktemp("dvc") / "repo", mlflow_db_template)
    sh("dvc", "repro", cwd=root)
    sh("git", "add", "-A", cwd=root)
    sh("git", "commit", "-qm", "run", cwd=root)
    return root


@pytest.fixture
def dvc_repo(reproduced, tmp_path) -> Path:
    """A copy of the reproduced repo (git, DVC cache, outputs, mlflow.db) for one test to change."""
    return Path(shutil.copytree(reproduced, tmp_path / "repo", symlinks=True))


def test_the_offline_plots_template_is_current():
    """.dvc/offline-plots.html is what tasks/reports/offline_plots.py writes from the installed vl-convert-python:
    DVC fills it with the charts, and it holds Vega, Vega-Lite and Vega-Embed themselves."""
    assert TEMPLATE.read_text() == template_html(), "run: python -m tasks.reports.offline_plots"
    assert "{plot_divs}" in template_html() and "{scripts}" not in template_html(), "no CDN tag from DVC"


def test_repro_runs_skips_and_reruns_downstream(dvc_repo):
    assert json.loads((dvc_repo / "metrics" / "eval.json").read_text())["win_rate_rm"] >= 0
    assert json.loads((dvc_repo / "metrics" / "register.json").read_text())["version"] == 1, "tracked in mlflow.db"
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=dvc_repo)
    second = sh("dvc", "repro", cwd=dvc_repo)
    assert "Running stage" not in second, second

    # (not kl_coef: the shrunken world trains one update, whose rollouts come from the reference itself, so
    # its KL is 0 and kl_coef changes nothing; DVC rightly reruns train alone)
    experiment = sh("dvc", "exp", "run", "-S", "train.learning_rate=0.001", cwd=dvc_repo)
    assert yaml.safe_load((dvc_repo / "params.yaml").read_text())["train"]["learning_rate"] == 0.001
    ran = {stage for stage in ("prepare", "sft", "reward-model", "train", "evaluate", "register")
           if f"Running stage '{stage}'" in experiment}
    # register reruns only when the policy or its evaluation changed (one update at kl 0 may change neither)
    assert {"train", "evaluate"} <= ran <= {"train", "evaluate", "register"}, experiment
    shown = sh("dvc", "metrics", "show", "--json", cwd=dvc_repo)
    assert "win_rate_rm" in shown
    # the experiment against the commit: DVC reads the committed metrics from git
    diff = json.loads(sh("dvc", "metrics", "diff", "--json", cwd=dvc_repo))
    assert "loss/policy_avg" in diff["metrics/train.json"] and "mean_kl" in diff["metrics/eval.json"], diff
    experiments = json.loads(sh("dvc", "exp", "show", "--json", cwd=dvc_repo))
    baseline = next(e for e in experiments if e["rev"] != "workspace")
    assert baseline["experiments"], "the experiment is listed under its baseline commit"
    # `rlhf exps`: the same rows, readable (dvc exp show has every param and metric, each cut to "…")
    view = sh("rlhf", "exps", cwd=dvc_repo).splitlines()
    header = view[0].split()
    assert header[:4] == ["experiment", "created", "profile", "algo"] and "learning_rate" in header, view
    assert {"win_gold", "win_rm", "eval_kl"} <= set(header) and len(header) <= 16, header
    assert max(map(len, view)) <= 100, "\n".join(view)
    [exp_row] = [line.split() for line in view[1:] if line.startswith("  ")]
    assert exp_row[header.index("learning_rate")] == "0.001", view
    for row in (baseline, *(run["revs"][0] for run in baseline["experiments"])):
        metrics = row["data"]["metrics"]
        assert {"metrics/train.json", "metrics/eval.json"} <= set(metrics), row["rev"]
        assert "win_rate_rm" in metrics["metrics/eval.json"]["data"], row["rev"]


def test_metrics_diff_and_exp_show_read_the_committed_metrics(dvc_repo):
    """metrics/ is in git: a fresh clone's HEAD has every stage's metrics for `dvc metrics diff`/`exp show`."""
    committed = set(sh("git", "ls-files", "metrics", cwd=dvc_repo).split())
    stages = ("prepare", "validate", "sft", "reward", "inspect", "train", "eval")
    assert {f"metrics/{name}.json" for name in stages} | {"metrics/train_history.json"} <= committed, committed
    # the registry's verdict is this machine's: a fresh clone runs register instead of finding it up to date
    assert "metrics/register.json" not in committed
    sh("git", "check-ignore", "metrics/register.json", cwd=dvc_repo)
    unchanged = json.loads(sh("dvc", "metrics", "diff", "--json", cwd=dvc_repo))
    unchanged.pop("metrics/register.json", None)  # not at HEAD by design: this machine's registry verdict
    assert unchanged == {}, "nothing changed"
    evaluation = dvc_repo / "metrics" / "eval.json"
    before = json.loads(evaluation.read_text())
    evaluation.write_text(json.dumps({**before, "win_rate_rm": before["win_rate_rm"] + 0.25}))
    diff = json.loads(sh("dvc", "metrics", "diff", "--json", cwd=dvc_repo))
    assert diff["metrics/eval.json"]["win_rate_rm"]["old"] == before["win_rate_rm"], diff
    everything = json.loads(sh("dvc", "metrics", "diff", "--all", "--json", cwd=dvc_repo))
    assert {f"metrics/{name}.json" for name in stages} - {"metrics/register.json"} <= set(everything), everything
    assert "objective/scores" in everything["metrics/train.json"]
    head = next(e for e in json.loads(sh("dvc", "exp", "show", "--json", cwd=dvc_repo)) if e["rev"] != "workspace")
    assert head["data"]["metrics"]["metrics/eval.json"]["data"]["win_rate_rm"] == before["win_rate_rm"], head


def test_plots_show_draws_the_train_history_and_the_pngs_offline(dvc_repo):
    history = json.loads((dvc_repo / "metrics" / "train_history.json").read_text())
    assert [row["update"] for row in history] == [1] and not any(k.startswith("time/") for k in history[0])
    shown = json.loads(sh("dvc", "plots", "show", "--json", cwd=dvc_repo))["data"]
    # by title: train's KL chart is a stage plot (what keeps train in DVC's run cache), keyed by its file
    titles = {key: plot[0]["content"].get("title") for key, plot in shown.items() if plot[0]["type"] == "vega"}
    charts = {title.get("text") if isinstance(title, dict) else title: shown[key][0] for key, title in titles.items()}
    assert set(charts) == {"Reward over updates", "KL over updates", "Response length over updates"}, shown.keys()
    assert "objective/scores" in json.dumps(charts["Reward over updates"]["content"])
    assert "objective/kl" in json.dumps(charts["KL over updates"]["content"])
    for png in ("reports/eval/reward_over_updates.png", "reports/eval/reward_vs_kl.png",
                "reports/eval/response_lengths.png", "reports/inspection/scores.png"):
        assert shown[png][0]["type"] == "image", png
    out = dvc_repo / "plots-html"
    sh("dvc", "plots", "show", "-o", str(out), cwd=dvc_repo)  # writes HTML without any network
    page = (out / "index.html").read_text()
    head, _, body = page.rpartition("<body>")  # the last: the inlined libraries mention tags too
    assert body.count("<img") == 4 and "Reward over updates" in body
    # the charts' libraries are in the page (DVC's own page loads them from a CDN: offline they vanished)
    assert "<script src" not in page and "window.vegaEmbed=" in head and body.count("vegaEmbed('#") == 3
    images = list((out / "static").glob("*.png"))
    assert len(images) == 4 and all(p.read_bytes()[:4] == b"\x89PNG" for p in images), "shown offline"


def test_an_unchanged_rerun_writes_the_same_dvc_lock_and_metrics(dvc_repo):
    """sft, reward-model and train rerun from scratch (no checkpoints, as in a fresh clone): the same bytes
    in dvc.lock and metrics/; the timings are in reports/execution/ (and MLflow), not in DVC's outputs."""
    lock = (dvc_repo / "dvc.lock").read_bytes()
    shutil.rmtree(dvc_repo / "checkpoints")
    shutil.rmtree(dvc_repo / "reports" / "execution")
    sh("dvc", "repro", "--force", "--single-item", "sft", "reward-model", "train", cwd=dvc_repo)
    assert (dvc_repo / "dvc.lock").read_bytes() == lock, sh("git", "diff", "dvc.lock", cwd=dvc_repo)
    assert not sh("git", "status", "--porcelain", "metrics", cwd=dvc_repo), sh("git", "diff", cwd=dvc_repo)
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=dvc_repo)
    execution = dvc_repo / "reports" / "execution"
    for stage in ("sft", "reward-model"):
        assert json.loads((execution / f"{stage}.json").read_text())["train_seconds"] > 0, stage
    train = json.loads((execution / "train.json").read_text())
    assert train["resumed_from_update"] == 0 and train["eps"] > 0 and "time/update_s" in train
    assert "time/update_s" in json.loads((execution / "train_log.jsonl").read_text().splitlines()[0])


def test_editing_a_profile_reruns_exactly_the_stages_it_feeds(dvc_repo):
    """A run writes its profile's values into params.yaml (for that run), so DVC sees an edit of
    profiles/<name>.yaml in the params sections it changes: here inspect's, and so inspect and what follows it."""
    from flows.overrides import overrides_applied

    profile = dvc_repo / "profiles" / "custom.yaml"
    profile.parent.mkdir()
    profile.write_text("base:\n  profile: custom\ninspect:\n  num_probes: 4\n")

    def stale_with_profile() -> set[str]:
        with overrides_applied(dvc_repo, "custom", []):
            return set(json.loads(sh("dvc", "status", "--json", cwd=dvc_repo)))

    with overrides_applied(dvc_repo, "custom", []):  # as if a run had run with the profile: dvc.lock has its values
        sh("dvc", "commit", "--force", "--quiet", cwd=dvc_repo)
    assert stale_with_profile() == set(), "nothing changed since"
    profile.write_text(profile.read_text().replace("num_probes: 4", "num_probes: 6"))
    assert stale_with_profile() == {"inspect"}, "inspect's params changed; its downstream waits for its outputs"
    profile.write_text(profile.read_text() + "train:\n  kl_coef: 0.07  # not params.yaml's value\n")
    assert stale_with_profile() == {"inspect", "train"}
