"""How sure a sweep's frontier is: bootstrap intervals for each point's gains and for the Gao et al. fit, and the
rule for saying "over-optimization".

- A run's gain is the mean over its evaluation prompts of (policy score - reference score) on the same prompt
  (reports/eval/scores.json). The bootstrap redraws prompts with replacement, paired: one draw moves a prompt's
  policy and reference scores together. Runs scored on the same prompts (the same `prompts_md5`) share their
  draws, so the difference between two points keeps their correlation.
- A setting run under several seeds (a grid over `base.seed`) is the mean over its seeds: each replicate draws the
  seeds with replacement, then takes each drawn seed's own prompt replicate (a two-stage bootstrap). With k seeds
  it understates the seed variance by (k - 1) / k.
- The fit's intervals come from refitting it on every replicate (bootstrap refits) rather than from the
  least-squares covariance: a sweep has 3-8 points, so a t interval would rest on 1-6 residual degrees of freedom
  and on independent normal errors, while the refits carry the points' own, correlated noise (KL's too).
- Over-optimization is said only when (1) the fit has a degree of freedom left: 3 settings or more for its 2
  parameters (the curve passes through the reference's (0, 0) by construction, so 2 points fit any curve
  exactly); (2) its peak lies within the measured drifts; (3) the fall from the best measured setting to the
  farthest one beyond it has its 95% interval above zero. Otherwise `to_run` says what more would decide it.

Pure numpy over the sweep's points; seeded, so a report is the same every time it is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95   # the intervals' coverage
N_BOOT = 2000  # replicates: the 2.5 % tails rest on 50 replicates each
KL_KEY = "train.kl_coef"
EVAL_SCORES = "reports/eval/scores.json"  # tasks/stages/evaluate.py SCORES_FILE: per-prompt scores, policy and reference
PER_PROMPT = "per_prompt"  # a sweep point's copy of them


def prompt_weights(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(B, n) bootstrap weights: row b counts how often each of n prompts is drawn in n draws with replacement,
    divided by n, so `weights @ scores` is each replicate's mean."""
    draws = rng.integers(0, n, size=(n_boot, n)) + n * np.arange(n_boot)[:, None]  # row b's prompts, offset by b n
    return np.bincount(draws.ravel(), minlength=n_boot * n).reshape(n_boot, n) / n  # 5x rng.multinomial's speed


def paired_replicates(policy: Sequence[float], reference: Sequence[float], weights: np.ndarray) -> np.ndarray:
    """(B,) replicates of mean(policy - reference): each prompt drawn for both at once."""
    return weights @ (np.asarray(policy, dtype=float) - np.asarray(reference, dtype=float))


def seed_replicates(per_seed: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """(B,) replicates of the mean over seeds: `per_seed` (S, B) each seed's prompt replicates, `draws` (B, S) seed
    indices drawn with replacement; replicate b averages the drawn seeds' replicate b."""
    return per_seed[draws, np.arange(per_seed.shape[1])[:, None]].mean(axis=1)


def interval(replicates: np.ndarray, level: float = LEVEL) -> list[float] | None:
    """The percentile interval of the finite replicates, or None without any. An infinite end (a peak beyond any
    drift) is kept as inf: np.quantile's inverted CDF takes values, it does not interpolate."""
    values = np.asarray(replicates, dtype=float)
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    tail = (1.0 - level) / 2
    low, high = np.quantile(values, [tail, 1.0 - tail], method="inverted_cdf")
    return [float(low), float(high)]


def refit_gao(kls: np.ndarray, gains: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The least squares of frontier.fit_gao on every replicate at once: kls, gains (m, B) -> alpha, beta (B,);
    NaN where a replicate's drifts cannot fix two parameters (the 2x2 normal equations singular)."""
    d = np.sqrt(np.clip(kls, 1e-12, None))  # (m, B)
    x1, x2 = d, -d * np.log(d)  # R = alpha x1 + beta x2
    a11, a12, a22 = (x1 * x1).sum(0), (x1 * x2).sum(0), (x2 * x2).sum(0)
    c1, c2 = (x1 * gains).sum(0), (x2 * gains).sum(0)
    det = a11 * a22 - a12 ** 2
    ok = np.abs(det) > 1e-12 * a11 * a22
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = np.where(ok, (a22 * c1 - a12 * c2) / det, np.nan)
        beta = np.where(ok, (a11 * c2 - a12 * c1) / det, np.nan)
    return alpha, beta


def peak_kls(alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """KL* = exp(alpha / beta - 1)^2 where the curve turns (beta > 0), inf where it never does; NaN stays NaN."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exponent = np.where(beta > 0, alpha / beta - 1.0, np.inf)
        return np.where(np.isnan(alpha) | np.isnan(beta), np.nan,
                        np.where(exponent < 40, np.exp(2 * np.minimum(exponent, 40)), np.inf))


# ------------------------------------------------------------------------------------------ the sweep's points


def run_replicates(points: Sequence[dict], n_boot: int, rng: np.random.Generator) -> list[dict | None]:
    """Per run, replicate arrays (B,) of its `gold` and `rm` gains and its mean `kl`, from its `per_prompt` scores;
    None for a run without them (evaluated before reports/eval/scores.json existed)."""
    weights: dict[tuple, np.ndarray] = {}
    out: list[dict | None] = []
    for i, point in enumerate(points):
        scores = point.get(PER_PROMPT) or {}
        if not scores.get("score_rm") or not _agree(scores, point["figures"]):
            out.append(None)
            continue
        n = len(scores["score_rm"])
        # the same prompts share one draw; without a hash a run is drawn on its own
        w = weights.setdefault((scores.get("prompts_md5") or f"run {i}", n), prompt_weights(n, n_boot, rng))
        reps = {"n_prompts": n, "rm": paired_replicates(scores["score_rm"], scores["ref_score_rm"], w)}
        if scores.get("score_gold"):
            reps["gold"] = paired_replicates(scores["score_gold"], scores["ref_score_gold"], w)
        reps["kl"] = w @ np.asarray(scores["kl"], dtype=float) if scores.get("kl") else \
            np.full(n_boot, float(point["figures"]["mean_kl"]))
        out.append(reps)
    return out


def _agree(scores: dict, figures: dict) -> bool:
    """Whether the per-prompt scores are this point's: their means are its metrics/eval.json figures (a file
    left by another run would not be)."""
    pairs = [("score_rm", "mean_score_rm"), ("ref_score_rm", "ref_mean_score_rm"), ("kl", "mean_kl"),
             ("score_gold", "mean_score_gold"), ("ref_score_gold", "ref_mean_score_gold")]
    return all(abs(float(np.mean(scores[k])) - figures[f]) <= 1e-4 * max(1.0, abs(figures[f]))
               for k, f in pairs if scores.get(k) and figures.get(f) is not None)


def setting_replicates(members: Sequence[dict | None], seeds: Sequence, draws: dict, n_boot: int,
                       rng: np.random.Generator) -> dict | None:
    """A setting's replicates from its runs' (one per seed): a single run's as they are, several runs' through
    a seed draw shared by every setting with the same seeds (`draws`, filled here). None if a run has none."""
    if not members or any(m is None for m in members):
        return None
    if len(members) == 1:
        return dict(members[0])
    key = tuple(seeds)
    if key not in draws:
        draws[key] = rng.integers(0, len(members), size=(n_boot, len(members)))
    out = {"n_prompts": min(m["n_prompts"] for m in members)}
    for name in ("gold", "rm", "kl"):
        if all(name in m for m in members):
            out[name] = seed_replicates(np.stack([m[name] for m in members]), draws[key])
    return out


def fit_intervals(kls: np.ndarray, gains: np.ndarray, level: float = LEVEL) -> dict:
    """The fit refitted on every replicate (kls, gains: (m, B)): percentile intervals of alpha, beta and the peak's
    KL (its high end None when the peak lies beyond any drift in that share of replicates), and the share of
    replicates whose curve turns within their own farthest drift."""
    alpha, beta = refit_gao(kls, gains)
    peak = peak_kls(alpha, beta)
    turns = np.where(np.isnan(peak), False, peak < kls.max(axis=0))
    peak_ci = interval(peak, level)
    return {"interval_method": f"bootstrap refits ({kls.shape[1]} replicates, percentile {level:.0%})",
            "alpha_ci": interval(alpha, level), "beta_ci": interval(beta, level),
            "peak_kl_ci": None if peak_ci is None else [None if math.isinf(v) else v for v in peak_ci],
            "turn_share": float(turns.mean())}


# ------------------------------------------------------------------------------------------ the verdict


def verdict(settings: Sequence[dict], reps: Sequence[dict | None], fit: dict | None, kl_coefs: Sequence[float],
            seeds: int, level: float = LEVEL) -> dict:
    """Whether the frontier of one algorithm shows over-optimization, and what more to run where it cannot say.

    `settings`: its settings (candidates) with `setting`, `gold_gain` and `figures.mean_kl`; `reps` their
    replicates (None where unknown); `fit`: the fit's dict (frontier.GaoFit fields) or None; `kl_coefs`: the
    grid's train.kl_coef values (to name the values to add); `seeds`: runs per setting."""
    gains = np.array([s["gold_gain"] for s in settings], dtype=float)
    kls = np.array([s["figures"]["mean_kl"] for s in settings], dtype=float)
    fitted = fit["n"] if fit is not None else int((kls > 0).sum())  # KL 0 fixes nothing: R(0) = 0 for any curve
    dof = fitted - 2
    reasons, to_run = [], []
    drift_further, need_drift = _drift_further(kl_coefs), False
    if fit is None or dof < 1:
        reasons.append(f"{fitted} setting(s) for the fit's 2 parameters: no degree of freedom left (with the "
                       "reference's (0, 0), 2 points fit the curve exactly: R² 1 says nothing)")
        to_run.append(f"{max(3 - fitted, 1)} more setting(s) at least, best beyond the peak: "
                      f"{drift_further}{_between(kl_coefs)}")
    elif fit["peak_kl"] is None:
        reasons.append("the fitted gold never turns (beta <= 0)")
        need_drift = True
    elif not fit["turns_within_sweep"]:
        reasons.append(f"the fitted peak (KL {fit['peak_kl']:.2f}) lies beyond the farthest point "
                       f"(KL {kls.max():.2f}): no turn measured")
        need_drift = True
    best, farthest = int(np.argmax(gains)), int(np.argmax(kls))
    out = {"over_optimization": False, "dof": dof, "fall": None, "fall_ci": None, "level": level,
           "from_setting": settings[best]["setting"], "to_setting": settings[farthest]["setting"]}
    if best == farthest:
        reasons.append(f"the farthest setting ({settings[farthest]['setting']}) has the highest gold gain: "
                       "no fall measured")
        need_drift = True
    else:
        fall = float(gains[best] - gains[farthest])
        out["fall"] = fall
        pair = (reps[best], reps[farthest])
        if any(r is None or "gold" not in r for r in pair):
            reasons.append(f"gold falls {fall:.3f} from {settings[best]['setting']} to {settings[farthest]['setting']}, "
                           "with no per-prompt scores to tell it from noise")
            to_run.append("the points again with this version (evaluate keeps reports/eval/scores.json)")
        else:
            low, high = out["fall_ci"] = interval(pair[0]["gold"] - pair[1]["gold"], level)
            if low <= 0:
                reasons.append(f"gold falls {fall:.3f} from {settings[best]['setting']} to "
                               f"{settings[farthest]['setting']}, within its uncertainty ({level:.0%} interval "
                               f"{low:+.3f} to {high:+.3f})")
                to_run.append(_more_samples(fall, (high - low) / 2, min(pair[0]["n_prompts"], pair[1]["n_prompts"]),
                                            seeds))
    if need_drift and not (fit is None or dof < 1):  # else the settings asked for above already say so
        to_run.append(f"points that drift further: {drift_further}")
    out["over_optimization"] = not reasons
    out["reasons"], out["to_run"] = reasons, to_run
    if seeds == 1 and out["over_optimization"]:
        out["note"] = "one seed: the interval covers the evaluation prompts, not another seed's training"
    return out


def _drift_further(kl_coefs: Sequence[float]) -> str:
    smallest = min(kl_coefs, default=None)
    if smallest:
        return (f"{KL_KEY} below {smallest:g} (e.g. {smallest / 2:g},{smallest / 4:g}), or more updates "
                "(train.total_episodes)")
    return f"more updates (train.total_episodes) at the smallest {KL_KEY}"


def _between(kl_coefs: Sequence[float]) -> str:
    values = sorted(set(kl_coefs))
    if len(values) < 2 or values[0] <= 0:
        return ""
    middles = [math.sqrt(a * b) for a, b in zip(values, values[1:], strict=False)]
    return f"; or between the values run ({','.join(f'{v:.2g}' for v in middles)})"


def _more_samples(fall: float, half_width: float, n_prompts: int, seeds: int) -> str:
    """More evaluation prompts and seeds, sized so that a fall this large would clear its interval (the half-width
    shrinks as 1/sqrt of the samples)."""
    if fall <= 0:
        return "no fall to resolve: gold does not drop beyond the best point"
    factor = (half_width / fall) ** 2 * 1.2  # 20 % spare: the interval itself is estimated
    prompts = math.ceil(n_prompts * factor)
    seed_text = ("more seeds (--grid base.seed=0,1,2: one seed's interval covers the prompts only, and a seed "
                 "moves the gains too)" if seeds == 1 else f"about {math.ceil(seeds * factor)} seeds")
    return (f"more evaluation prompts (about {prompts}: evaluate.num_prompts, and as many held-out prompts, "
            f"prepare.world.prompts_eval in the demo world) and {seed_text}")


# ------------------------------------------------------------------------------------------ the words


def fit_text(algo: str, fit: dict) -> str:
    """One line: the fit with its intervals, its points and degrees of freedom, its peak."""
    def value(name: str) -> str:
        ci = fit.get(f"{name}_ci")
        return f"{fit[name]:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

    r2 = "n/a (equal gains)" if fit["r2"] is None else f"{fit['r2']:.2f}"
    dof = fit.get("dof", fit["n"] - 2)
    peak = "no peak (beta <= 0)"
    if fit["peak_kl"] is not None:
        ci = fit.get("peak_kl_ci")
        peak = f"fitted gold peaks at KL {fit['peak_kl']:.2f}" + (
            "" if not ci else f" [{ci[0]:.2f}, {'beyond any drift' if ci[1] is None else f'{ci[1]:.2f}'}]")
    share = f"; turns within the sweep in {fit['turn_share']:.0%} of replicates" if "turn_share" in fit else ""
    how = f" (intervals: {fit['interval_method']})" if fit.get("interval_method") else " (no intervals: no per-prompt scores)"
    return (f"{algo}: R(d) = d (α − β ln d), α {value('alpha')}, β {value('beta')}, R² {r2}, {fit['n']} points, "
            f"{dof} degree(s) of freedom{how}; {peak}{share}")


def verdict_text(algo: str, judged: dict) -> list[str]:
    """The verdict as lines: the claim and its evidence, or why it is not made and what to run."""
    if judged["over_optimization"]:
        low, high = judged["fall_ci"]
        note = f" ({judged['note']})" if judged.get("note") else ""
        return [f"{algo}: **over-optimization**: gold falls {judged['fall']:.3f} from {judged['from_setting']} to "
                f"{judged['to_setting']} ({judged['level']:.0%} interval {low:+.3f} to {high:+.3f}), beyond the "
                f"fitted peak{note}"]
    return [f"{algo}: over-optimization not claimed: " + "; ".join(judged["reasons"]) + ".",
            *(["", "To decide it, run:", "", *(f"- {item}" for item in judged["to_run"])] if judged["to_run"] else [])]


def gain_text(value: float | None, ci: list | None) -> str:
    if value is None:
        return "–"
    return f"{value:+.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
