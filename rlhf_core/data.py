"""Seeded sampling: the resumable stream of prompt indices for the rollout phase, and the mini-batches of an
update's episodes."""

from __future__ import annotations

import torch
from torch import Tensor


def mini_batch_indices(global_size: int, num_mini_batches: int, *, rank: int, num_processes: int,
                       generator: torch.Generator, group_size: int = 1) -> list[Tensor]:
    """This process's episode indices (into its own shard) for each mini-batch of one epoch.

    The global batch is sharded in contiguous blocks, rank after rank. One mini-batch shuffles the shard by
    groups of `group_size` consecutive episodes (RLOO's k samples of a prompt): a prompt's samples stay side by
    side, so a micro-batch computes their shared prompt once (`rollout.shared_prompt_forward`). With
    several (one generation for several optimizer steps), every run of `num_mini_batches` consecutive global
    episodes sends one episode, at random, to each mini-batch: each process then holds an equal share of every
    mini-batch, and a mini-batch is the same set of episodes whatever the number of processes, so 1 and N
    processes take the same optimizer steps. It also spreads an RLOO prompt's k samples over mini-batches.
    Every process draws the same random numbers.
    """
    local = global_size // num_processes
    if num_mini_batches == 1:
        assert local % group_size == 0, "each process's episodes must be whole groups"
        groups = torch.randperm(local // group_size, generator=generator)
        return [(groups[:, None] * group_size + torch.arange(group_size)).flatten()]
    assert local % num_mini_batches == 0, "each process's episodes must split into the mini-batches"
    strata = global_size // num_mini_batches
    slot = torch.rand(strata, num_mini_batches, generator=generator).argsort(dim=1)  # stratum's member per mini-batch
    mine = slot[rank * local // num_mini_batches:(rank + 1) * local // num_mini_batches]  # this process's strata
    members = torch.arange(len(mine)).unsqueeze(1) * num_mini_batches + mine  # (local strata, n): local indices
    order = torch.randperm(num_mini_batches, generator=generator)  # mini-batches in a random order
    return [members[:, m] for m in order.tolist()]


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
