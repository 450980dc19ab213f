"""The step's own gradient norm and clipping (ZeRO 0 in float32 and bf16): the global norm over
TP ranks equals a float64 reference, clipping scales the gradients to ``--clip-grad``, and
neither waits for the device nor copies any gradient to float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import device_rules
from tests.helpers.distributed import run_distributed

SHAPES = {"sharded": (300, 7), "replicated": (1000,), "small": (4,)}


def _grads(rank: int) -> dict[str, torch.Tensor]:
    """Every rank's gradients as that rank holds them (the replicated ones equal on all)."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        seed = 10 * i + (rank if name == "sharded" else 0)
        out[name] = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    return out


class Float64Copies(TorchDispatchMode):
    """Records every float64 tensor larger than one value per gradient that an operation
    makes (the smallest gradient has more elements than there are gradients)."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        big = isinstance(out, torch.Tensor) and out.numel() > len(SHAPES)
        if big and out.dtype == torch.float64:
            self.found.append((str(func), out.numel()))
        return out


def _clip(max_norm: float, dtype: torch.dtype) -> dict:
    from megatron.core import parallel_state

    from megatron_tempnet import compat
    from megatron_tempnet.trainer.step import clip_grad_norm_

    compat.apply_cpu_support()
    tp, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    params = []
    for name, grad in _grads(rank).items():
        p = torch.nn.Parameter(torch.zeros(grad.shape, dtype=dtype))
        p.grad = grad.to(dtype)
        p.tensor_model_parallel = name == "sharded"
        params.append(p)
    before = [p.grad.double().clone() for p in params]
    counter, start = device_rules.counter(), len(device_rules.counter().events)
    with Float64Copies() as copies:
        norm = clip_grad_norm_(params, max_norm)
    waits = counter.events[start:]
    every = [g for r in range(tp) for g in (_grads(r)["sharded"],)]
    every += [_grads(0)["replicated"], _grads(0)["small"]]
    reference = sum(g.to(dtype).double().pow(2).sum() for g in every).sqrt()
    scale = [(p.grad.double() / b)[b != 0] for p, b in zip(params, before)]
    return {"norm": float(norm), "reference": float(reference), "waits": waits,
            "copies": copies.found, "scale": torch.cat(scale)}  # fmt: skip


@pytest.mark.parametrize("tp,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_norm_and_clipping_wait_for_nothing_and_copy_no_gradient(tp, dtype):
    for max_norm in (0.0, 1.0):
        results = run_distributed(_clip, world_size=tp, args=(max_norm, dtype))
        for out in results:
            assert out["waits"] == [] and out["copies"] == []
            assert out["norm"] == pytest.approx(out["reference"], rel=1e-6)
            expected = min(1.0, max_norm / (out["reference"] + 1e-6)) if max_norm else 1.0
            tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 rounds each gradient
            assert out["scale"].sub(expected).abs().max() <= tolerance * expected
        assert max_norm == 0 or results[0]["reference"] > 2 * max_norm  # clipping acted
