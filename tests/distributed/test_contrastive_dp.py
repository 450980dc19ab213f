"""Contrastive losses over data-parallel ranks (each rank's anchors against features gathered
with their gradient) equal the one-process loss on the global batch: values and gradients."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

B, DIM = 8, 16


def _global():
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(B, DIM, generator=g, dtype=torch.float64), dim=1)
    y = torch.nn.functional.normalize(torch.randn(B, DIM, generator=g, dtype=torch.float64), dim=1)
    tau_x = torch.rand(B, generator=g, dtype=torch.float64) * 0.05 + 0.01
    tau_y = torch.rand(B, generator=g, dtype=torch.float64) * 0.05 + 0.01
    return x, y, tau_x, tau_y


def _losses(loss: str):
    from megatron_tempnet.losses.contrastive import info_nce, robust_contrastive_side
    from megatron_tempnet.losses.contrastive_parallel import gather_with_grad, positive_columns

    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    rows = slice(rank * B // world, (rank + 1) * B // world)
    x, y, tau_x, tau_y = _global()
    x, y = x[rows].clone().requires_grad_(True), y[rows].clone().requires_grad_(True)
    tau_x, tau_y = tau_x[rows], tau_y[rows]
    xg, yg = gather_with_grad(x), gather_with_grad(y)
    positive = positive_columns(x.shape[0], device=x.device)
    sims = (x @ yg.t(), y @ xg.t())  # image anchors vs all texts, text anchors vs all images
    if loss == "robust":
        zeros, unseen = (
            torch.zeros(x.shape[0], dtype=torch.float64),
            torch.zeros(x.shape[0], dtype=torch.bool),
        )
        sides = [
            robust_contrastive_side(sim, positive, tau, zeros, zeros, unseen, gamma=0.9, rho=5.0)
            for sim, tau in zip(sims, (tau_x, tau_y))
        ]
        per_anchor = torch.stack([side.loss for side in sides])
        extra = torch.stack([side.tau_grad for side in sides]).detach()
    else:
        per_anchor = torch.stack(
            [info_nce(sim, positive, tau) for sim, tau in zip(sims, (tau_x, tau_y))]
        )
        extra = per_anchor.detach()
    (per_anchor.sum() / B).backward()  # normalised by the global number of anchors
    return per_anchor.detach(), extra, x.grad, y.grad


@pytest.mark.parametrize("loss", ["robust", "infonce"])
def test_two_ranks_equal_one(loss):
    one = run_distributed(_losses, world_size=1, args=(loss,))[0]
    two = run_distributed(_losses, world_size=2, args=(loss,))
    for k in range(4):
        joined = torch.cat([r[k] for r in two], dim=-1 if k < 2 else 0)
        torch.testing.assert_close(joined, one[k], rtol=1e-12, atol=1e-12)
    assert one[2].abs().sum() > 0 and one[3].abs().sum() > 0
