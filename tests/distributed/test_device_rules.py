"""The GPU's device rules on CPU (``tests.helpers.device_rules``): what NCCL and CUDA refuse is
refused here, with their messages, and host synchronisations are counted. Every distributed
test runs under the rule; these tests show that it can fail, and where it draws its lines."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers import device_rules
from tests.helpers.device_rules import GENERATOR_ERROR, MIX_ERROR, NCCL_ERROR, DeviceRuleError
from tests.helpers.distributed import run_distributed


def _raises(fn) -> str | None:
    """The rule's message for ``fn()``, or None if it passes."""
    try:
        fn()
    except DeviceRuleError as e:
        return str(e)
    return None


def _host(*shape) -> torch.Tensor:
    """A tensor made as the project's code makes a host one (a factory without ``device=``)."""
    return device_rules.mark_host(torch.zeros(*shape), "the test")


def _collectives_and_mixing() -> dict:
    from megatron_tempnet.trainer.step import compute_device

    device = torch.ones(3)  # a test's own tensor stands for an activation
    gloo = dist.new_group([0, 1], backend="gloo")
    nccl = dist.new_group([0, 1])
    out = {
        "device all_reduce": _raises(lambda: dist.all_reduce(device.clone())),
        "host all_reduce": _raises(lambda: dist.all_reduce(_host(3))),
        "host all_reduce, NCCL subgroup": _raises(lambda: dist.all_reduce(_host(3), group=nccl)),
        "host all_reduce, gloo group": _raises(lambda: dist.all_reduce(_host(3), group=gloo)),
        "host all_gather": _raises(
            lambda: dist.all_gather([torch.zeros(3), torch.zeros(3)], _host(3))
        ),
        "host broadcast_object_list": _raises(lambda: dist.broadcast_object_list([1], src=0)),
        "host + device": _raises(lambda: _host(3) + device),
        "host scalar * device": _raises(
            lambda: device * device_rules.mark_host(torch.tensor(2.0), "s")
        ),
        "cat": _raises(lambda: torch.cat([_host(2), device])),
        "moved, then added": _raises(lambda: _host(3).to(compute_device()) + device),
        "host index into device": _raises(lambda: device[_host(2).long()]),
        "device index into host": _raises(lambda: _host(3)[torch.zeros(2, dtype=torch.long)]),
        "host generator": _raises(
            lambda: torch.rand(3, device=compute_device(), generator=_project_generator())
        ),
        "host generator, host draw": _raises(lambda: torch.rand(3, generator=_project_generator())),
    }
    return out


def _project_generator():
    """A generator made as the project's code makes one (the rule reads the caller's file)."""
    code = compile("torch.Generator()", device_rules.REPO + "/megatron_tempnet/fake.py", "eval")
    return eval(code, {"torch": torch})


def test_nccl_and_cuda_refuse_host_tensors_here_too():
    results = run_distributed(_collectives_and_mixing, world_size=2)
    assert results[0] == results[1]
    out = results[0]
    for case in (
        "device all_reduce",
        "host all_reduce, gloo group",
        "host broadcast_object_list",
        "host scalar * device",
        "moved, then added",
        "host index into device",
        "host generator, host draw",
    ):
        assert out[case] is None, case
    for case in ("host all_reduce", "host all_reduce, NCCL subgroup", "host all_gather"):
        assert out[case].startswith(NCCL_ERROR), case
        assert "made at the test" in out[case]
    for case in ("host + device", "cat"):
        assert out[case].startswith(MIX_ERROR), case
    assert out["device index into host"].startswith("indices should be either on cpu")
    assert out["host generator"].startswith(GENERATOR_ERROR)
    assert "megatron_tempnet/fake.py:1" in out["host generator"]


def _provenance() -> dict:
    import os
    import tempfile

    from megatron_tempnet.trainer.step import compute_device

    host_made = _make_in_project_tensor()
    loader = torch.utils.data.DataLoader([torch.ones(2)] * 4, batch_size=2)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"w": torch.ones(2)}, os.path.join(tmp, "f.pt"))
        loaded = torch.load(os.path.join(tmp, "f.pt"))
    like = torch.zeros(2, device=host_made.device)  # device=x.device keeps x's side
    return {
        "project factory": device_rules.is_host(host_made),
        "project factory with device=": device_rules.is_host(_make_in_project_tensor("cpu")),
        "upstream or test factory": device_rules.is_host(torch.zeros(2)),
        "computed from host": device_rules.is_host(host_made * 2 + 1),
        "moved to the compute device": device_rules.is_host(host_made.to(compute_device())),
        "cpu()": device_rules.is_host(torch.ones(2).cpu()),
        "project from_numpy": device_rules.is_host(_make_in_project_tensor(numpy=True)),
        "test from_numpy": device_rules.is_host(torch.from_numpy(torch.ones(2).numpy())),
        "DataLoader batch": device_rules.is_host(next(iter(loader))),
        "torch.load": device_rules.is_host(loaded["w"]),
        "zeros(device=host.device)": device_rules.is_host(like),
        "parameter": device_rules.is_host(torch.nn.Linear(2, 2).weight),
    }


def _make_in_project_tensor(device=None, numpy: bool = False):
    """A tensor made by a factory in the project's code (``device=device`` if given)."""
    source = "torch.zeros(2)" if device is None else "torch.zeros(2, device=torch.device(d))"
    source = "torch.from_numpy(__import__('numpy').zeros(2))" if numpy else source
    code = compile(source, device_rules.REPO + "/megatron_tempnet/fake.py", "eval")
    return eval(code, {"torch": torch, "d": device})


def test_tensors_are_host_or_device_by_provenance():
    (out,) = run_distributed(_provenance, world_size=1)
    assert out == {
        "project factory": True,
        "project factory with device=": False,
        "upstream or test factory": False,
        "computed from host": True,
        "moved to the compute device": False,
        "cpu()": True,
        "project from_numpy": True,
        "test from_numpy": False,
        "DataLoader batch": True,
        "torch.load": True,
        "zeros(device=host.device)": True,
        "parameter": False,
    }


def _counted() -> dict:
    from megatron_tempnet.trainer.step import compute_device

    counter = device_rules.counter()
    x = torch.arange(6.0)
    cases = {
        "item": lambda: x.sum().item(),
        "tolist": lambda: x.tolist(),
        "bool": lambda: bool(x.sum() > 0),
        "float": lambda: float(x.sum()),
        "cpu": lambda: x.cpu(),
        "mask index": lambda: x[x > 2],
        "nonzero": lambda: x.nonzero(),
        "tensor(data, device=)": lambda: torch.tensor([1.0], device=compute_device()),
        "blocking copy to the device": lambda: _host(2).to(compute_device()),
        "non_blocking copy to the device": lambda: _host(2).to(compute_device(), non_blocking=True),
        "full(device=)": lambda: torch.full((2,), 3.0, device=compute_device()),
        "where with a Python scalar": lambda: torch.where(x > 2, x, 0.0),
        "host item": lambda: _host(1).item(),
        "mask fill": lambda: x.masked_fill(x > 2, 0.0),
        "barrier": lambda: dist.barrier(),
        "nonzero in a Function's backward": lambda: _backward_through_function(x),
        "item() in a tensor hook": lambda: _backward_with_hook(x),
        "a backward pass": lambda: (x.detach().requires_grad_() * 3).sum().backward(),
    }
    out = {}
    for name, fn in cases.items():
        before = len(counter.events)
        fn()
        out[name] = len(counter.events) - before
    return out


class _WaitsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        torch.nonzero(grad)  # autograd runs this outside the caller's mode: the rule re-enters
        return grad * 2


def _backward_through_function(x: torch.Tensor) -> None:
    _WaitsInBackward.apply(x.detach().requires_grad_()).sum().backward()


def _backward_with_hook(x: torch.Tensor) -> None:
    leaf = x.detach().requires_grad_()

    def hook(grad):
        grad.sum().item()

    leaf.register_hook(hook)
    (leaf * 3).sum().backward()


def test_host_synchronisations_are_counted():
    (out,) = run_distributed(_counted, world_size=1)
    waits = {
        "item",
        "tolist",
        "bool",
        "float",
        "cpu",
        "mask index",
        "nonzero",
        "tensor(data, device=)",
        "blocking copy to the device",
        "barrier",
        "nonzero in a Function's backward",
        "item() in a tensor hook",
    }
    assert out == {name: int(name in waits) for name in out}
