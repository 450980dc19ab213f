"""TempNet's transformation layer on vocabulary-parallel logits (communication part).

``y = W1 (L / ||L||_2)`` with ``L [T, V]`` split by columns over the TP ranks and ``W1 [d1, V]``
split the same way: each rank multiplies its slice, and one SUM all-reduce of ``[T, d1 + 1]``
completes both the product and the squared norm (``W1 L / ||L|| = (W1 L) / ||L||``).

By default the logits are a stop-gradient input (the paper's design): only ``W1`` gets a
gradient, ``(g / ||L||)^T L`` on the local columns, which needs no communication because ``g`` is
identical on every TP rank. The logits themselves are saved for that (no normalised copy is
made). Without the stop-gradient (the ablation), the logits get
``dL = (g W1 - <g, y> L / ||L||) / ||L||`` on the local columns, ``y`` being the output: also
without communication, since ``g`` and ``y`` are replicated.
"""

from __future__ import annotations

import torch

from megatron_tempnet.distributed.groups import TPGroup

_NORM_EPS = 1e-12


class _NormalisedParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_2d: torch.Tensor, weight: torch.Tensor, tp: TPGroup):
        x = logits_2d if logits_2d.dtype == weight.dtype else logits_2d.to(weight.dtype)
        bundle = torch.empty(x.shape[0], weight.shape[0] + 1, dtype=x.dtype, device=x.device)
        torch.matmul(x, weight.t(), out=bundle[:, :-1])
        bundle[:, -1] = torch.linalg.vector_norm(x, dim=1).square()
        tp.all_reduce(bundle)
        norm = bundle[:, -1].sqrt().clamp_min(_NORM_EPS)
        out = bundle[:, :-1] / norm[:, None]
        # weight and out are only needed for the logits' gradient (the no-stop-gradient ablation)
        keep = ctx.needs_input_grad[0]
        ctx.save_for_backward(x, norm, weight if keep else None, out if keep else None)
        ctx.in_dtype = logits_2d.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, norm, weight, out = ctx.saved_tensors
        grad_logits = grad_weight = None
        scaled = grad_out / norm[:, None]  # [T, d1]
        if ctx.needs_input_grad[1]:
            grad_weight = scaled.t().matmul(x)
        if ctx.needs_input_grad[0]:
            along = (scaled * out).sum(dim=1, keepdim=True)  # <g, y> / ||L||, [T, 1]
            grad_logits = (scaled.matmul(weight) - along * x / norm[:, None]).to(ctx.in_dtype)
        return grad_logits, grad_weight, None


def normalised_parallel_linear(
    logits_2d: torch.Tensor, weight: torch.Tensor, tp: TPGroup, stop_grad: bool = True
) -> torch.Tensor:
    """``[T, V_true_local]`` logits, ``[d1, V_true_local]`` weight -> ``[T, d1]``.

    The result is the full product ``W1 L / ||L||_2`` over the whole true vocabulary, identical on
    every TP rank. With ``stop_grad`` (default) the logits get no gradient.
    """
    return _NormalisedParallelLinear.apply(
        logits_2d.detach() if stop_grad else logits_2d, weight, tp
    )
