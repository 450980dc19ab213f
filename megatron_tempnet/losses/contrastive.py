"""Contrastive losses for CLIP on local tensors (docs/design.md §2, the paper's eq. 5, iSogCLR).

One *side* of a bimodal loss: ``n`` anchors (images, or texts) against the ``B`` candidates of the
global batch of the other modality. ``sim [n, B]`` holds the anchors' cosine similarities,
``positive [n]`` the column of each anchor's own pair. The communication (gathering the
candidates with their gradient across data-parallel ranks) is in ``contrastive_parallel``.

Robust global contrastive loss (SogCLR with a fixed tau, iSogCLR with one tau per sample, TempNet
with a predicted tau), per anchor i with ``d_ij = s_ij - s_ii`` over the negatives j != i:

    b_i <- max(b_i, max_j d_ij / tau_i)                     (running max, for stability)
    g_i  = sum_j exp(d_ij / tau_i - b_i)
    s_i <- g_i (first visit)  else  (1 - gamma) s_i exp(b_old - b_i) + gamma g_i
    w_ij = exp(d_ij / tau_i - b_i) / s_i                    (no gradient)
    model loss_i = sum_j w_ij d_ij                          (gradient through the similarities)
    tau gradient_i = log(s_i / (B - 1)) + b_i + rho - sum_j w_ij d_ij / tau_i     (no gradient)

InfoNCE (CLIP with one learnable tau, TaU with a tau per sample): ``-log softmax(s_i / tau)_i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RobustSide:
    """One side of the robust contrastive loss; every tensor ``[n]``."""

    loss: torch.Tensor
    """``sum_j w_ij d_ij``: its gradient is the loss's gradient w.r.t. the similarities."""
    tau_grad: torch.Tensor
    """The estimated derivative of the robust loss w.r.t. tau_i (no gradient)."""
    s: torch.Tensor
    """The updated moving average ``s_i``."""
    b: torch.Tensor
    """The updated running max ``b_i``."""


def _check(sim: torch.Tensor, positive: torch.Tensor, tau: torch.Tensor) -> None:
    n, candidates = sim.shape
    if candidates < 2:
        raise ValueError(f"a contrastive loss needs >= 2 candidates per anchor, got {candidates}")
    if positive.shape != (n,) or tau.shape != (n,):
        raise ValueError(
            f"sim {tuple(sim.shape)} needs positive and tau of shape ({n},), got "
            f"{tuple(positive.shape)} and {tuple(tau.shape)}"
        )


def robust_contrastive_side(
    sim: torch.Tensor,
    positive: torch.Tensor,
    tau: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
    seen: torch.Tensor,
    *,
    gamma: float,
    rho: float,
) -> RobustSide:
    """The robust global contrastive loss for ``n`` anchors (iSogCLR's estimator).

    Args:
        sim: ``[n, B]`` similarities to every candidate of the global batch (with gradient).
        positive: ``[n]`` column of each anchor's positive pair.
        tau: ``[n]`` temperatures (> 0; used without gradient).
        s, b: ``[n]`` the anchors' state from their previous visit (ignored where not ``seen``).
        seen: ``[n]`` bool, the anchor was visited before (not in its first epoch).
        gamma: moving-average weight in (0, 1].
        rho: the KL-DRO radius (>= 0).
    """
    _check(sim, positive, tau)
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma ({gamma}) must be in (0, 1]")
    n, candidates = sim.shape
    negative = torch.ones_like(sim, dtype=torch.bool)
    negative[torch.arange(n, device=sim.device), positive] = False
    d = sim - sim.gather(1, positive[:, None])  # [n, B], with gradient
    with torch.no_grad():
        tau = tau.detach().to(torch.float64)
        dd = d.detach().to(torch.float64)
        z = (dd / tau[:, None]).masked_fill(~negative, float("-inf"))
        b_old, s_old = b.to(torch.float64), s.to(torch.float64)
        b_new = torch.where(seen, torch.maximum(b_old, z.max(dim=1).values), z.max(dim=1).values)
        e = torch.exp(z - b_new[:, None])  # 0 at the positive
        g = e.sum(dim=1)
        kept = (1.0 - gamma) * s_old * torch.exp(torch.where(seen, b_old - b_new, 0.0))
        s_new = torch.where(seen, kept + gamma * g, g)
        w = e / s_new[:, None]
        weighted = (w * dd).sum(dim=1)
        tau_grad = torch.log(s_new / (candidates - 1)) + b_new + rho - weighted / tau
    loss = (w.to(d.dtype) * d).sum(dim=1)
    return RobustSide(
        loss=loss, tau_grad=tau_grad.to(sim.dtype), s=s_new.to(s.dtype), b=b_new.to(b.dtype)
    )


def info_nce(sim: torch.Tensor, positive: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``-log softmax(sim_i / tau_i)[positive_i]`` per anchor ``[n]`` (gradient to sim and tau)."""
    _check(sim, positive, tau)
    scaled = sim / tau[:, None]
    return torch.logsumexp(scaled, dim=1) - scaled.gather(1, positive[:, None])[:, 0]


def tempnet_loss(tau: torch.Tensor, tau_grad: torch.Tensor) -> torch.Tensor:
    """TempNet's per-anchor objective ``tau_grad_i * tau_i``: its gradient w.r.t. TempNet's
    parameters is the estimated gradient of the robust loss (``tau_grad`` carries none)."""
    return tau_grad.detach() * tau
