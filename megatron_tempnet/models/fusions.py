"""Whether megatron-core's ``torch.compile``d fusions can be built here.

megatron-core compiles its bias + SwiGLU, bias + GELU and bias + dropout + add fusions with
``torch.compile`` the first time a layer runs. Anything that stops the compiler would stop the
run at its first step: on a GPU Triton needs a C compiler, Python's headers, ``libcuda.so`` and
a ``ptxas`` that knows the GPU; on a CPU inductor needs a C++ compiler. So before a model is
built, what is missing is named first (cheap), then one tiny function is compiled and run,
forward and backward, on the compute device: whatever else would fail fails there, and the
fusions are turned off with one warning. The model computes the same without them.
"""

from __future__ import annotations

import functools

import torch

from megatron_tempnet.utils.compilers import compile_error, compiler_missing
from megatron_tempnet.utils.logging import warn_rank0


def fusion_problem(cuda: bool) -> str | None:
    """Why the fusions cannot be compiled on this machine's compute device (the CUDA device
    when ``cuda``), or None when they can. The probe runs once per process."""
    return compiler_missing(cuda) or _compile_probe(cuda)


def _bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x + bias, approximate="tanh") * x


@functools.cache
def _compile_probe(cuda: bool) -> str | None:
    """Compile and run ``_bias_gelu``, forward and backward (what a fusion does at the first
    step); the failure in one line, or None."""
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        fused = torch.compile(_bias_gelu, dynamic=False)
        x = torch.linspace(-2.0, 2.0, 64, device=device, requires_grad=True)
        fused(x, torch.full((64,), 0.5, device=device)).sum().backward()
    except Exception as e:  # any compiler failure: the fusions are optional
        return f"torch.compile failed on a probe ({compile_error(e)})"
    return None


@functools.cache
def warn_fusions_off(problem: str) -> None:
    warn_rank0(
        "%s: megatron-core's bias fusions are off, the model computes the same without them "
        "(--no-bias-swiglu-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion silence this)",
        problem,
    )
