"""PNG plots rendered locally (DVC's HTML plots need a CDN): reward over updates, reward against KL,
response lengths of the trained and the reference policy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tasks.io import atomic_path  # noqa: E402


def _save(fig, target: Path) -> None:
    with atomic_path(target) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    plt.close(fig)


def plot_evaluation(rows: list[dict], history: list[dict], out: Path) -> None:
    if history:
        updates = [h["update"] for h in history]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(updates, [h["objective/scores"] for h in history], label="reward-model score")
        ax.plot(updates, [h["objective/rlhf_reward"] for h in history], label="score - KL penalty")
        ax.set(xlabel="update", ylabel="mean over rollouts", title="Reward over updates")
        ax.legend()
        _save(fig, out / "reward_over_updates.png")

        fig, ax = plt.subplots(figsize=(5, 4))
        points = ax.scatter([h["objective/kl"] for h in history], [h["objective/scores"] for h in history],
                            c=updates, cmap="viridis")
        fig.colorbar(points, label="update")
        ax.set(xlabel="KL(policy || reference) per completion", ylabel="reward-model score",
               title="Reward against KL")
        _save(fig, out / "reward_vs_kl.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lengths = {"trained policy": [len(r["completion"].split()) for r in rows],
               "reference (SFT)": [len(r["ref_completion"].split()) for r in rows]}
    ax.hist(list(lengths.values()), bins=20, label=list(lengths.keys()))
    ax.set(xlabel="words per greedy completion", ylabel="prompts", title="Response lengths")
    ax.legend()
    _save(fig, out / "response_lengths.png")
