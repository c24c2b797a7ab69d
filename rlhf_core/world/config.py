"""The demo world's sizes and noise: the `prepare.world` section of params.yaml."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class WorldConfig:
    """Sizes and noise of the demo world's splits; defaults train each tiny model in about a CPU minute."""

    sft_train: int = 4096
    """SFT rows {prompt, completion} for training the policy."""
    sft_eval: int = 256
    """SFT rows for the SFT validation loss."""
    prefs_train: int = 4096
    """preference pairs {prompt, chosen, rejected} for training the reward model."""
    prefs_eval: int = 512
    """preference pairs for the reward model's held-out accuracy."""
    prompts_train: int = 1024
    """prompts {prompt} for RL rollouts."""
    prompts_eval: int = 256
    """held-out prompts {prompt, reference} for evaluation with the proxy and the gold reward."""
    sft_flawed_fraction: float = 0.2
    """fraction of SFT completions with a content error (a dropped fact or an invented name)."""
    sft_padded_fraction: float = 0.8
    """fraction of SFT completions padded with an extra clause (small talk from the post or a ramble), as
    human-written TL;DRs often are. Imitation learns the habit (greedy decoding follows the majority); the
    reward model learns from pairs that padding loses, so RL has a real, gold-visible flaw to unlearn."""
    label_noise: float = 0.1
    """probability that a preference pair's labels are swapped, like disagreeing human raters."""
    misstated_pair_fraction: float = 0.0
    """fraction of preference pairs that differ only in one misstated fact (`swap_fact`): hard negatives that
    teach the reward model to check a summary against its post, the check an RL policy otherwise exploits.
    Off by default: at 0.25 the demo's tiny reward model does not learn the check and its gold accuracy falls
    to ~0.71; its `eval/misstated_accuracy` reports the blind spot instead."""
    conversational: bool = False
    """rows in TRL's conversational format: the prompt as a system and a user message (the post), every summary
    as an assistant message; the world tokenizer then carries a chat template. The posts and the gold reward are
    the same as in the plain world."""
    tool_task: bool = False
    """the task that needs a tool: each post names a case file instead of telling its outcome, and only the
    `lookup_case` tool reads it (rlhf_core/world/tools.py), so a summary states the outcome only after looking it up.
    Rows are conversations (whatever `conversational` says) with TRL's `tools` column; SFT completions call the tool
    (all but SKIP_LOOKUP_PROBABILITY of them) and the tokenizer carries the tool chat template. Train with
    train.tools [rlhf_core.world.tools:lookup_case] (profiles/tool-demo.yaml)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, float):
                assert 0.0 <= value <= 1.0, f"world.{f.name} must be in [0, 1], got {value}"
            else:
                assert value >= 0, f"world.{f.name} must be >= 0, got {value}"
