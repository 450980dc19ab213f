"""What every family's training step shares: where batches live, the gradient norm, stopping on
NaN.

Gradient-norm clipping has one owner per run. Under ZeRO, and for a mixed-precision pipeline
(whose DeepSpeed optimizer holds the float32 gradients), DeepSpeed measures the global norm and
clips (``gradient_clipping`` in its config). Otherwise the step does, with ``clip_grad_norm_``
below, once the gradients are reduced over the data-parallel ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tempnet import compat
from megatron_tempnet.trainer.config import RunConfig
from megatron_tempnet.utils.cli import UserError


class TrainingError(UserError, RuntimeError):
    """The run cannot continue (a NaN/inf loss or gradient): names the iteration and rank."""


def compute_device() -> torch.device:
    """Where batches and reduced statistics live (NCCL reduces CUDA tensors only)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def deepspeed_clips_grad_norm(config: RunConfig) -> bool:
    """Whether DeepSpeed measures and clips the gradient norm (see the module docstring)."""
    t, p = config.training, config.parallel
    return p.zero_stage > 0 or (p.pipeline_model_parallel_size > 1 and (t.bf16 or t.fp16))


def step_max_grad_norm(config: RunConfig) -> float | None:
    """The norm the step clips to itself (0 = measure only), or None when DeepSpeed does."""
    return None if deepspeed_clips_grad_norm(config) else config.optimizer.clip_grad


def clip_grad_norm_(parameters, max_norm: float) -> float:
    """Global gradient norm over TP x PP, scaled in place down to ``max_norm`` (0 = measure only).

    Tensor-parallel shards count on every rank, replicated parameters on TP rank 0 only, and a
    tied weight's second pipeline copy (DeepSpeed marks it ``ds_pipe_replicated``) not at all.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = [p for p in parameters if p.grad is not None]
    counted = [
        p.grad
        for p in params
        if not compat.is_pipe_replicated(p)
        and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    ]
    square = torch.zeros(1, dtype=torch.float64, device=compute_device())
    for g in counted:
        square += g.detach().double().pow(2).sum()
    dist.all_reduce(square, group=parallel_state.get_model_parallel_group())
    norm = float(square.sqrt())
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.detach().mul_(coef)
    return norm


def check_finite(metrics: dict[str, float], grad_norm: float | None, iteration: int) -> None:
    """Stop the run (``TrainingError``) on a NaN or infinite loss or gradient norm."""
    rank = dist.get_rank()
    loss = metrics["loss"]
    if not math.isfinite(loss):
        raise TrainingError(f"iteration {iteration}: the loss is {loss} (rank {rank}); stopping")
    if grad_norm is not None and not math.isfinite(grad_norm):
        raise TrainingError(
            f"iteration {iteration}: the gradient norm is {grad_norm} (rank {rank}); stopping"
        )
