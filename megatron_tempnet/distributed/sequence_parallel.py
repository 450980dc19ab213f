"""Sequence parallelism's gradient rule: parameters that see one sequence shard sum their
gradients over the tensor-parallel group.

With ``--sequence-parallel`` the norms, the row-parallel layers' biases and the dropout/residual
regions run on this rank's shard of the sequence, ``[s/tp, b, h]``. A parameter applied there
(megatron-core marks them: ``param.sequence_parallel = True``; ``models.norms.Norm`` does the
same) is replicated over the TP ranks but receives the gradient of this rank's tokens only: the
full gradient is the sum over the TP group. megatron-core's own data-parallel wrapper sums them
after the backward pass (``finalize_model_grads``); here DeepSpeed reduces gradients over the
data-parallel ranks, ZeRO 1-2 in hooks that run as each gradient is accumulated, so the sum is
done inside autograd instead: a hook on each marked parameter returns the gradient all-reduced
over the TP group before it is accumulated, every micro-batch, and DeepSpeed's hooks (run after
the accumulation) see the complete gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` marked ``sequence_parallel`` (norms, row-parallel biases)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def sum_sequence_parallel_grads(module: nn.Module, tp_group) -> list:
    """Make every marked parameter of ``module`` that trains receive its gradient summed over
    ``tp_group`` (a hook on the parameter, before the gradient is accumulated). Returns the
    hooks' handles (``handle.remove()`` undoes it). Call it on every rank of the group, on the
    same model, before the engine is built."""
    hook = functools.partial(_sum_over_group, group=tp_group)
    return [p.register_hook(hook) for p in sequence_parallel_parameters(module) if p.requires_grad]


def _sum_over_group(grad: torch.Tensor, group) -> torch.Tensor:
    total = grad.clone()  # a hook must not change the gradient it is given
    dist.all_reduce(total, group=group)
    return total
