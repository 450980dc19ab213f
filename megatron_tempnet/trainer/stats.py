"""Statistics of a step, by name: each value has its reduction (sum, min or max) over the ranks.

    stats = Statistics({"tokens": SUM, "loss": SUM, "tau_min": MIN, "tau_max": MAX}, device)
    stats.add(tokens=mask.sum(), loss=(loss * mask).sum(), tau_min=tau.min(), tau_max=tau.max())
    totals = stats.reduce(dp_group)        # {"tokens": ..., "loss": ..., ...} on every rank

``reduce`` costs two all-reduces per group, whatever the number of values: one SUM of every sum,
one MIN of every minimum and negated maximum. ``reduce_on_device`` does the same and leaves the
values on the device (``Totals``): a training step hands them to the loop, which reads them with
everything else the iteration reports in one device-to-host copy (``read_step``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

SUM, MIN, MAX = "sum", "min", "max"
_START = {SUM: 0.0, MIN: math.inf, MAX: -math.inf}


class Totals:
    """Reduced statistics still on the device: one float64 vector, read on the host later."""

    def __init__(self, names: list[str], signs: list[float], vector: torch.Tensor):
        self.names, self.signs, self.vector = names, signs, vector  # vector: [len(names)]

    def read(self, values: list[float]) -> dict[str, float]:
        """``{name: value}`` from the vector's values on the host."""
        return {n: v * s for n, s, v in zip(self.names, self.signs, values)}


@dataclass
class StepStats:
    """What one training iteration reports (identical on every rank), on the device until the
    loop reads it (``read_step``: the iteration's one host synchronisation)."""

    totals: Totals
    """The iteration's sums and extremes, reduced over the ranks."""
    summarize: Callable[[dict[str, float]], dict[str, float]]
    """The logged metrics from the totals read on the host (``loss`` among them)."""
    count: Callable[[dict[str, float]], float]
    """How many ``unit`` the iteration processed (the throughput), from the totals."""
    unit: str
    """``tokens`` or ``samples``: the throughput is logged as ``{unit}_per_sec``."""
    grad_norm: torch.Tensor | float | None = None
    """The global gradient norm before clipping (None where DeepSpeed reports none)."""
    applied: bool = True
    """Whether the optimizer stepped: False when DeepSpeed skipped the step (an fp16 overflow,
    routine under dynamic loss scaling)."""
    tau_sample: Callable[[], torch.Tensor] | None = None
    """This rank's temperatures of the last micro-batch, on the host (TensorBoard's histogram;
    collective with pipeline parallelism: called at logging iterations, on every rank)."""


@dataclass
class StepReport:
    """A step's statistics on the host."""

    metrics: dict[str, float]
    count: float
    grad_norm: float | None
    stop_flags: list[float] | None = None
    """The values of ``read_step``'s ``stop_flags`` vector, when it was given one."""


def read_step(stats: StepStats, stop_flags: torch.Tensor | None = None) -> StepReport:
    """The step's totals, gradient norm and ``stop_flags`` (a device vector: the stop requests
    the ranks agreed on) on the host, in one copy."""
    norm = stats.grad_norm
    parts = [stats.totals.vector]
    if isinstance(norm, torch.Tensor):
        parts.append(norm.detach().reshape(1).to(torch.float64))
    if stop_flags is not None:
        parts.append(stop_flags.reshape(-1).to(torch.float64))
    values = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()
    n = len(stats.totals.names)
    totals = stats.totals.read(values[:n])
    if isinstance(norm, torch.Tensor):
        norm, n = values[n], n + 1
    elif norm is not None:
        norm = float(norm)
    flags = values[n:] if stop_flags is not None else None
    return StepReport(stats.summarize(totals), stats.count(totals), norm, flags)


class Statistics:
    """Named float64 accumulators, each reduced its own way."""

    def __init__(self, reductions: dict[str, str], device: torch.device):
        """``device``: the compute device (the values meet the collectives)."""
        unknown = {k: r for k, r in reductions.items() if r not in _START}
        if unknown:
            raise ValueError(f"reductions must be {SUM}, {MIN} or {MAX}: got {unknown}")
        self.reductions = dict(reductions)
        self.device = torch.device(device)
        # filled on the device: a tensor made from a Python value would be a blocking copy
        self.values = {
            name: torch.full((), _START[r], dtype=torch.float64, device=self.device)
            for name, r in reductions.items()
        }

    def add(self, **values: torch.Tensor | float) -> None:
        """Fold values in: a sum adds, a min/max keeps the extreme (scalars, any dtype)."""
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().to(self.device, torch.float64)
            kind = self.reductions[name]
            if kind == SUM:
                self.values[name] = self.values[name] + value
            elif kind == MIN:
                self.values[name] = _extreme(torch.minimum, self.values[name], value)
            else:
                self.values[name] = _extreme(torch.maximum, self.values[name], value)

    def reduce_on_device(self, *groups) -> Totals:
        """Every value reduced over each of ``groups`` in turn (collective), left on the device."""
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
        vector = torch.cat([t for t in (summed, lowest) if t is not None])
        signs = [1.0] * len(sums) + [sign[self.reductions[n]] for n in extremes]
        return Totals(sums + extremes, signs, vector)

    def reduce(self, *groups) -> dict[str, float]:
        """Every value reduced over each of ``groups`` in turn (collective); plain floats."""
        totals = self.reduce_on_device(*groups)
        return totals.read(totals.vector.tolist())


def _extreme(pick, current: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return pick(current, value)
    return current.clamp(min=value) if pick is torch.maximum else current.clamp(max=value)


def mean_and_std(total: float, squares: float, count: float) -> tuple[float, float]:
    """Mean and standard deviation from a sum, a sum of squares and a count."""
    count = max(count, 1e-30)
    mean = total / count
    return mean, math.sqrt(max(squares / count - mean * mean, 0.0))
