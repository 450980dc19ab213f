"""Statistics of a step, by name: each value has its reduction (sum, min or max) over the ranks.

    stats = Statistics({"tokens": SUM, "loss": SUM, "tau_min": MIN, "tau_max": MAX})
    stats.add(tokens=mask.sum(), loss=(loss * mask).sum(), tau_min=tau.min(), tau_max=tau.max())
    totals = stats.reduce(dp_group)        # {"tokens": ..., "loss": ..., ...} on every rank

``reduce`` costs two all-reduces per group, whatever the number of values: one SUM of every sum,
one MIN of every minimum and negated maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

SUM, MIN, MAX = "sum", "min", "max"
_START = {SUM: 0.0, MIN: math.inf, MAX: -math.inf}


@dataclass
class StepStats:
    """What one training iteration reports (identical on every rank)."""

    metrics: dict[str, float]
    """Logged as they are (``loss`` among them: a non-finite one stops the run)."""
    count: float
    """How many ``unit`` the iteration processed (for the throughput)."""
    unit: str
    """``tokens`` or ``samples``: the throughput is logged as ``{unit}_per_sec``."""
    tau_sample: torch.Tensor | None = None
    """This rank's temperatures of the last micro-batch (TensorBoard's histogram)."""


class Statistics:
    """Named float64 accumulators, each reduced its own way."""

    def __init__(self, reductions: dict[str, str], device: torch.device | str = "cpu"):
        unknown = {k: r for k, r in reductions.items() if r not in _START}
        if unknown:
            raise ValueError(f"reductions must be {SUM}, {MIN} or {MAX}: got {unknown}")
        self.reductions = dict(reductions)
        self.device = torch.device(device)
        self.values = {
            name: torch.tensor(_START[r], dtype=torch.float64, device=self.device)
            for name, r in reductions.items()
        }

    def add(self, **values: torch.Tensor | float) -> None:
        """Fold values in: a sum adds, a min/max keeps the extreme (scalars, any dtype)."""
        for name, value in values.items():
            value = torch.as_tensor(value).detach().to(self.device, torch.float64)
            kind = self.reductions[name]
            if kind == SUM:
                self.values[name] = self.values[name] + value
            elif kind == MIN:
                self.values[name] = torch.minimum(self.values[name], value)
            else:
                self.values[name] = torch.maximum(self.values[name], value)

    def reduce(self, *groups) -> dict[str, float]:
        """Every value reduced over each of ``groups`` in turn (collective); plain floats."""
        sums = [n for n, r in self.reductions.items() if r == SUM]
        extremes = [n for n, r in self.reductions.items() if r != SUM]
        sign = {MIN: 1.0, MAX: -1.0}
        summed = torch.stack([self.values[n] for n in sums]) if sums else None
        lowest = (
            torch.stack([self.values[n] * sign[self.reductions[n]] for n in extremes])
            if extremes
            else None
        )
        for group in groups:
            if summed is not None:
                dist.all_reduce(summed, group=group)
            if lowest is not None:
                dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
        out = dict(zip(sums, summed.tolist() if summed is not None else []))
        for name, value in zip(extremes, lowest.tolist() if lowest is not None else []):
            out[name] = value * sign[self.reductions[name]]
        return out


def mean_and_std(total: float, squares: float, count: float) -> tuple[float, float]:
    """Mean and standard deviation from a sum, a sum of squares and a count."""
    count = max(count, 1e-30)
    mean = total / count
    return mean, math.sqrt(max(squares / count - mean * mean, 0.0))
