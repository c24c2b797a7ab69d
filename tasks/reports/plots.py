"""PNG plots rendered locally (DVC's HTML plots need a CDN): reward over updates, reward against KL,
response lengths of the trained and the reference policy."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlhf_core.jsonio import atomic_path  # noqa: E402


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
        if all("monitor/gold" in h for h in history):  # a world with a gold reward: does it follow the proxy?
            gold_axis = ax.twinx()
            gold_axis.plot(updates, [h["monitor/gold"] for h in history], color="black", linestyle="--",
                           label="gold reward")
            gold_axis.set(ylabel="gold reward")
            gold_axis.legend(loc="lower right")
        ax.legend(loc="upper left")
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


def plot_inspection(samples: dict[str, dict[str, list]], target: Path) -> None:
    """Reward-model scores: their histogram per completion set, and score against completion length."""
    fig, (hist, scatter) = plt.subplots(1, 2, figsize=(11, 4))
    for name, sample in samples.items():
        hist.hist(sample["scores"], bins=30, alpha=0.5, label=f"{name} ({len(sample['scores'])})")
        scatter.scatter(sample["lengths"], sample["scores"], s=6, alpha=0.5, label=name)
    hist.set(xlabel="reward-model score", ylabel="completions", title="Score distribution")
    scatter.set(xlabel="completion tokens (EOS excluded)", ylabel="reward-model score", title="Score against length")
    hist.legend()
    scatter.legend()
    _save(fig, target)


def _token_label(tok: dict) -> str:
    """Printable: control characters escaped; a partial UTF-8 byte (decoded as U+FFFD) shown by its id."""
    if "\ufffd" in tok["token"]:
        return f"#{tok['token_id']}"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in tok["token"])


def plot_trace(trace: dict, target: Path) -> None:
    """The reward-flow trace as a heatmap per rollout: quantities (rows) x response tokens (columns).

    Each row is coloured on its own symmetric scale (a log-prob and an advantage do not share units); the
    numbers are printed in the cells while they stay legible.
    """
    names, rollouts = trace["quantities"], trace["rollouts"]
    width = max(len(r["tokens"]) for r in rollouts)
    fig, axes = plt.subplots(len(rollouts), 1, squeeze=False, layout="constrained",
                             figsize=(max(6.0, 0.55 * width + 2), (0.3 * len(names) + 0.9) * len(rollouts)))
    for ax, rollout in zip(axes[:, 0], rollouts, strict=True):
        values = [[tok[name] for tok in rollout["tokens"]] for name in names]  # (Q, L)
        scale = [max(max(abs(v) for v in row), 1e-12) for row in values]
        ax.imshow([[v / s for v in row] for row, s in zip(values, scale, strict=True)], cmap="RdBu",
                  vmin=-1, vmax=1, aspect="auto")
        if len(rollout["tokens"]) <= 40:
            for q, row in enumerate(values):
                for t, v in enumerate(row):
                    ax.text(t, q, f"{v:.2g}", ha="center", va="center", fontsize=5.5)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        labels = [_token_label(tok) for tok in rollout["tokens"]]
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
        for label, tok in zip(ax.get_xticklabels(), rollout["tokens"], strict=True):
            if not tok.get("trained", True):  # tool results (and masked truncations): in the context, not the loss
                label.set_color("0.6")
        extra = "".join(f", {k} {rollout[k]:.3g}" for k in ("baseline", "advantage") if k in rollout)
        if "tool_calls" in rollout:
            extra += f", {rollout['tool_calls']} tool call(s) in {len(rollout['turns'])} turns (grey: tool results)"
        kl = "" if rollout["kl_sum"] is None else (  # None: no reference (GRPO at beta 0)
            f", KL {rollout['kl_sum']:.3g}, score - KL penalty {rollout['rlhf_reward']:.3g}")
        ax.set_title(f"rollout {rollout['index']}: score {rollout['score']:.3g}{kl}{extra}", fontsize=8)
    fig.suptitle(f"Reward flow, update {trace['update']} ({trace['algo']}, kl_coef {trace['kl_coef']})", fontsize=9)
    _save(fig, target)
