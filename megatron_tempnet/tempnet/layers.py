"""TempNet layers shared by the LLM and CLIP networks: parameterised pooling and output layer."""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_tempnet.utils.precision import f32


class ParameterisedPooling(nn.Module):
    """Pool prototypical logits ``u`` into one score, mimicking Lemma 5.1 (Section 5):

        s = sum_k (softmax(u / phi)_k - 1/d2) * w3_k * u_k - b

    The paper's factor 1/rho is absorbed into the learnable ``w3`` and ``b`` (so rho = 0 stays
    legal). ``phi`` is kept positive by learning ``log phi``. Init (Appendix D.1): w3 = 1, b = 0.
    Parameters: ``d2 + 2``.
    """

    def __init__(self, proj_size: int, phi_init: float):
        super().__init__()
        if not phi_init > 0:
            raise ValueError(f"phi_init ({phi_init}) must be > 0")
        self.w3 = nn.Parameter(torch.ones(proj_size))
        # shape [1], not scalars: DeepSpeed broadcasts parameters through byte views, which a
        # 0-dim tensor cannot take
        self.bias = nn.Parameter(torch.zeros(1))
        self.log_phi = nn.Parameter(torch.full((1,), math.log(phi_init)))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """``u [..., d2]`` -> ``s [...]``, in float32."""
        u = f32(u)
        attention = torch.softmax(u / f32(self.log_phi).exp(), dim=-1) - 1.0 / u.shape[-1]
        return (attention * f32(self.w3) * u).sum(dim=-1) - f32(self.bias)


def bounded_temperature(s: torch.Tensor, tau_min: float, tau_max: float) -> torch.Tensor:
    """Output layer: ``tau = (tau_max - tau_min) * sigmoid(s) + tau_min``, within the bounds."""
    return (tau_max - tau_min) * torch.sigmoid(s) + tau_min


def upper_bound_for_mean(
    taus: torch.Tensor, tau_min: float, tau_max: float, target: float
) -> float:
    """The upper bound that moves the mean of ``taus`` to ``target``: the paper's inference-time
    scaling (its Table 1: TempNet's tau_max rescaled so that the mean tau is 0.7).

    ``taus`` came from ``bounded_temperature`` with bounds ``[tau_min, tau_max]``. With another
    upper bound ``U`` every ``tau - tau_min`` scales by ``(U - tau_min) / (tau_max - tau_min)``
    (sigmoid(s) does not depend on it), so the mean is ``target`` exactly at
    ``U = tau_min + (target - tau_min) (tau_max - tau_min) / (mean(taus) - tau_min)``.
    """
    if taus.numel() == 0:
        raise ValueError("no tau to take the mean of")
    if not target > tau_min:
        raise ValueError(f"the target mean tau ({target}) must be > tau_min ({tau_min})")
    mean = float(taus.double().mean())
    if not mean > tau_min:
        raise ValueError(f"every tau is at tau_min ({tau_min}): no upper bound moves the mean")
    return tau_min + (target - tau_min) * (tau_max - tau_min) / (mean - tau_min)


def check_tau_range(tau_min: float, tau_max: float, *, what: str = "tau") -> None:
    """Validate a temperature range once, with the names users set."""
    if not tau_min > 0:
        raise ValueError(f"{what}_min ({tau_min}) must be > 0")
    if not tau_max > tau_min:
        raise ValueError(f"{what}_min ({tau_min}) must be < {what}_max ({tau_max})")
