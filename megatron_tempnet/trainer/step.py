"""What every family's training step shares: where batches live, the gradient norm, stopping on
NaN.

Gradient-norm clipping has one owner per run. Under ZeRO, in fp16 (whose gradients are
loss-scaled until DeepSpeed's optimizer unscales them) and for a mixed-precision pipeline (whose
DeepSpeed optimizer holds the float32 gradients), DeepSpeed measures the global norm and clips
(``gradient_clipping`` in its config). Otherwise the step does, with ``clip_grad_norm_`` below,
once the gradients are reduced over the data-parallel ranks, without waiting for the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet import compat
from megatron_tempnet.distributed.groups import compute_device as compute_device
from megatron_tempnet.trainer.config import RunConfig
from megatron_tempnet.utils.cli import UserError


class TrainingError(UserError, RuntimeError):
    """The run cannot continue (a NaN/inf loss or gradient): names the iteration and rank."""


def deepspeed_clips_grad_norm(config: RunConfig) -> bool:
    """Whether DeepSpeed measures and clips the gradient norm (see the module docstring)."""
    t, p = config.training, config.parallel
    return p.zero_stage > 0 or t.fp16 or (p.pipeline_model_parallel_size > 1 and t.bf16)


def step_max_grad_norm(config: RunConfig) -> float | None:
    """The norm the step clips to itself (0 = measure only), or None when DeepSpeed does."""
    return None if deepspeed_clips_grad_norm(config) else config.optimizer.clip_grad


def accumulation(engine, micro_batches: list) -> Iterator:
    """The iteration's micro-batches, each after telling the engine whether it ends the
    iteration (DeepSpeed's own count, micro-steps modulo the accumulation steps, goes wrong
    once --rampup-batch-size changes the number of micro-batches)."""
    for i, micro_batch in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
        yield micro_batch


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Global gradient norm over TP x PP (a float64 scalar on the device), the gradients scaled
    in place down to ``max_norm`` (0 = measure only). No host synchronisation.

    Tensor-parallel shards count on every rank, replicated parameters on TP rank 0 only, and a
    tied weight's second pipeline copy (DeepSpeed marks it ``ds_pipe_replicated``) not at all.
    Each gradient's squared norm is taken in float32 (no float64 copy of any gradient), their
    sum in float64.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = [p for p in parameters if p.grad is not None]
    counted = [
        p.grad.detach()
        for p in params
        if not compat.is_pipe_replicated(p)
        and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    ]
    square = torch.zeros((), dtype=torch.float64, device=compute_device())
    if counted:
        square = torch.stack([_squared_norm(g) for g in counted]).sum()
    dist.all_reduce(square, group=parallel_state.get_model_parallel_group())
    norm = square.sqrt()
    if max_norm > 0 and params:  # by min(1, max_norm / (norm + 1e-6)), on the device
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """``||grad||^2`` as a float64 scalar. On a GPU, one fused norm; on a CPU, a float32 square
    and sum (PyTorch's CPU norm kernel accumulates float32 sequentially: 1e-3 relative error at
    50M elements, where its sum, pairwise, stays at 1e-8)."""
    if grad.is_cuda:
        return torch.linalg.vector_norm(grad, dtype=torch.float32).double().square()
    return grad.float().square().sum().double()


def check_finite(
    metrics: dict[str, float], grad_norm: float | None, iteration: int, overflow: bool = False
) -> None:
    """Stop the run (``TrainingError``) on a NaN or infinite loss or gradient norm. An fp16
    step DeepSpeed skipped for overflow (``overflow``; it lowers the loss scale, routine under
    dynamic loss scaling) is not an error: DeepSpeed stops a run whose scale cannot go lower.
    In float32 and bf16 a skipped step is an error like any other (nothing would change)."""
    if overflow:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    loss = metrics["loss"]
    if not math.isfinite(loss):
        raise TrainingError(f"iteration {iteration}: the loss is {loss} (rank {rank}); stopping")
    if grad_norm is not None and not math.isfinite(grad_norm):
        raise TrainingError(
            f"iteration {iteration}: the gradient norm is {grad_norm} (rank {rank}); stopping"
        )
