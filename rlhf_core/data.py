"""A seeded, resumable stream of prompt indices for the rollout phase."""

from __future__ import annotations

import torch


class PromptSampler:
    """Endless epochs over `num_prompts`, each a fresh seeded permutation; checkpointable.

    Every update draws `local_prompts * num_processes` indices from the current epoch (the
    remainder of an epoch that cannot fill a batch is dropped) and this process takes its slice,
    so all processes agree on the order without communicating.
    """

    def __init__(self, num_prompts: int, local_prompts: int, *, seed: int, rank: int = 0, num_processes: int = 1):
        self.global_prompts = local_prompts * num_processes
        if num_prompts < self.global_prompts:
            raise ValueError(f"{num_prompts} prompts cannot fill one update of {self.global_prompts} prompts; "
                             "add prompts or lower the batch size")
        self.num_prompts, self.local_prompts, self.seed, self.rank = num_prompts, local_prompts, seed, rank
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def next_indices(self) -> list[int]:
        if self.position + self.global_prompts > self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = self.position + self.rank * self.local_prompts
        self.position += self.global_prompts
        return self._order[start:start + self.local_prompts]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
