"""The tool demo's three-seed figure: the RL policy's gold win rate against the SFT policy, with its interval.

    python bench/tool_demo.py WORKSPACE OUT.json [--seeds 0 1 2] [--png OUT.png] [--set section.key=value ...]

For each seed, `rlhf run --profile tool-demo --set base.seed=S` in WORKSPACE (a clone of the repository), then its
evaluation (metrics/eval.json) and per-prompt gold scores (reports/eval/scores.json) are kept in OUT.json; a seed
already there is not run again. The interval is the two-stage bootstrap of tasks/reports/frontier_uncertainty.py (the
seeds redrawn with replacement, then each drawn seed's prompts, paired): of the mean over seeds of the per-prompt win
(1 when the RL policy's greedy summary scores higher on gold than the SFT policy's, 1/2 on a tie), and of the gold gain.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tasks.reports.frontier_uncertainty import LEVEL, N_BOOT, interval, prompt_weights, seed_replicates

FIGURES = ("win_rate_gold", "mean_score_gold", "ref_mean_score_gold", "mean_kl", "tool_call_rate",
           "ref_tool_call_rate", "tool_failure_rate", "eos_rate", "ref_eos_rate")


def per_prompt_wins(scores: dict) -> np.ndarray:
    """(n,) 1 where the policy's gold score beats the reference's on a prompt, 1/2 on a tie, else 0."""
    policy, reference = np.asarray(scores["score_gold"]), np.asarray(scores["ref_score_gold"])
    return (policy > reference) + 0.5 * (policy == reference)


def summarize(runs: dict[str, dict], n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """The mean over seeds of the win rate and the gold gain, each with its two-stage bootstrap interval."""
    rng = np.random.default_rng(seed)
    seeds = sorted(runs)
    draws = rng.integers(0, len(seeds), size=(n_boot, len(seeds)))
    out = {"seeds": seeds, "level": LEVEL, "n_boot": n_boot}
    columns = {"win_rate_gold": [per_prompt_wins(runs[s]["scores"]) for s in seeds],
               "gold_gain": [np.asarray(runs[s]["scores"]["score_gold"]) - runs[s]["scores"]["ref_score_gold"]
                             for s in seeds]}
    for name, values in columns.items():
        replicates = np.stack([prompt_weights(len(v), n_boot, rng) @ v for v in values])  # (S, B)
        out[name] = float(np.mean([v.mean() for v in values]))
        out[f"{name}_ci"] = interval(seed_replicates(replicates, draws))
    for name in FIGURES:
        out[f"mean_{name}"] = float(np.mean([runs[s]["eval"][name] for s in seeds]))
    return out


def run_seed(workspace: Path, seed: int, overrides: list[str]) -> dict:
    sets = [x for item in [f"base.seed={seed}", *overrides] for x in ("--set", item)]
    subprocess.run([Path(sys.executable).parent / "rlhf", "run", "--profile", "tool-demo", *sets], cwd=workspace,
                   check=True)
    return {"eval": json.loads((workspace / "metrics" / "eval.json").read_text()),
            "scores": json.loads((workspace / "reports" / "eval" / "scores.json").read_text())}


def plot(runs: dict[str, dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = summary["seeds"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = np.arange(len(seeds))
    ax.bar(x - 0.2, [runs[s]["eval"]["ref_mean_score_gold"] for s in seeds], 0.4, label="SFT policy", color="#999")
    ax.bar(x + 0.2, [runs[s]["eval"]["mean_score_gold"] for s in seeds], 0.4, label="GRPO with the tool", color="#37a")
    for i, s in enumerate(seeds):
        ax.annotate(f"win {runs[s]['eval']['win_rate_gold']:.2f}", (x[i] + 0.2, runs[s]["eval"]["mean_score_gold"]),
                    ha="center", va="bottom", fontsize=8)
    low, high = summary["win_rate_gold_ci"]
    ax.set_xticks(x, [f"seed {s}" for s in seeds])
    ax.set_ylabel("mean gold reward (greedy)")
    ax.set_title(f"tool-demo: gold win rate {summary['win_rate_gold']:.3f} ({summary['level']:.0%} CI "
                 f"{low:.3f} to {high:.3f})", fontsize=9)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workspace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--png", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    runs = json.loads(args.out.read_text())["runs"] if args.out.is_file() else {}
    for seed in args.seeds:
        if str(seed) not in runs:
            runs[str(seed)] = run_seed(args.workspace.resolve(), seed, args.overrides)
            args.out.write_text(json.dumps({"runs": runs}))
    runs = {s: runs[s] for s in map(str, args.seeds)}
    summary = summarize(runs)
    args.out.write_text(json.dumps({"runs": runs, "summary": summary}))
    for s in summary["seeds"]:
        print(s, {k: round(runs[s]["eval"][k], 3) for k in FIGURES})
    print(json.dumps(summary, indent=1))
    if args.png:
        plot(runs, summary, args.png)


if __name__ == "__main__":
    main()
