"""Where tau comes from: one type per source, taken by the losses, the output stage and scoring.

- ``FixedTau(value)``: one temperature for every token (``--tau-source fixed``, the grid of
  ``evaluate.py --tau-grid``);
- ``NewtonTau(rho, tau_min, tau_max)``: each token's exact minimiser of eq. (2) over
  ``tau_min <= tau (<= tau_max)`` at radius ``rho`` (the paper's Baseline 2, what TempNet
  approximates; no gradient);
- ``TempNetTau(tempnet)``: TempNet's prediction from the token's logits, learned through the loss.

Each gives every token's tau from a rank's vocabulary-parallel logits (``tau_of``). The fused
output stage computes TempNet's from its first product instead (``output_chunks``), which is why
TempNet's source carries the parameters that receive its gradients (``params``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tempnet.losses.newton import optimal_tau


class TauSource:
    """A source of tau (module docstring)."""

    def tau_of(
        self, logits: torch.Tensor, *, vocab_size: int, tp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """``[..., V_pad/tp]`` this rank's logits -> ``[...]`` tau, float32 (float64 for float64
        logits), identical on every TP rank."""
        raise NotImplementedError


@dataclass(frozen=True)
class FixedTau(TauSource):
    value: float

    def __post_init__(self):
        if not self.value > 0:
            raise ValueError(f"tau ({self.value}) must be > 0")

    def tau_of(self, logits, *, vocab_size, tp_group=None):
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return torch.full(logits.shape[:-1], float(self.value), dtype=dtype, device=logits.device)


@dataclass(frozen=True)
class NewtonTau(TauSource):
    rho: float
    tau_min: float
    tau_max: float | None = None

    @torch.no_grad()
    def tau_of(self, logits, *, vocab_size, tp_group=None):
        return optimal_tau(
            logits.detach(),
            rho=self.rho,
            tau_min=self.tau_min,
            tau_max=self.tau_max,
            vocab_size=vocab_size,
            tp_group=tp_group,
        )


@dataclass(frozen=True, eq=False)
class TempNetTau(TauSource):
    tempnet: torch.nn.Module
    """A ``TempNetLM`` (its ``stop_grad`` as set), built for the logits' TP group."""
    params: tuple[torch.Tensor, ...] | None = None
    """Stand-ins for ``[tempnet.weight1, *tempnet.projection_parameters()]`` that receive the
    fused stage's gradients (views made by a pipeline stage); None: those parameters."""

    def tau_of(self, logits, *, vocab_size, tp_group=None):
        return self.tempnet(logits)

    def parameters(self) -> list[torch.Tensor]:
        """``W1`` and the layers after it, or their stand-ins."""
        tempnet = self.tempnet
        return list(self.params or [tempnet.weight1, *tempnet.projection_parameters()])
