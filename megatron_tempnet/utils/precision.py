"""Float32 islands: parameters that stay float32 when the model trains in bfloat16 or float16.

TempNet maps logits or embeddings to a temperature in ``[tau_min, tau_max]``; in bfloat16 its
output would move in steps of about ``2^-7 tau`` and nearby tokens would share one temperature.
So TempNet (and CLIP's other temperature parameters) compute in float32 whatever the model's
dtype, and their parameters are marked to stay float32 when the engine casts the model to
``--bf16`` / ``--fp16`` (as mixed-precision MoE routers are kept): the optimizer then steps them
in float32 and checkpoints hold them in float32. Under ZeRO-3, which stores every parameter in
one dtype, they are stored in the training dtype and still computed in float32 from the
optimizer's float32 master copy.
"""

from __future__ import annotations

import torch
from torch import nn

FLOAT32_MARK = "megatron_tempnet_float32"


def keep_float32(module: nn.Module | nn.Parameter) -> nn.Module | nn.Parameter:
    """Mark every parameter of ``module`` (or the parameter) float32, converting it; returns it."""
    params = [module] if isinstance(module, nn.Parameter) else list(module.parameters())
    for p in params:
        p.data = p.data.float()
        setattr(p, FLOAT32_MARK, True)
    return module


def is_float32_island(parameter: torch.Tensor) -> bool:
    return bool(getattr(parameter, FLOAT32_MARK, False))


def f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 if it is in a lower precision (float64 stays: the references)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def to_training_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module.to(dtype)`` for every floating parameter except the float32 islands."""
    for p in module.parameters():
        if p.is_floating_point() and not is_float32_island(p):
            p.data = p.data.to(dtype)
    return module
