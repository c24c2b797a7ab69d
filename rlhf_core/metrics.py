"""Per-update metrics: one accumulator, reduced once per update across processes."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor


class MetricAccumulator:
    """Sums and counts per metric name, kept as tensors on the hot path (no `.item()`).

    `reduce` sums numerators and denominators across processes separately in one collective,
    so a mean is over all episodes of all processes, not a mean of per-process means.
    """

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = {}
        self._counts: dict[str, float] = {}
        self._totals: set[str] = set()

    def _accumulate(self, name: str, value: Tensor, count: float) -> None:
        value = value.detach().float().sum()
        self._sums[name] = self._sums[name] + value if name in self._sums else value
        self._counts[name] = self._counts.get(name, 0.0) + count

    def add(self, name: str, value: Tensor | float) -> None:
        """One observation (e.g. a micro-batch's loss); the reduced value is the mean of observations."""
        self._accumulate(name, torch.as_tensor(value), 1.0)

    def add_all(self, values: Mapping[str, Tensor]) -> None:
        for name, value in values.items():
            self.add(name, value)

    def add_mean(self, name: str, values: Tensor) -> None:
        """Per-episode values (B,); the reduced value is their mean over all processes."""
        self._accumulate(name, values, float(values.numel()))

    def add_total(self, name: str, value: Tensor) -> None:
        """A count summed over all processes (e.g. completions that emitted EOS)."""
        self._totals.add(name)
        self._accumulate(name, value, 1.0)

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Wall-clock seconds of a phase; across processes the mean is logged."""
        start = time.perf_counter()
        yield
        self._totals.add(name)
        self._accumulate(name, torch.tensor(time.perf_counter() - start), 0.0)

    def reduce(self, accelerator=None) -> dict[str, float]:
        names = sorted(self._sums)
        if not names:
            return {}
        packed = torch.stack([torch.stack([self._sums[n].cpu(), torch.tensor(self._counts[n])]) for n in names])
        if accelerator is not None and accelerator.num_processes > 1:
            timers = {n for n in names if n.startswith("time/")}
            packed = accelerator.reduce(packed.to(accelerator.device), reduction="sum").cpu()
            for i, n in enumerate(names):  # wall-clock is not additive across processes
                if n in timers:
                    packed[i, 0] /= accelerator.num_processes
        out = {}
        for name, (total, count) in zip(names, packed.tolist(), strict=True):
            out[name] = total if name in self._totals else total / max(count, 1e-12)
        return out
