"""A frontier that claims only what its points support (tasks/reports/frontier_uncertainty.py, issue 43 item 5).

Synthetic points with per-prompt scores, as the evaluate stage keeps them (reports/eval/scores.json): the
two-point sweep that once printed "over-optimization" from gains of +0.503 and +0.500 now says what to run; a
clearly turning frontier is called so; the bootstrap's intervals cover the truth at their nominal rate; the
figure draws each point's interval; a point run on a worker brings its scores back from MLflow."""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np
import pytest

from tasks.reports.frontier import frontier, frontier_figure, gao_curve
from tasks.reports.frontier_uncertainty import (
    EVAL_SCORES,
    PER_PROMPT,
    interval,
    paired_replicates,
    prompt_weights,
    refit_gao,
)


def _world(seed: int, n: int = 256) -> dict:
    """The reference's (SFT's) per-prompt scores on one seed's evaluation prompts: every point of that seed shares
    them (the same prompts, the same reference completions)."""
    rng = np.random.default_rng(1000 + seed)
    return {"rng": rng, "prompts_md5": hashlib.md5(f"prompts of seed {seed}".encode()).hexdigest(),
            "ref_gold": rng.uniform(0.0, 0.9, n), "ref_rm": rng.normal(-0.9, 0.5, n)}


def _point(world: dict, kl_coef: float, gold_gain: float, rm_gain: float, kl: float, *, noise: float = 0.2,
           algo: str = "ppo", seed: int = 0, scores: bool = True) -> dict:
    """A finished sweep point whose per-prompt gains scatter by `noise` around exactly `gold_gain`, as recorded in
    reports/sweep/<key>.json: its eval.json figures, and its scores.json beside them."""
    rng, n = world["rng"], len(world["ref_gold"])

    def centred(scale: float) -> np.ndarray:
        draw = rng.normal(0.0, scale, n)
        return draw - draw.mean()

    gold = world["ref_gold"] + gold_gain + centred(noise)
    rm = world["ref_rm"] + rm_gain + centred(2 * noise)
    kls = np.clip(kl + centred(0.3 * kl), 0.0, None)
    kls += kl - kls.mean()
    per_prompt = {"prompts_md5": world["prompts_md5"], "score_gold": gold.tolist(), "ref_score_gold":
                  world["ref_gold"].tolist(), "score_rm": rm.tolist(), "ref_score_rm": world["ref_rm"].tolist(),
                  "kl": kls.tolist()}
    figures = {"win_rate_gold": float(np.mean(gold > world["ref_gold"])), "win_rate_rm": float(np.mean(rm > world["ref_rm"])),
               "mean_kl": float(np.mean(kls)), "mean_score_gold": float(gold.mean()),
               "ref_mean_score_gold": float(world["ref_gold"].mean()), "mean_score_rm": float(rm.mean()),
               "ref_mean_score_rm": float(world["ref_rm"].mean())}
    grid = [f"train.kl_coef={kl_coef}", f"train.algo={algo}", f"base.seed={seed}"]
    return {"grid": grid, "algo": algo, "seed": seed, "experiment": f"sweep-x-{kl_coef}-{algo}-{seed}",
            "figures": figures, **({PER_PROMPT: per_prompt} if scores else {})}


def _markdown(report: dict) -> str:
    from flows.sweep import frontier_markdown

    return frontier_markdown({"sweep": "test", **report})


# ---------------------------------------------------------------------------------------- the verdict


def test_two_points_do_not_claim_over_optimization_and_the_report_says_what_to_run():
    """`rlhf sweep --grid train.kl_coef=0.05,0.3` once printed "R² 1.00; gold peaks at KL 1.69; gold falls beyond
    it: over-optimization" from gold gains of +0.503 and +0.500: two points and the reference's (0, 0) fit the
    two-parameter curve exactly, and 0.003 is far inside the noise of 256 prompts."""
    world = _world(0)
    points = [_point(world, 0.05, 0.500, 1.843, 2.17), _point(world, 0.3, 0.503, 1.783, 1.43)]
    report = frontier(points, "win_rate_gold", 4.0, 0.01)
    fit, judged = report["gao_fit"]["ppo"], report["verdict"]["ppo"]
    assert fit["r2"] == pytest.approx(1.0) and fit["turns_within_sweep"], "the old claim's premises: still computed"
    assert not judged["over_optimization"] and judged["dof"] == 0
    assert judged["fall"] == pytest.approx(0.003, abs=1e-6)
    low, high = judged["fall_ci"]
    assert low < 0 < high and high - low > 0.02, "0.003 within the noise of 256 prompts"
    assert any("no degree of freedom left" in r for r in judged["reasons"])
    assert any("within its uncertainty" in r for r in judged["reasons"])
    to_run = " | ".join(judged["to_run"])
    assert "train.kl_coef below 0.05 (e.g. 0.025,0.0125)" in to_run, to_run
    assert "more evaluation prompts (about" in to_run and "base.seed" in to_run, to_run

    text = _markdown(report)
    assert "over-optimization not claimed" in text and "To decide it, run:" in text
    assert "**over-optimization**" not in text and "falls beyond it: over-optimization" not in text
    assert "0 degree(s) of freedom" in text and "+0.503 [0." in text, "the gains with their intervals"

    # the same sweep recorded before evaluate kept per-prompt scores: no interval, and still no claim
    bare = frontier([{k: v for k, v in p.items() if k != PER_PROMPT} for p in points], "win_rate_gold", 4.0)
    assert not bare["verdict"]["ppo"]["over_optimization"] and bare["candidates"][0]["gold_gain_ci"] is None


def test_the_printed_frontier_keeps_every_cell_and_its_rule_spans_the_table():
    """`rlhf sweep` printed the markdown through rich at the terminal's width: without a terminal (80 columns) the
    settings and figures were cut ("kl_coef…", "win_rate…"), and the rule under the header did not span the table.
    Printed as text now: every cell whole, the rule as wide as the widest row."""
    from flows.sweep import frontier_table, frontier_text

    world = _world(0)
    points = [_point(world, 0.05, 0.500, 1.843, 2.17), _point(world, 0.3, 0.503, 1.783, 1.43)]
    report = {"sweep": "test", **frontier(points, "win_rate_gold", 4.0)}
    header, rows = frontier_table(report)
    lines = frontier_text(report).splitlines()
    assert lines[0] == "Sweep test: reward–KL frontier" and lines[2].split("  ")[0] == "setting"
    table = lines[2:4 + len(rows)]
    assert set(table[1]) == {"─"} and len(table[1]) == max(map(len, [table[0], *table[2:]])), "\n".join(table)
    for row, line in zip(rows, table[2:], strict=True):
        assert [cell for cell in row if cell] == re.split(r"\s{2,}", line.strip()), (row, line)  # every cell whole
    assert any(cell.startswith("+0.503 [") for row in rows for cell in row)


def test_a_turn_inside_the_noise_is_not_claimed_even_with_degrees_of_freedom_left():
    """The demo's PPO frontier (docs/sweep.md): 4 points, the fitted peak inside the sweep, but gold falls 0.024
    from its best point to its farthest, within the noise of 256 prompts of one seed."""
    world = _world(0)
    points = [_point(world, c, g, r, k) for c, g, r, k in ((0.3, 0.503, 1.783, 1.43), (0.15, 0.517, 1.827, 1.81),
                                                          (0.05, 0.500, 1.843, 2.17), (0.02, 0.493, 1.855, 2.37))]
    report = frontier(points, "win_rate_gold", 4.0, 0.01)
    fit, judged = report["gao_fit"]["ppo"], report["verdict"]["ppo"]
    assert fit["dof"] == 2 and fit["turns_within_sweep"]
    assert judged["from_setting"] == "kl_coef=0.15,algo=ppo" and judged["to_setting"] == "kl_coef=0.02,algo=ppo"
    assert judged["fall"] == pytest.approx(0.024, abs=1e-6) and judged["fall_ci"][0] < 0
    assert not judged["over_optimization"]
    [ask] = judged["to_run"]
    prompts = int(ask.split("about ")[1].split(":")[0])
    assert prompts > 256, "more prompts than the 256 evaluated, sized to the fall"


def test_a_clearly_turning_frontier_with_many_points_and_little_noise_is_over_optimization():
    alpha, beta = 0.8, 0.5  # peak at KL exp(2 (alpha / beta - 1)) = 3.32
    world = _world(1)
    kls = [0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0]
    coefs = [0.5, 0.3, 0.2, 0.15, 0.1, 0.05, 0.02, 0.01]
    points = [_point(world, c, float(gao_curve(math.sqrt(k), alpha, beta)), 0.3 * k, k, noise=0.05)
              for c, k in zip(coefs, kls, strict=True)]
    report = frontier(points, "win_rate_gold", 20.0)
    fit, judged = report["gao_fit"]["ppo"], report["verdict"]["ppo"]
    assert judged["over_optimization"], judged
    assert judged["reasons"] == [] and judged["to_run"] == [] and judged["dof"] == 6
    assert judged["fall_ci"][0] > 0 and judged["to_setting"] == "kl_coef=0.01,algo=ppo"
    assert fit["alpha_ci"][0] < alpha < fit["alpha_ci"][1] and fit["beta_ci"][0] < beta < fit["beta_ci"][1]
    assert fit["peak_kl_ci"][0] < math.exp(2 * (alpha / beta - 1)) < fit["peak_kl_ci"][1]
    assert fit["turn_share"] > 0.99 and "bootstrap refits" in fit["interval_method"]
    text = _markdown(report)
    assert "ppo: **over-optimization**: gold falls" in text and "not claimed" not in text


# ---------------------------------------------------------------------------------------- the bootstrap


def test_the_paired_bootstrap_interval_covers_the_true_gain_at_its_nominal_rate():
    """400 synthetic evaluations of 200 prompts with skewed, prompt-correlated scores: the 95% interval of the
    mean gain holds the true gain in 0.92-0.98 of them (binomial sd 0.011 around 0.95)."""
    rng = np.random.default_rng(7)
    true_gain, n, trials = 0.1, 200, 400
    covered = 0
    for _ in range(trials):
        difficulty = rng.exponential(0.3, n)  # a hard prompt lowers both policies' scores: pairing cancels it
        reference = 0.6 - difficulty + rng.normal(0, 0.05, n)
        policy = 0.6 - difficulty + true_gain + (rng.exponential(0.2, n) - 0.2)  # skewed, mean 0
        low, high = interval(paired_replicates(policy, reference, prompt_weights(n, 1000, rng)))
        covered += low <= true_gain <= high
    assert 0.92 <= covered / trials <= 0.98, covered / trials


def test_the_bootstrap_is_paired_seeded_and_widened_by_seeds_that_disagree():
    rng = np.random.default_rng(0)
    n = 256
    difficulty = rng.normal(0, 1.0, n)
    policy, reference = difficulty + 0.05 + rng.normal(0, 0.05, n), difficulty
    paired = interval(paired_replicates(policy, reference, prompt_weights(n, 2000, np.random.default_rng(1))))
    assert paired[1] - paired[0] < 0.03, "a prompt's difficulty cancels between policy and reference"
    assert paired == interval(paired_replicates(policy, reference, prompt_weights(n, 2000, np.random.default_rng(1))))

    def report_for(seed_gains):
        points = []
        for seed, gains in enumerate(seed_gains):
            world = _world(seed)
            points += [_point(world, 0.1, gains[0], 1.0, 1.0, seed=seed, noise=0.05),
                       _point(world, 0.05, gains[1], 1.2, 2.0, seed=seed, noise=0.05)]
        return {c["setting"]: c for c in frontier(points, "win_rate_gold", 4.0)["candidates"]}

    agree = report_for([(0.30, 0.32), (0.30, 0.32), (0.30, 0.32)])["kl_coef=0.1,algo=ppo"]
    disagree = report_for([(0.20, 0.32), (0.30, 0.32), (0.40, 0.32)])["kl_coef=0.1,algo=ppo"]
    assert agree["n"] == disagree["n"] == 3 and agree["gold_gain"] == pytest.approx(disagree["gold_gain"])
    width = {name: c["gold_gain_ci"][1] - c["gold_gain_ci"][0] for name, c in (("agree", agree), ("disagree", disagree))}
    assert width["disagree"] > 5 * width["agree"] and width["disagree"] > 0.1, width


def test_refits_equal_the_least_squares_fit_on_each_replicate():
    from tasks.reports.frontier import fit_gao

    rng = np.random.default_rng(3)
    kls = rng.uniform(0.3, 9.0, size=(5, 4))
    gains = rng.normal(0.3, 0.1, size=(5, 4))
    alpha, beta = refit_gao(kls, gains)
    for b in range(4):
        fit = fit_gao(kls[:, b].tolist(), gains[:, b].tolist())
        assert alpha[b] == pytest.approx(fit.alpha, rel=1e-9) and beta[b] == pytest.approx(fit.beta, rel=1e-9)


# ---------------------------------------------------------------------------------------- what a reader sees


def test_the_figure_draws_each_points_interval_as_an_error_bar():
    from matplotlib.container import ErrorbarContainer

    from tasks.reports.plots import plt

    world = _world(0)
    points = [_point(world, c, g, r, k) for c, g, r, k in ((0.3, 0.503, 1.783, 1.43), (0.15, 0.517, 1.827, 1.81),
                                                          (0.02, 0.493, 1.855, 2.37))]
    report = frontier(points, "win_rate_gold", 4.0, 0.01)
    fig = frontier_figure(report)
    try:
        for panel, key in zip(fig.axes[:2], ("gold_gain", "rm_gain"), strict=True):
            [bars] = [c for c in panel.containers if isinstance(c, ErrorbarContainer)]
            assert bars.has_yerr and bars.has_xerr
            vertical = [seg for seg in bars.lines[2][1].get_segments()]  # (x, low) to (x, high) per setting
            drawn = sorted((seg[0][0], min(seg[0][1], seg[1][1]), max(seg[0][1], seg[1][1])) for seg in vertical)
            reported = sorted((c["sqrt_kl"], *c[f"{key}_ci"]) for c in report["candidates"])
            assert np.allclose(drawn, reported), (drawn, reported)
            assert all(high - low > 0.01 for _, low, high in drawn), "bars a reader can see"
            assert "95% interval (bootstrap over evaluation prompts)" in panel.get_legend_handles_labels()[1]
        gold_labels = fig.axes[0].get_legend_handles_labels()[1]
        assert any(label.startswith("ppo fit") and "α=" in label and "[" in label and "turn not shown" in label
                   for label in gold_labels), gold_labels
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------- gathering


def test_a_point_run_on_a_worker_brings_its_per_prompt_scores_back_from_mlflow(tmp_path, monkeypatch):
    """`_run_on_pool` reads a point from MLflow: its eval/* metrics from its pipeline run, its scores.json from the
    artifacts of the evaluate stage run nested under that; `_record_point` keeps them beside the figures."""
    import json

    from prefect.states import Completed

    from flows.pipeline_run import EXPERIMENT_TAG
    from flows.sweep import Point, _figures_from_mlflow, _record_point
    from tasks.tracking.mlflow_store import get_client

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    point = _point(_world(0), 0.05, 0.5, 1.8, 2.0, noise=0.1)
    client = get_client(tmp_path)
    exp = client.create_experiment("sweep-test")
    sweep = client.create_run(exp).info.run_id
    pipeline = client.create_run(exp, tags={"mlflow.parentRunId": sweep, EXPERIMENT_TAG: "sweep-x-a"}).info.run_id
    client.log_batch(pipeline, metrics=[])
    for name, value in point["figures"].items():
        client.log_metric(pipeline, f"eval/{name}", value)
    evaluate = client.create_run(exp, tags={"mlflow.parentRunId": pipeline, "rlhf.stage": "evaluate"}).info.run_id
    (tmp_path / "reports" / "eval").mkdir(parents=True)
    (tmp_path / EVAL_SCORES).write_text(json.dumps(point[PER_PROMPT]))
    client.log_artifacts(evaluate, str(tmp_path / "reports" / "eval"), "reports/eval")
    for run in (evaluate, pipeline):
        client.set_terminated(run, "FINISHED")

    figures = _figures_from_mlflow(tmp_path, sweep, "sweep-x-a")
    assert figures[PER_PROMPT] == point[PER_PROMPT]
    saved = {"key": "k", "points": {}}
    _record_point(tmp_path, saved, Point(tuple(point["grid"]), "sweep-x-a", "ppo", 0), Completed(), figures)
    [entry] = saved["points"].values()
    assert entry[PER_PROMPT] == point[PER_PROMPT] and PER_PROMPT not in entry["figures"]
    assert entry["figures"]["mean_score_gold"] == pytest.approx(point["figures"]["mean_score_gold"])
    report = frontier([entry], "win_rate_gold", 4.0)
    assert report["points"][0]["gold_gain_ci"] is not None and PER_PROMPT not in report["points"][0]


def test_an_evaluations_per_prompt_scores_are_its_figures_and_give_a_point_its_interval(make_policy, tokenizer):
    """What the evaluate stage writes to reports/eval/scores.json (EvalReport.per_prompt_scores) averages to its
    metrics/eval.json figures, so the sweep takes it as the point's own; scores from another run are refused."""
    from rlhf_core.greedy_eval import evaluate
    from rlhf_core.scoring import FunctionScorer

    prompts = ["w3 w4 w5", "w6", "w2 w9 w9 w2", "w11 w12", "w5 w5", "w8 w1 w3"]
    scorer = FunctionScorer(lambda p, c: [float(len(c.split())) for c in c], tokenizer)
    report = evaluate(make_policy(0), make_policy(7), tokenizer, prompts, scorer=scorer, response_length=6,
                      temperature=1.0, gold=lambda p, c, eos: len(set(c.split())) - (0.0 if eos else 0.5))
    scores = report.per_prompt_scores()
    assert set(scores) == {"score_rm", "ref_score_rm", "kl", "score_gold", "ref_score_gold"}
    assert all(len(column) == len(prompts) for column in scores.values())
    point = {"grid": ["train.kl_coef=0.1"], "algo": "ppo", "seed": 0, "experiment": "e", "figures": report.summary,
             PER_PROMPT: scores}
    [row] = frontier([point], "win_rate_gold", 100.0)["points"]
    assert row["gold_gain_ci"][0] <= row["gold_gain"] <= row["gold_gain_ci"][1]
    assert row["kl_ci"][0] <= report.summary["mean_kl"] <= row["kl_ci"][1]
    stale = {**point, "figures": {**report.summary, "mean_score_rm": report.summary["mean_score_rm"] + 0.5}}
    assert frontier([stale], "win_rate_gold", 100.0)["points"][0]["gold_gain_ci"] is None
