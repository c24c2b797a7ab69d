"""The reward–KL frontier of a sweep: where each point sits, the Gao et al. fit, the point the gate would promote.

Gao, Schulman and Hilton (2022, "Scaling laws for reward model overoptimization") fit the gold reward gained
over the initial policy as R(d) = d (alpha - beta ln d), with d = sqrt(KL(policy || initial)). With beta > 0 the
curve peaks at d* = exp(alpha / beta - 1) (KL* = d*^2) and falls beyond it: past d* the policy games the proxy
reward. Here KL is the evaluation's mean KL per completion against the SFT reference (metrics/eval.json
`mean_kl`) and R the gold score gained over that reference (`mean_score_gold - ref_mean_score_gold`).

Pure functions over plain dicts (and the figure): the sweep flow gathers the points, this module does the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tasks.reports.frontier_uncertainty import (
    KL_KEY,
    LEVEL,
    N_BOOT,
    PER_PROMPT,
    fit_intervals,
    interval,
    run_replicates,
    setting_replicates,
    verdict,
)

SEED_KEY = "base.seed"  # a grid over seeds gives replicates of a setting, averaged into one candidate
FIGURES = ("win_rate_gold", "win_rate_rm", "mean_kl", "mean_score_gold", "ref_mean_score_gold", "mean_score_rm",
           "ref_mean_score_rm")


@dataclass(frozen=True)
class GaoFit:
    alpha: float
    beta: float
    r2: float | None     # of the fit on the points it was fitted to; None when every gain is the same
    n: int               # points fitted
    peak_kl: float | None    # KL where the fitted gold peaks; None when it never turns (beta <= 0)
    peak_gain: float | None  # the fitted gold gain there
    turns_within_sweep: bool  # gold rises from the SFT reference (KL 0, gain 0) to the peak and falls after it
    # within the points: the peak lies below the farthest point's KL (the turn measured, not extrapolated)


def gold_gain(figures: dict) -> float | None:
    """Gold score gained over the SFT reference, or None where the world has no gold reward."""
    if figures.get("mean_score_gold") is None or figures.get("ref_mean_score_gold") is None:
        return None
    return figures["mean_score_gold"] - figures["ref_mean_score_gold"]


def rm_gain(figures: dict) -> float | None:
    if figures.get("mean_score_rm") is None or figures.get("ref_mean_score_rm") is None:
        return None
    return figures["mean_score_rm"] - figures["ref_mean_score_rm"]


def gao_curve(d: np.ndarray | float, alpha: float, beta: float) -> np.ndarray | float:
    """R(d) = d (alpha - beta ln d); R(0) = 0."""
    d = np.asarray(d, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(d > 0, d * (alpha - beta * np.log(np.where(d > 0, d, 1.0))), 0.0)


def fit_gao(kls: Sequence[float], gains: Sequence[float]) -> GaoFit | None:
    """Least squares of gains = alpha d - beta d ln d over the points with KL > 0; None with fewer than two
    distinct such points (two parameters need two)."""
    pairs = [(math.sqrt(k), g) for k, g in zip(kls, gains, strict=True) if k is not None and g is not None
             and math.isfinite(k) and math.isfinite(g) and k > 0]
    if len({d for d, _ in pairs}) < 2:
        return None
    d = np.array([p[0] for p in pairs])
    r = np.array([p[1] for p in pairs])
    design = np.stack([d, -d * np.log(d)], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, r, rcond=None)
    residual = float(np.sum((r - design @ np.array([alpha, beta])) ** 2))
    total = float(np.sum((r - r.mean()) ** 2))
    r2 = 1.0 - residual / total if total > 0 else None  # gains all equal: nothing for a fit to explain
    peak_kl = peak_gain = None
    turns = False
    # beta <= 0, or so small that d* = exp(alpha / beta - 1) is beyond any drift (e^40): gold never turns
    if beta > 0 and alpha / beta - 1.0 < 40:
        d_star = math.exp(alpha / beta - 1.0)
        peak_kl, peak_gain = d_star ** 2, float(beta * d_star)  # R(d*) = beta d*
        turns = bool(d_star < d.max())  # the reference at d = 0 is measured by every evaluation (ref_mean_*)
    return GaoFit(float(alpha), float(beta), r2, len(pairs), peak_kl, peak_gain, turns)


def setting_of(overrides: Sequence[str]) -> str:
    """A point's setting: its grid overrides but the seed (replicates of one setting share it), each key by its
    last part, e.g. `kl_coef=0.05,algo=ppo`."""
    return ",".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, _, value in (item.partition("=") for item in overrides)
                    if key != SEED_KEY) or "(defaults)"


def candidates(points: Sequence[dict]) -> list[dict]:
    """One candidate per setting: the mean of each figure over its seeds, with each seed's figures kept."""
    groups: dict[str, list[dict]] = {}
    for point in points:
        groups.setdefault(setting_of(point["grid"]), []).append(point)
    out = []
    for setting, members in groups.items():
        mean = {}
        for key in FIGURES:
            values = [m["figures"][key] for m in members if m["figures"].get(key) is not None]
            if len(values) == len(members):
                mean[key] = float(np.mean(values))
        out.append({"setting": setting, "algo": members[0]["algo"], "n": len(members), "figures": mean,
                    "seeds": [{"seed": m.get("seed"), "experiment": m.get("experiment"),
                               **{k: m["figures"].get(k) for k in ("win_rate_gold", "win_rate_rm", "mean_kl")}}
                              for m in members]})
    return out


def gate_pick(cands: Sequence[dict], metric: str, max_kl: float, tie_margin: float = 0.0) -> dict | None:
    """The candidate the registry gate would promote among these (tasks/stages/register.py decide): the highest
    `metric` within the KL budget, where values within `tie_margin` of the best tie and the lowest KL among
    them wins; None when none is within the budget or has the metric."""
    eligible = [c for c in cands if c["figures"].get(metric) is not None and c["figures"].get("mean_kl") is not None
                and math.isfinite(c["figures"][metric]) and c["figures"]["mean_kl"] <= max_kl]
    if not eligible:
        return None
    best = max(c["figures"][metric] for c in eligible)
    return min((c for c in eligible if c["figures"][metric] >= best - tie_margin),
               key=lambda c: (c["figures"]["mean_kl"], -c["figures"][metric]))


def frontier(points: Sequence[dict], metric: str, max_kl: float, tie_margin: float = 0.0, *,
             n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> dict:
    """The frontier report: every point, the candidates (settings averaged over seeds), the Gao fit of the gold
    gain per algorithm over its settings (where a gold reward exists) with bootstrap intervals, the verdict on
    over-optimization (frontier_uncertainty.verdict) and the gate's pick.

    `points`: dicts with `grid` (the point's overrides), `algo`, `seed`, `experiment`, `figures` (its
    metrics/eval.json) and `per_prompt` (its reports/eval/scores.json, where kept: without it a point has no
    interval and no fall can be told from noise). `metric`: the gate's primary
    metric (win_rate_gold, else win_rate_rm). Each point's and each setting's gains carry `<gain>_ci`, the `level`
    percentile interval of `n_boot` replicates over prompts (and seeds), drawn from `seed`."""
    rng = np.random.default_rng(seed)
    run_reps = run_replicates(points, n_boot, rng)
    rows = [{**{k: v for k, v in p.items() if k != PER_PROMPT}, "sqrt_kl": math.sqrt(max(p["figures"]["mean_kl"], 0.0)),
             "gold_gain": gold_gain(p["figures"]), "rm_gain": rm_gain(p["figures"]), **_intervals(reps, level)}
            for p, reps in zip(points, run_reps, strict=True)]
    cands = candidates(points)
    draws: dict = {}
    cand_reps = []
    for c in cands:
        members = [reps for p, reps in zip(points, run_reps, strict=True) if setting_of(p["grid"]) == c["setting"]]
        cand_reps.append(setting_replicates(members, [s["seed"] for s in c["seeds"]], draws, n_boot, rng))
        c.update({"sqrt_kl": math.sqrt(max(c["figures"].get("mean_kl", 0.0), 0.0)), "gold_gain": gold_gain(c["figures"]),
                  "rm_gain": rm_gain(c["figures"]), **_intervals(cand_reps[-1], level)})
    kl_coefs = sorted({float(v) for p in points for k, _, v in (g.partition("=") for g in p["grid"]) if k == KL_KEY})
    fits, verdicts = {}, {}
    for algo in sorted({p["algo"] for p in rows}):
        mine = [(c, r) for c, r in zip(cands, cand_reps, strict=True) if c["algo"] == algo and c["gold_gain"] is not None
                and c["figures"].get("mean_kl") is not None]
        if not mine:
            continue
        fit = fit_gao([c["figures"]["mean_kl"] for c, _ in mine], [c["gold_gain"] for c, _ in mine])
        if fit is not None:
            fits[algo] = {**asdict(fit), "dof": fit.n - 2}
            fitted = [(c, r) for c, r in mine if c["figures"]["mean_kl"] > 0]
            if all(r is not None and "gold" in r for _, r in fitted):
                fits[algo].update(fit_intervals(np.stack([r["kl"] for _, r in fitted]),
                                                np.stack([r["gold"] for _, r in fitted]), level))
        verdicts[algo] = verdict([c for c, _ in mine], [r for _, r in mine], fits.get(algo), kl_coefs,
                                 max(c["n"] for c, _ in mine), level)
    pick = gate_pick(cands, metric, max_kl, tie_margin)
    return {"metric": metric, "max_kl": max_kl, "tie_margin": tie_margin, "level": level, "n_boot": n_boot,
            "points": rows, "candidates": cands, "gao_fit": fits, "verdict": verdicts,
            "gate_pick": pick["setting"] if pick else None, "gate_pick_figures": pick["figures"] if pick else None}


def _intervals(reps: dict | None, level: float) -> dict:
    """`gold_gain_ci`, `rm_gain_ci`, `kl_ci` from a point's or a setting's replicates (None where unknown)."""
    reps = reps or {}
    return {f"{name}_ci": interval(reps[key], level) if key in reps else None
            for name, key in (("gold_gain", "gold"), ("rm_gain", "rm"), ("kl", "kl"))}


def plot_frontier(report: dict, target: Path) -> None:
    """The frontier as a PNG (`frontier_figure`)."""
    from tasks.reports.plots import _save

    _save(frontier_figure(report), target)


def frontier_figure(report: dict):
    """Gold and reward-model score gained over the SFT reference against sqrt(KL), per algorithm, with the Gao et
    al. fit of the gold curve and the gate's pick. Where the measured points sit close together next to the SFT
    reference's (0, 0), an inset zooms onto them, each algorithm's points joined in order of drift: the turn
    (reward model still rising, gold falling) can be a few hundredths wide."""
    from tasks.reports.plots import plt

    has_gold = any(p["gold_gain"] is not None for p in report["points"])
    fig, axes = plt.subplots(1, 2 if has_gold else 1, figsize=(11 if has_gold else 5.5, 4.6), squeeze=False)
    panels = ([("gold_gain", "gold score gained over SFT")] if has_gold else []) + \
        [("rm_gain", "reward-model score gained over SFT")]
    algos = sorted({p["algo"] for p in report["points"]})
    colours = dict(zip(algos, plt.rcParams["axes.prop_cycle"].by_key()["color"][:len(algos)], strict=True))
    farthest = max(p["sqrt_kl"] for p in report["points"])
    budget = math.sqrt(report["max_kl"])
    # the KL budget is drawn where it is near the points; a budget far beyond them would squash the frontier
    reach = max(farthest, budget if budget <= 2 * farthest else 0.0) * 1.15
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        # every evaluation also scores the SFT reference: the frontier's point at KL 0, gain 0 by definition
        ax.scatter([0], [0], marker="s", color="grey", label="SFT reference", zorder=3)
        zoom = ax.inset_axes([0.5, 0.07, 0.46, 0.4]) if _points_crowd(report["points"], key) else None
        for algo, colour in colours.items():
            # one marker per setting (its seeds averaged) with its interval; each seed's run faded behind it
            mine = sorted((c for c in report["candidates"] if c["algo"] == algo and c[key] is not None),
                          key=lambda c: c["sqrt_kl"])
            runs = [p for p in report["points"] if p["algo"] == algo and p[key] is not None] \
                if any(c["n"] > 1 for c in mine) else []
            picked = [c for c in mine if c["setting"] == report["gate_pick"]]
            bars = [c for c in mine if c.get(f"{key}_ci")]
            fit = report["gao_fit"].get(algo) if key == "gold_gain" else None
            for target_ax in filter(None, (ax, zoom)):
                target_ax.scatter([p["sqrt_kl"] for p in runs], [p[key] for p in runs], color=colour, alpha=0.3,
                                  s=12, zorder=2, label=f"{algo}: each seed" if runs else None)
                target_ax.scatter([c["sqrt_kl"] for c in mine], [c[key] for c in mine], color=colour, label=algo,
                                  zorder=3, s=36 if target_ax is ax else 16)
                if bars:
                    target_ax.errorbar([c["sqrt_kl"] for c in bars], [c[key] for c in bars],
                                       yerr=_half_widths([c[key] for c in bars], [c[f"{key}_ci"] for c in bars]),
                                       xerr=_half_widths([c["sqrt_kl"] for c in bars],
                                                         [_sqrt_ci(c.get("kl_ci")) for c in bars]),
                                       fmt="none", ecolor=colour, elinewidth=1, capsize=0, zorder=3,
                                       label=_bar_label(report, bars))
                target_ax.scatter([c["sqrt_kl"] for c in picked], [c[key] for c in picked], marker="*",
                                  s=260 if target_ax is ax else 120, facecolor="none", edgecolor="black", zorder=4,
                                  label="gate's pick" if algo == next(iter(colours)) or picked else None)
                if fit:
                    d = np.linspace(0, reach, 400)
                    target_ax.plot(d, gao_curve(d, fit["alpha"], fit["beta"]), color=colour, linewidth=1,
                                   label=_fit_label(algo, fit, report.get("verdict", {}).get(algo)))
                    if fit["peak_kl"]:
                        target_ax.axvline(math.sqrt(fit["peak_kl"]), color=colour, linestyle=":", linewidth=1)
            if zoom is not None:
                zoom.plot([c["sqrt_kl"] for c in mine], [c[key] for c in mine], color=colour, linewidth=0.8,
                          linestyle="--" if fit else "-", zorder=2)
        if zoom is not None:
            _frame(zoom, report["points"], key)
            ax.indicate_inset_zoom(zoom, edgecolor="grey")
        ax.axhline(0, color="grey", linewidth=0.5)
        if budget < reach:
            ax.axvline(budget, color="grey", linestyle="--", linewidth=1,
                       label=f"KL budget (register.max_kl={report['max_kl']:g})")
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=True))  # one entry per label
        ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
                  frameon=False)
        ax.set(xlabel="sqrt(KL to the SFT reference)", ylabel=title, title=title.split(" gained")[0] + " vs drift",
               xlim=(-0.05 * reach, reach))
    pick = f"; the gate picks {report['gate_pick']}" if report.get("gate_pick") else ""
    fig.suptitle(f"Reward–KL frontier of sweep {report.get('sweep', '')}{pick}", fontsize=10)
    return fig


def _half_widths(values: Sequence[float], cis: Sequence[list | None]) -> np.ndarray:
    """(2, n) distances from each value down and up to its interval's ends (0 where none): errorbar's xerr/yerr."""
    return np.array([[v - ci[0], ci[1] - v] if ci else [0.0, 0.0] for v, ci in zip(values, cis, strict=True)]).T


def _sqrt_ci(ci: list | None) -> list | None:
    return None if ci is None else [math.sqrt(max(v, 0.0)) for v in ci]


def _bar_label(report: dict, bars: Sequence[dict]) -> str:
    over = "prompts and seeds" if any(c["n"] > 1 for c in bars) else "evaluation prompts"
    return f"{report.get('level', LEVEL):.0%} interval (bootstrap over {over})"


def _fit_label(algo: str, fit: dict, judged: dict | None) -> str:
    """The fit in the legend, with its intervals where known and the verdict in a word."""
    def value(name: str) -> str:
        ci = fit.get(f"{name}_ci")
        return f"{fit[name]:.3g}" + (f" [{ci[0]:.2g}, {ci[1]:.2g}]" if ci else "")

    peak = f", peak at KL {fit['peak_kl']:.2g}" if fit["peak_kl"] else ""
    said = "" if judged is None else ("; over-optimization" if judged["over_optimization"] else "; turn not shown")
    return f"{algo} fit{peak}{said}\n  α={value('alpha')}, β={value('beta')}"


def _points_crowd(points: Sequence[dict], key: str) -> bool:
    """Whether the measured values of `key` span under a fifth of the panel's height (0 to the farthest value): too
    close together to read their order next to the reference's (0, 0)."""
    values = [p[key] for p in points if p[key] is not None]
    return len(values) > 1 and (max(values) - min(values)) < 0.2 * max(abs(v) for v in values + [0.0])


def _frame(zoom, points: Sequence[dict], key: str) -> None:
    """The inset's limits: the measured points with a margin, and small tick labels."""
    xs = [p["sqrt_kl"] for p in points if p[key] is not None]
    ys = [p[key] for p in points if p[key] is not None]
    pad_x, pad_y = max(max(xs) - min(xs), 0.05) * 0.15, max(max(ys) - min(ys), 0.01) * 0.25
    zoom.set_xlim(min(xs) - pad_x, max(xs) + pad_x)
    zoom.set_ylim(min(ys) - pad_y, max(ys) + pad_y)
    zoom.tick_params(labelsize=6)
    zoom.set_title("the measured points, zoomed", fontsize=7)
