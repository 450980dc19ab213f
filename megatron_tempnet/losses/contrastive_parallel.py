"""Data-parallel contrastive losses: each rank scores its own anchors against the global batch.

``gather_with_grad`` concatenates every data-parallel rank's features ``[b, d] -> [B, d]`` (rank
order); its backward sums the gradient of ``[B, d]`` over the ranks (every rank's loss reads every
rank's features) and keeps this rank's rows. So each rank builds only its ``[b, B]`` block of the
similarity matrix, and the gradients are those of the whole global batch's loss (divide the summed
per-anchor losses by the global number of anchors, as the training step does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group):
        ctx.group = group
        ctx.rank, ctx.rows = dist.get_rank(group), local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows], None


def gather_with_grad(local: torch.Tensor, group=None) -> torch.Tensor:
    """``[b, ...]`` on each rank -> ``[world * b, ...]`` (equal ``b`` on every rank)."""
    if group is None and not dist.is_initialized():
        return local
    if dist.get_world_size(group) == 1:
        return local
    return _GatherWithGrad.apply(local, group)


def positive_columns(local_rows: int, group=None, *, device: torch.device) -> torch.Tensor:
    """The global-batch column of each local anchor's pair: ``rank * b + [0, b)``, on
    ``device`` (the similarities')."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return torch.arange(local_rows, device=device) + rank * local_rows
