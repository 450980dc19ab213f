"""KL-DRO and temperature-scaled cross-entropy on vocabulary-parallel logits.

Each tensor-parallel rank holds logits ``[b, s, V_pad/tp]`` for its slice of the padded vocabulary
(megatron-core's layout). Per token, the forward pass needs two collectives over the TP group:

1. MAX all-reduce of the row maxima ``[T]``;
2. one SUM all-reduce of ``[T, 3]``: the partial sums ``S``, ``Q`` and the target logit (present on
   one rank, zero elsewhere).

The backward pass needs none: the gradients are analytic (docs/design.md §2) and are written into
the buffer that held ``exp(z)``. No rank ever holds more than its own ``[T, V_pad/tp]`` slice.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tempnet.distributed.groups import TPGroup, resolve_tp_group, vocab_partition
from megatron_tempnet.losses import dro_math

_DRO = "dro"
_TS_CE = "ts-ce"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_args(logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp: TPGroup) -> None:
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: logits must "
            f"be target's shape plus a vocabulary dimension ([b, s, V/tp] for target [b, s])"
        )
    padded = logits.shape[-1] * tp.size
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be in [1, {padded}], the padded vocabulary "
            f"({logits.shape[-1]} columns per rank x {tp.size} TP ranks)"
        )


def _as_tau(tau: torch.Tensor | float, target: torch.Tensor, dtype, device) -> torch.Tensor:
    if isinstance(tau, torch.Tensor):
        return tau.to(dtype).expand(target.shape).reshape(-1)
    if not tau > 0:
        raise ValueError(f"tau ({tau}) must be > 0")
    return torch.full((target.numel(),), float(tau), dtype=dtype, device=device)


class _VocabParallelTemperedLoss(torch.autograd.Function):
    """Shared forward/backward of the DRO loss and TS-CE (they differ only in the last step)."""

    @staticmethod
    def forward(ctx, logits, target, tau, kind, rho, vocab_size, tp, inplace):
        compute_dtype = _compute_dtype(logits.dtype)
        n_cols = logits.shape[-1]
        # `buffer` receives exp(z), then the gradient: the input itself (in place), or the one
        # softmax-sized allocation. It is saved whole, never as a view made here.
        if logits.dtype != compute_dtype:
            buffer = logits.to(compute_dtype)
        elif inplace and logits.is_contiguous():
            buffer = logits
        else:
            buffer = torch.empty(logits.shape, dtype=compute_dtype, device=logits.device)
        x = (buffer if buffer.dtype != logits.dtype else logits).reshape(-1, n_cols)
        exp_buf = buffer.view(-1, n_cols)
        part = vocab_partition(n_cols, tp.rank, vocab_size)
        x_true = x[:, : part.n_true]
        target_1d = target.reshape(-1).long()
        tau_1d = _as_tau(tau, target, compute_dtype, x.device)

        if part.n_true:
            row_max = torch.amax(x_true, dim=1)
        else:
            row_max = torch.full((x.shape[0],), -math.inf, dtype=compute_dtype, device=x.device)
        tp.all_reduce(row_max, op=dist.ReduceOp.MAX)

        target_logit, is_local, local_index = dro_math.gather_target_logits(
            x_true, target_1d, part.start, part.n_true
        )
        need_q = ctx.needs_input_grad[2]
        s_local, q_local = dro_math.exp_shifted_(
            x_true, row_max, tau_1d, exp_buf[:, : part.n_true], need_q=need_q
        )
        columns = [s_local, target_logit] + ([q_local] if need_q else [])
        sums = torch.stack(columns, dim=1)  # [T, 2 or 3]: the one SUM all-reduce
        tp.all_reduce(sums)
        sum_exp, target_logit = sums[:, 0], sums[:, 1]
        log_s = torch.log(sum_exp)
        max_minus_target = row_max - target_logit
        if kind == _DRO:
            loss = dro_math.dro_value(log_s, max_minus_target, tau_1d, math.log(vocab_size), rho)
        else:
            loss = dro_math.ts_ce_value(log_s, max_minus_target, tau_1d)

        dtau = None
        if need_q:
            mean_z = sums[:, 2] / sum_exp
            if kind == _DRO:
                dtau = dro_math.dro_dtau(log_s, mean_z, math.log(vocab_size), rho)
            else:
                dtau = dro_math.ts_ce_dtau(mean_z, max_minus_target, tau_1d)
        ctx.save_for_backward(buffer, sum_exp, tau_1d, is_local, local_index, dtau)
        ctx.kind, ctx.n_true = kind, part.n_true
        tau_shape = tau.shape if isinstance(tau, torch.Tensor) else None
        ctx.shapes = (logits.shape, logits.dtype, tau_shape)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        buffer, sum_exp, tau_1d, is_local, local_index, dtau = ctx.saved_tensors
        logits_shape, logits_dtype, tau_shape = ctx.shapes
        exp_buf = buffer.view(-1, logits_shape[-1])
        g = grad_loss.reshape(-1).to(exp_buf.dtype)
        grad_logits = grad_tau = None
        if ctx.needs_input_grad[0]:
            row_scale = g if ctx.kind == _DRO else g / tau_1d
            dro_math.softmax_grad_(
                exp_buf[:, : ctx.n_true], sum_exp, row_scale, is_local, local_index
            )
            exp_buf[:, ctx.n_true :] = 0.0  # padded vocabulary columns carry no gradient
            grad_logits = buffer.to(logits_dtype)
        if ctx.needs_input_grad[2]:
            grad_tau = (g * dtau).view(grad_loss.shape)
            grad_tau = _sum_to_shape(grad_tau, tau_shape)
        return grad_logits, None, grad_tau, None, None, None, None, None


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to the shape of the tensor that was broadcast."""
    if grad.shape == shape:
        return grad
    return grad.sum_to_size(shape)


def vocab_parallel_dro_loss(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tau: torch.Tensor | float,
    *,
    rho: float,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token KL-DRO loss f(z, tau) of eq. (2) on vocabulary-parallel logits.

    Args:
        vocab_parallel_logits: ``[b, s, V_pad/tp]`` this rank's slice of the output layer's logits
            (any float dtype; computed in float32, or float64 for float64 input).
        target: ``[b, s]`` token ids in ``[0, vocab_size)``.
        tau: ``[b, s]`` temperatures (> 0), anything broadcastable to it, or a float.
            Gradients flow to a tensor tau.
        rho: the KL budget constant of eq. (2), ``>= 0``.
        vocab_size: the true vocabulary size ``|C|``; columns ``>= vocab_size`` (megatron-core's
            padding) are excluded from every sum and get zero gradient.
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        inplace: overwrite float32/float64 logits with ``exp`` and then their gradient, as
            megatron-core's ``vocab_parallel_cross_entropy`` always does. Saves the one
            ``[b, s, V_pad/tp]`` buffer; only when nothing else reads the logits afterwards.
    Returns:
        ``[b, s]`` loss per token, float32 (float64 for float64 logits), identical on all TP ranks.
        Apply the loss mask and normalise in the training step.
    """
    if rho < 0:
        raise ValueError(f"rho ({rho}) must be >= 0")
    tp = resolve_tp_group(tp_group)
    _check_args(vocab_parallel_logits, target, vocab_size, tp)
    return _VocabParallelTemperedLoss.apply(
        vocab_parallel_logits, target, tau, _DRO, float(rho), vocab_size, tp, inplace
    )


def temperature_scaled_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tau: torch.Tensor | float,
    *,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of ``L / tau`` (the paper's TS-CE ablation, Tables 4 and 18).

    No tau outside the log and no rho. Same layout, arguments and communication as
    :func:`vocab_parallel_dro_loss`.
    """
    tp = resolve_tp_group(tp_group)
    _check_args(vocab_parallel_logits, target, vocab_size, tp)
    return _VocabParallelTemperedLoss.apply(
        vocab_parallel_logits, target, tau, _TS_CE, 0.0, vocab_size, tp, inplace
    )
