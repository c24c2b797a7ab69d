"""`rlhf sweep` (flows/sweep.py) and the reward–KL frontier (tasks/reports/frontier.py).

The arithmetic on known curves; the grid's errors before anything runs; and the real CLI on the shrunken world
in a fresh git + DVC repo, killed with SIGKILL in the middle of its second point, then rerun: the finished point
is not run again, the killed one is, every point is a DVC experiment and a pipeline run under the
one sweep run in MLflow, and the frontier is drawn."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_flow import base_env, pipeline_repo, processes_in  # noqa: F401 (a fixture)

from flows.sweep import GridError, parse_grid, plan, sweep_key
from tasks.reports.frontier import candidates, fit_gao, frontier, frontier_figure, gao_curve, gate_pick

BIN = Path(sys.executable).parent


# ---------------------------------------------------------------------------------------- the arithmetic


def test_the_gao_fit_recovers_a_known_curve_and_its_peak():
    alpha, beta = 0.8, 0.5
    kls = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    gains = [float(gao_curve(math.sqrt(k), alpha, beta)) for k in kls]
    fit = fit_gao(kls, gains)
    assert fit.alpha == pytest.approx(alpha, abs=1e-9) and fit.beta == pytest.approx(beta, abs=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    d_star = math.exp(alpha / beta - 1)  # dR/dd = alpha - beta ln d - beta = 0
    assert fit.peak_kl == pytest.approx(d_star ** 2) and fit.peak_gain == pytest.approx(gao_curve(d_star, alpha, beta))
    grid = np.linspace(0.01, 6, 2000)
    assert grid[np.argmax(gao_curve(grid, alpha, beta))] == pytest.approx(d_star, abs=0.01), "the peak is the maximum"
    assert fit.turns_within_sweep, "d* = 1.82 lies between sqrt(0.5) and 4"
    rising = fit_gao(kls[:3], gains[:3])  # before the peak: the same curve, the turn not yet seen
    assert rising.peak_kl == pytest.approx(d_star ** 2) and not rising.turns_within_sweep


def test_the_fit_needs_two_distinct_drifts_and_says_when_gold_never_turns():
    assert fit_gao([1.0], [0.3]) is None
    assert fit_gao([2.0, 2.0, 0.0], [0.1, 0.2, 0.0]) is None, "KL 0 carries no information; two equal drifts"
    straight = fit_gao([1.0, 4.0, 9.0], [1.0, 2.0, 3.0])  # R = d: no over-optimization at all
    assert straight.beta == pytest.approx(0.0, abs=1e-9) and straight.peak_kl is None
    flat = fit_gao([1.0, 4.0], [0.0, 0.0])
    assert flat.r2 is None, "equal gains: nothing for the fit to explain, not a perfect fit"


def _point(grid, algo, seed, gold, rm, kl):
    return {"grid": grid, "algo": algo, "seed": seed, "experiment": f"exp-{len(grid)}-{seed}",
            "figures": {"win_rate_gold": gold, "win_rate_rm": rm, "mean_kl": kl, "mean_score_gold": gold,
                        "ref_mean_score_gold": 0.0, "mean_score_rm": rm, "ref_mean_score_rm": 0.0}}


def test_seeds_of_one_setting_are_averaged_and_the_gate_picks_within_the_kl_budget():
    points = [_point(["train.kl_coef=0.05", "base.seed=0"], "ppo", 0, 0.90, 0.99, 5.0),
              _point(["train.kl_coef=0.05", "base.seed=1"], "ppo", 1, 0.94, 0.99, 5.4),
              _point(["train.kl_coef=0.15", "base.seed=0"], "ppo", 0, 0.84, 0.95, 3.0),
              _point(["train.kl_coef=0.15", "base.seed=1"], "ppo", 1, 0.80, 0.95, 3.2),
              _point(["train.kl_coef=0.3", "base.seed=0"], "ppo", 0, 0.82, 0.90, 2.0),
              _point(["train.kl_coef=0.3", "base.seed=1"], "ppo", 1, 0.82, 0.90, 2.2)]
    cands = {c["setting"]: c for c in candidates(points)}
    assert set(cands) == {"kl_coef=0.05", "kl_coef=0.15", "kl_coef=0.3"}
    assert cands["kl_coef=0.05"]["figures"]["win_rate_gold"] == pytest.approx(0.92)
    assert [s["seed"] for s in cands["kl_coef=0.15"]["seeds"]] == [0, 1] and cands["kl_coef=0.15"]["n"] == 2
    # the best gold (0.92) is over the budget; 0.82 and 0.82 tie (within the margin) and the lower KL (2.1 < 3.1)
    # wins, as the registry's gate decides a tie
    assert gate_pick(list(cands.values()), "win_rate_gold", 4.0, 0.01)["setting"] == "kl_coef=0.3"
    assert gate_pick(list(cands.values()), "win_rate_gold", 6.0, 0.01)["setting"] == "kl_coef=0.05"
    assert gate_pick(list(cands.values()), "win_rate_gold", 1.0, 0.01) is None
    cands["kl_coef=0.15"]["figures"]["win_rate_gold"] = 0.84  # beyond the margin: the higher gold wins
    assert gate_pick(list(cands.values()), "win_rate_gold", 4.0, 0.01)["setting"] == "kl_coef=0.15"
    report = frontier(points, "win_rate_gold", 4.0, 0.01)
    assert report["gate_pick"] == "kl_coef=0.3" and set(report["gao_fit"]) == {"ppo"}
    assert report["points"][0]["sqrt_kl"] == pytest.approx(math.sqrt(5.0)) and report["points"][0]["gold_gain"] == 0.9


def test_without_a_gold_reward_there_is_no_fit_and_the_reward_model_decides():
    points = [_point(["train.kl_coef=0.05"], "rloo", 0, None, 0.99, 3.0),
              _point(["train.kl_coef=0.3"], "rloo", 0, None, 0.90, 1.0)]
    for p in points:
        p["figures"] = {k: v for k, v in p["figures"].items() if "gold" not in k}
    report = frontier(points, "win_rate_rm", 4.0)
    assert report["gao_fit"] == {} and report["gate_pick"] == "kl_coef=0.05"
    assert report["points"][0]["gold_gain"] is None and report["points"][0]["rm_gain"] == 0.99



def _rounded(points) -> list[tuple[float, float]]:
    return [(round(float(x), 6), round(float(y), 6)) for x, y in points]


def _drawn_points(ax) -> set[tuple[float, float]]:
    """The (x, y) of every marker a scatter drew in `ax`."""
    from matplotlib.collections import PathCollection

    return {p for c in ax.collections if isinstance(c, PathCollection) for p in _rounded(c.get_offsets())}


def _shown(ax, x: float, y: float) -> bool:
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    return x0 <= x <= x1 and y0 <= y <= y1


def _where_readable(fig, panel, points: list[tuple[float, float]]):
    """The axes drawn on `panel`'s area (the panel or one inside it) where a reader can tell the points apart: each
    drawn as a marker within its limits, their values spread over at least 40 % of its height on the page."""
    from matplotlib.axes import Axes

    fig.canvas.draw()
    area = panel.get_window_extent()
    for ax in fig.findobj(Axes):
        box = ax.get_window_extent()
        if not (area.x0 <= box.x0 and box.x1 <= area.x1 and area.y0 <= box.y0 and box.y1 <= area.y1):
            continue
        if all(_shown(ax, *p) for p in points) and set(_rounded(points)) <= _drawn_points(ax):
            heights = ax.transData.transform(points)[:, 1]  # pixels on the page
            if heights.max() - heights.min() >= 0.4 * box.height:
                return ax
    return None


def _legend(ax) -> list[str]:
    legend = ax.get_legend()
    return [text.get_text() for text in legend.get_texts()] if legend else []


def test_the_figure_shows_every_point_where_a_reader_can_tell_them_apart_and_the_budget_near_them():
    """What a reader sees on the drawn page. The demo's turn is a few hundredths wide next to the reference's (0, 0):
    each panel (titled by its score) shows every measured point at (sqrt KL, gain), and somewhere on its area (the
    panel or a zoom inside it) the points are spread over enough of the height to read their order, each algorithm's
    joined in order of drift; the KL budget near them is drawn and named. Points spread over the panel are readable in
    it, with nothing drawn over it, and a budget far beyond them is not drawn."""
    from matplotlib.axes import Axes

    from tasks.reports.plots import plt

    crowded = [_point([f"train.kl_coef={c}", f"train.algo={a}"], a, 0, gold, rm, kl) for c, a, gold, rm, kl in (
        (0.3, "ppo", 0.503, 1.783, 1.43), (0.15, "ppo", 0.517, 1.827, 1.81), (0.02, "ppo", 0.493, 1.855, 2.37),
        (0.3, "rloo", 0.497, 1.825, 1.85), (0.02, "rloo", 0.473, 1.908, 2.89))]
    fig = frontier_figure(frontier(crowded, "win_rate_gold", 4.0, 0.01))
    panels = {ax.get_title(): ax for ax in fig.axes}
    for title, score in (("gold score vs drift", "mean_score_gold"), ("reward-model score vs drift", "mean_score_rm")):
        panel = panels[title]
        points = [(math.sqrt(p["figures"]["mean_kl"]), p["figures"][score]) for p in crowded]
        assert all(_shown(panel, *p) for p in points) and set(_rounded(points)) <= _drawn_points(panel), title
        readable = _where_readable(fig, panel, points)
        assert readable is not None, f"{title}: the points crowd into a sliver of the panel and nothing zooms onto them"
        for algo in ("ppo", "rloo"):
            mine = sorted((math.sqrt(p["figures"]["mean_kl"]), p["figures"][score]) for p in crowded if p["algo"] == algo)
            lines = [_rounded(line.get_xydata()) for line in readable.get_lines()]
            assert _rounded(mine) in lines, f"{title}: {algo}'s points not joined in order of drift"
        assert "KL budget (register.max_kl=4)" in _legend(panel), _legend(panel)
        budget = [line for line in panel.get_lines() if list(line.get_xdata()) == [2.0, 2.0]]  # sqrt(4)
        assert budget and _shown(panel, 2.0, panel.get_ylim()[0]), f"{title}: the budget at sqrt(4) is not drawn"
    plt.close(fig)

    spread = [_point(["train.kl_coef=0.3"], "ppo", 0, 0.2, 0.5, 0.5), _point(["train.kl_coef=0.02"], "ppo", 0, 0.6, 1.5, 2.0)]
    fig = frontier_figure(frontier(spread, "win_rate_gold", 100.0))
    for panel in fig.axes:
        key = "mean_score_gold" if panel.get_title().startswith("gold") else "mean_score_rm"
        points = [(math.sqrt(p["figures"]["mean_kl"]), p["figures"][key]) for p in spread]
        assert _where_readable(fig, panel, points) is panel, f"{panel.get_title()}: readable in the panel itself"
        assert not any("KL budget" in label for label in _legend(panel)), \
            "a budget (sqrt 10) far beyond the farthest point (sqrt 2) would squash the frontier"
    assert len(fig.findobj(Axes)) == len(fig.axes), \
        "nothing drawn over panels whose points are readable"
    plt.close(fig)


# ---------------------------------------------------------------------------------------- the grid


def test_grid_items_split_on_commas_outside_brackets_and_bad_ones_are_named():
    assert parse_grid(["train.kl_coef=0.02,0.05", "train.algo=ppo,rloo"]) == [
        ("train.kl_coef", ["0.02", "0.05"]), ("train.algo", ["ppo", "rloo"])]
    assert parse_grid(["train.lora_target_modules=[q,v],[q,k,v]"]) == [
        ("train.lora_target_modules", ["[q,v]", "[q,k,v]"])]
    for bad, says in (("train.kl_coef", "expected section.key=value1"), ("kl_coef=0.1,0.2", "expected section.key"),
                      ("train.kl_coef=0.1,,0.2", "expected"), ("train.kl_coef=0.1,0.1", "listed twice")):
        with pytest.raises(GridError, match=says):
            parse_grid([bad])
    with pytest.raises(GridError, match="given twice"):
        parse_grid(["train.kl_coef=0.1", "train.kl_coef=0.2"])
    with pytest.raises(GridError, match="at least one"):
        parse_grid([])


def test_a_point_the_params_reject_is_named_before_anything_runs(workspace):
    with pytest.raises(GridError, match=r"(?s)grid point train.kl_coef=0.1, train.algo=dpo: .*train.algo: Input should be"):
        plan(workspace, None, [], ["train.kl_coef=0.1", "train.algo=ppo,dpo"])
    with pytest.raises(GridError, match="train.kl_coef: both in --set and --grid"):
        plan(workspace, None, ["train.kl_coef=0.1"], ["train.kl_coef=0.2,0.3"])
    key, points = plan(workspace, None, ["train.num_epochs=1"], ["train.kl_coef=0.02,0.3", "train.algo=ppo,rloo"])
    assert [p.label for p in points] == [  # the first axis varies slowest
        "train.kl_coef=0.02,train.algo=ppo", "train.kl_coef=0.02,train.algo=rloo",
        "train.kl_coef=0.3,train.algo=ppo", "train.kl_coef=0.3,train.algo=rloo"]
    assert [p.algo for p in points] == ["ppo", "rloo", "ppo", "rloo"]
    assert points[0].experiment == f"sweep-{key}-kl_coef-0-02-algo-ppo"
    assert len({p.experiment for p in points}) == 4
    assert sweep_key(workspace, "demo", ["train.num_epochs=1"], ["train.kl_coef=0.02,0.3", "train.algo=ppo,rloo"]) == key
    assert sweep_key(workspace, "demo", [], ["train.kl_coef=0.02,0.3", "train.algo=ppo,rloo"]) != key
    (workspace / "params.yaml").write_text((workspace / "params.yaml").read_text().replace("seed: 0", "seed: 1"))
    assert sweep_key(workspace, "demo", ["train.num_epochs=1"], ["train.kl_coef=0.02,0.3", "train.algo=ppo,rloo"]) \
        != key, "an edited params.yaml is another sweep"


# ---------------------------------------------------------------------------------------- the real thing

GRID = ["--grid", "train.learning_rate=0.0001,0.001"]  # on the shrunken world kl_coef moves nothing (1 update)


def _sweep(repo: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([BIN / "rlhf", "sweep", *GRID], cwd=repo, env=base_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _state(repo: Path) -> dict:
    files = list((repo / "reports" / "sweep").glob("*.json"))
    states = [json.loads(f.read_text()) for f in files if f.name != "frontier.json"]
    return states[0] if states else {"points": {}}


@pytest.mark.slow
def test_a_sweep_killed_mid_point_resumes_without_rerunning_finished_points(pipeline_repo, tmp_path):  # noqa: F811
    from mlflow import MlflowClient

    repo, committed = pipeline_repo, (pipeline_repo / "params.yaml").read_text()
    first = _sweep(repo, tmp_path / "first.log")
    deadline = time.monotonic() + 900  # a bound on waiting, not a timing assertion
    train_log = repo / "reports" / "logs" / "train.log"
    while True:  # kill -9 once the second point's train stage has started
        finished = [p for p in _state(repo)["points"].values() if p["status"] == "FINISHED"]
        state_file = next((f for f in (repo / "reports" / "sweep").glob("*.json") if f.name != "frontier.json"), None)
        if finished and train_log.exists() and train_log.stat().st_mtime > state_file.stat().st_mtime:
            break
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    # the temporary Prefect server runs in its own session (so a Ctrl-C reaches the run, not it): with the CLI
    # gone it stops by itself
    gone = time.monotonic() + 60
    while processes_in(repo) and time.monotonic() < gone:
        time.sleep(0.5)
    assert not processes_in(repo, kill=True), "left running after a kill -9 of the sweep"
    assert [p["grid"] for p in finished] == [["train.learning_rate=0.0001"]]
    assert (repo / "params.yaml").read_text() != committed, "killed with the second point's overrides in place"

    second = _sweep(repo, tmp_path / "second.log")
    assert second.wait(timeout=900) == 0, (tmp_path / "second.log").read_text()[-4000:]
    assert not processes_in(repo, kill=True), "the rerun left nothing running"
    out = (tmp_path / "second.log").read_text()
    assert "2 points; 1 finished earlier (kept, not rerun), 1 to run" in out, out[-3000:]
    assert (repo / "params.yaml").read_text() == committed, "the killed point's overrides were put back"

    state = _state(repo)
    assert {p["status"] for p in state["points"].values()} == {"FINISHED"} and len(state["points"]) == 2
    experiments = {p["experiment"] for p in state["points"].values()}
    listed = subprocess.run([BIN / "dvc", "exp", "list", "--name-only"], cwd=repo, env=base_env(),
                            capture_output=True, text=True, timeout=300).stdout.split()
    assert experiments <= set(listed), listed
    shown = json.loads(subprocess.run([BIN / "dvc", "exp", "show", "--json"], cwd=repo, env=base_env(),
                                      capture_output=True, text=True, timeout=300).stdout)
    rows = {run["name"]: run["revs"][0]["data"] for base in shown if base.get("experiments")
            for run in base["experiments"]}
    for point in state["points"].values():  # each experiment holds its point's params beside its metrics
        data = rows[point["experiment"]]
        assert f"train.learning_rate={data['params']['params.yaml']['data']['train']['learning_rate']}" == point["grid"][0]
        assert data["metrics"]["metrics/eval.json"]["data"]["mean_kl"] == point["figures"]["mean_kl"]

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
    [sweep] = [r for r in runs if r.data.tags.get("rlhf.kind") == "sweep"]
    assert sweep.info.run_id == state["mlflow_run_id"] and sweep.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(sweep.info.run_id, "frontier")} == {
        "frontier/frontier.json", "frontier/frontier.png"}
    points = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == sweep.info.run_id]
    by_point = {e: sorted(r.info.status for r in points if r.data.tags.get("rlhf.experiment") == e)
                for e in experiments}
    killed = next(p["experiment"] for p in state["points"].values() if p["grid"] == ["train.learning_rate=0.001"])
    assert by_point.pop(killed) == ["FINISHED", "KILLED"], "the killed point's run, marked, and its rerun"
    assert all(v == ["FINISHED"] for v in by_point.values()), by_point  # the finished point ran once
    for point in points:  # each point's stage runs nest under its pipeline run
        stages = {r.data.tags.get("rlhf.stage") for r in runs if r.data.tags.get("mlflow.parentRunId") == point.info.run_id}
        assert point.info.status == "KILLED" or {"train", "evaluate", "register"} <= stages, stages

    report = json.loads((repo / "reports" / "sweep" / "frontier.json").read_text())
    assert sorted(p["experiment"] for p in report["points"]) == sorted(experiments)
    assert report["metric"] == "win_rate_gold" and report["gate_pick"] in {c["setting"] for c in report["candidates"]}
    assert (repo / "reports" / "sweep" / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert yaml.safe_load((repo / "params.yaml").read_text()) == yaml.safe_load(committed)


@pytest.mark.slow
def test_a_sweep_runs_its_points_two_at_a_time_on_two_workers(pipeline_repo, tmp_path):  # noqa: F811
    """`--deployment rlhf-pipeline/point --concurrency 2`: two workers (`rlhf serve`), each in its own clone,
    sharing one DVC cache and one MLflow store. The first point runs alone and leaves the shared stages in the
    cache; the other two run at once, one per worker, the second worker restoring the shared stages from DVC's
    run cache; each point's figures come back from its MLflow run, under the sweep's."""
    from mlflow import MlflowClient
    from test_flow import prefect_server, sh

    shared = tmp_path / "shared"
    mlflow_uri = f"sqlite:///{pipeline_repo / 'mlflow.db'}"
    workers = []
    for name in ("worker-a", "worker-b"):
        clone = tmp_path / name
        sh("git", "clone", "-q", str(pipeline_repo), str(clone), cwd=tmp_path)
        sh(str(BIN / "dvc"), "cache", "dir", "--local", str(shared / "dvc-cache"), cwd=clone)
        workers.append(clone)
    grid = ["--grid", "train.learning_rate=0.0001,0.0003,0.001"]
    with prefect_server(tmp_path, "--no-scheduler") as api:
        env = base_env(PREFECT_API_URL=api, MLFLOW_TRACKING_URI=mlflow_uri)
        serves = [subprocess.Popen([BIN / "rlhf", "serve"], cwd=clone, stdout=(clone / "serve.log").open("w"),
                                   stderr=subprocess.STDOUT, env={**env, "PREFECT_HOME": str(clone / ".prefect")},
                                   start_new_session=True) for clone in workers]
        try:
            sweep = subprocess.run([BIN / "rlhf", "sweep", *grid, "--deployment", "rlhf-pipeline/point",
                                    "--concurrency", "2"], cwd=pipeline_repo, env=env, capture_output=True,
                                   text=True, timeout=1500)
        finally:
            for serve in serves:
                os.killpg(serve.pid, signal.SIGTERM)
                serve.wait(timeout=60)
    logs = "\n".join((c / "serve.log").read_text()[-2000:] for c in workers)
    assert sweep.returncode == 0, f"{sweep.stdout[-3000:]}\n{sweep.stderr[-3000:]}\n{logs}"
    state = _state(pipeline_repo)
    assert [p["status"] for p in state["points"].values()] == ["FINISHED"] * 3, state

    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], max_results=1000)
    points = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == state["mlflow_run_id"]),
                    key=lambda r: r.info.start_time)
    assert [r.info.status for r in points] == ["FINISHED"] * 3
    assert {r.data.tags["rlhf.root"] for r in points} == {str(w) for w in workers}, "both workers ran points"
    first, second, third = points
    assert first.info.end_time <= min(second.info.start_time, third.info.start_time), "the first point ran alone"
    assert second.info.start_time < third.info.end_time and third.info.start_time < second.info.end_time, \
        "the other two ran at once"
    prepares = [r for r in runs if r.data.tags.get("rlhf.stage") == "prepare"]
    assert len(prepares) == 1, "the shared stages ran once; the other clone restored them from the run cache"
    for run in points:  # the figures the frontier drew are the point's evaluation as its run recorded it
        recorded = state["points"][next(label for label, p in state["points"].items()
                                        if p["experiment"] == run.data.tags["rlhf.experiment"])]["figures"]
        assert recorded["mean_kl"] == pytest.approx(run.data.metrics["eval/mean_kl"])
    report = json.loads((pipeline_repo / "reports" / "sweep" / "frontier.json").read_text())
    assert len(report["points"]) == 3
