"""What FusedCoreAttention runs (check 1): the ATen operators and CUDA kernels of one bf16
forward and backward pass, and how far its results are from a float32 math-kernel reference.

The project's class is exercised as a layer calls it (``[s, b, heads, head_dim]`` queries,
``[s, b, groups, head_dim]`` keys and values, causal, grouped-query attention when heads !=
groups). On CUDA it runs under ``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``: if
neither fused kernel accepts the call, PyTorch raises instead of quietly taking the math
fallback, which keeps the ``[b, heads, s, s]`` scores.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

ONE_RANK = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
"""A ``pg_collection`` of one tensor-parallel rank (no process group needed)."""
FUSED_OPS = ("flash_attention", "efficient_attention", "cudnn_attention")
MATH_OP = "aten::_scaled_dot_product_attention_math"


class MathFallbackError(AssertionError):
    """No fused kernel accepted the call: the math fallback would have run."""


@dataclass
class Probe:
    ops: list[str] = field(default_factory=list)
    """The scaled-dot-product ATen operators that ran (forward and backward)."""
    kernels: list[str] = field(default_factory=list)
    """The CUDA kernels of those operators (names with flash / fmha / attention)."""
    errors: dict[str, float] = field(default_factory=dict)
    """Max |error| / max |reference| of the output and of dq, dk, dv."""

    def kernel_names(self) -> list[str]:
        """The kernels' names without template arguments and parameters
        (``pytorch_flash::flash_fwd_kernel``, ``fmha_cutlassB_bf16_aligned_64x64_k64_sm80``)."""
        names = (re.split(r"[<(]", k, maxsplit=1)[0].removeprefix("void ") for k in self.kernels)
        return sorted(set(names))

    def fused(self, backward: bool) -> list[str]:
        """The fused operators of the forward (or backward) pass."""
        return [
            op
            for op in self.ops
            if any(k in op for k in FUSED_OPS) and op.endswith("_backward") == backward
        ]


def _inputs(batch, heads, groups, head_dim, seq, device, dtype, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    q = torch.randn(seq, batch, heads, head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (
        torch.randn(seq, batch, groups, head_dim, generator=gen, device=device, dtype=dtype)
        for _ in range(2)
    )
    grad = torch.randn(seq, batch, heads * head_dim, generator=gen, device=device, dtype=dtype)
    return q, k, v, grad


def _reference(q, k, v, grad, heads, groups):
    """Output and input gradients from the math kernel in float32 (``[s, b, ...]`` layout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.permute(1, 2, 0, 3) for x in (q, k, v)),
            is_causal=True,
            enable_gqa=heads != groups,
        )
    out = out.permute(2, 0, 1, 3).reshape(grad.shape)
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


def probe(batch: int, heads: int, groups: int, head_dim: int, seq: int, device: str) -> Probe:
    """One bf16 forward and backward pass of ``FusedCoreAttention`` (causal), profiled."""
    from megatron.core.transformer.enums import AttnMaskType
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from megatron_tempnet.models.attention import FusedCoreAttention
    from megatron_tempnet.models.transformer import TransformerShape, transformer_config

    shape = TransformerShape(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        hidden_dropout=0.0,  # a probe of the kernels: no dropout, no RNG tracker needed
        attention_dropout=0.0,
    )
    config = transformer_config(shape, params_dtype=torch.bfloat16)
    core = FusedCoreAttention(config, 1, AttnMaskType.causal, pg_collection=ONE_RANK)
    q, k, v, grad = _inputs(batch, heads, groups, head_dim, seq, device, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cuda = device == "cuda"
    restrict = (
        sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
        if cuda
        else contextlib.nullcontext()
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with restrict, profile(activities=activities) as prof:
            out = core(q, k, v, None)  # [s, b, heads * head_dim]
            out.backward(grad)
            if cuda:
                torch.cuda.synchronize()
    except RuntimeError as e:
        if "kernel" not in str(e).lower():
            raise
        raise MathFallbackError(
            f"no flash or memory-efficient kernel for {shape}: the math fallback would have "
            f"been taken ({e})"
        ) from None
    events = prof.events()
    result = Probe(
        ops=sorted({e.name for e in events if e.name.startswith("aten::_scaled_dot_product")}),
        kernels=sorted(
            {
                e.name
                for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA
                and any(w in e.name.lower() for w in ("flash", "fmha", "attention"))
            }
        ),
    )
    reference = _reference(q, k, v, grad, heads, groups)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), reference):
        error = (got.detach().float() - want).abs().max() / want.abs().max()
        result.errors[name] = float(error)
    return result
