"""The operation rule: a ``TorchFunctionMode`` that sees every PyTorch call of Python code (in
the backward pass too: ``autograd``)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from tests.helpers.device_rules import autograd
from tests.helpers.device_rules.counting import COUNTER
from tests.helpers.device_rules.provenance import (
    DEVICE_ATTRIBUTE,
    GENERATOR_ERROR,
    HOST,
    HOST_DEVICE,
    HOST_GENERATORS,
    MIX_ERROR,
    SUSPENDED,
    DeviceRuleError,
    called_from_torch,
    caller,
    device_kind,
    is_host,
    mark_all,
    mark_device,
    mark_host,
    project_caller,
)


def _tensors(args, kwargs) -> list:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _mixing(func, tensors) -> None:
    """CUDA's rule: no host tensor of >= 1 dimension beside a device tensor."""
    host = [t for t in tensors if id(t) in HOST]
    if not host or len(host) == len(tensors):
        return
    big = [t for t in host if t.dim() > 0]
    if big:
        name = getattr(func, "__name__", str(func))
        raise DeviceRuleError(
            f"{MIX_ERROR} (in {name}: a host tensor {tuple(big[0].shape)} made at "
            f"{HOST[id(big[0])]} meets a device tensor; device rule)"
        )
    COUNTER.add("host scalar read by a device operation")


def _to_target(args, kwargs) -> tuple[object, bool]:
    """``Tensor.to``'s destination (``"host"``, ``"device"`` or None: the same) and
    ``non_blocking``."""
    target, non_blocking = None, bool(kwargs.get("non_blocking", False))
    candidates = list(args[1:])
    if "device" in kwargs:
        candidates.insert(0, kwargs["device"])
    if "other" in kwargs:
        candidates.insert(0, kwargs["other"])
    for a in candidates:
        if isinstance(a, torch.Tensor):
            target = "host" if id(a) in HOST else "device"
            break
        if isinstance(a, str | int | torch.device) and not isinstance(a, bool):
            target = device_kind(a)
            break
    bools = [a for a in args[1:] if isinstance(a, bool)]
    if bools:
        non_blocking = bools[0]
    return target, non_blocking


_SYNC_METHODS = {
    torch.Tensor.item: "item()",
    torch.Tensor.tolist: "tolist()",
    torch.Tensor.__bool__: "bool()",
    torch.Tensor.__int__: "int()",
    torch.Tensor.__float__: "float()",
    torch.Tensor.__index__: "index",
    torch.Tensor.__complex__: "complex()",
    torch.Tensor.numpy: "numpy()",
    torch.Tensor.__format__: "formatted",
    torch.Tensor.__repr__: "formatted",
    torch.Tensor.__array__: "numpy()",
}
_DATA_DEPENDENT = {
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.argwhere,
    torch.Tensor.argwhere,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.unique_consecutive,
    torch.Tensor.unique_consecutive,
    torch.bincount,
    torch.Tensor.bincount,
    torch.equal,
    torch.Tensor.equal,
    torch.allclose,
    torch.Tensor.allclose,
}
_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.empty_strided,
    torch.scalar_tensor,
    torch.tril_indices,
    torch.triu_indices,
}
_FROM_PYTHON = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
_RANDOM_WITH_GENERATOR_ARG = "generator"
_HOOK_REGISTRATIONS = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool and id(i) not in HOST for i in items
    )


class DeviceRules(TorchFunctionMode):
    """The operation part of the rule (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if SUSPENDED.depth:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is DEVICE_ATTRIBUTE:
            if args and id(args[0]) in HOST and not called_from_torch():
                return HOST_DEVICE
            return func(*args, **kwargs)
        if func in _HOOK_REGISTRATIONS and len(args) > 1:  # the hook runs in backward
            args = (args[0], autograd.wrap_hook(self, args[1]), *args[2:])
        if func in _SYNC_METHODS:
            if args and id(args[0]) not in HOST:
                COUNTER.add(_SYNC_METHODS[func])
            return func(*args, **kwargs)
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if func is torch.Tensor.cpu:
            return self._cpu(func, args, kwargs)
        if func is torch.Tensor.copy_:
            return self._copy(func, args, kwargs)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_):
            return self._index(func, args, kwargs)
        tensors = _tensors(args, kwargs)
        self._generator(kwargs.get(_RANDOM_WITH_GENERATOR_ARG), tensors, kwargs)
        if func in _DATA_DEPENDENT or (func is torch.where and len(args) + len(kwargs) == 1):
            if any(id(t) not in HOST for t in tensors):
                COUNTER.add(f"{getattr(func, '__name__', func)} (value-dependent)")
        elif func is torch.Tensor.new_tensor and args and id(args[0]) not in HOST:
            COUNTER.add("blocking host-to-device copy (new_tensor)")
        _mixing(func, tensors)
        out = func(*args, **kwargs)
        kind = device_kind(kwargs.get("device"))
        if kind == "host" and isinstance(out, torch.Tensor):
            mark_host(out, caller()[0])
        elif kind == "device" and isinstance(out, torch.Tensor):
            mark_device(out)
        elif tensors and all(id(t) in HOST for t in tensors):
            origin = HOST[id(tensors[0])]
            if isinstance(out, torch.Tensor):
                mark_host(out, origin)
            elif isinstance(out, tuple | list):
                mark_all(out, origin)
        return out

    @staticmethod
    def _generator(generator, tensors, kwargs) -> None:
        if generator is None or id(generator) not in HOST_GENERATORS:
            return
        kind = device_kind(kwargs.get("device"))
        if kind == "device" or (kind is None and any(id(t) not in HOST for t in tensors)):
            raise DeviceRuleError(
                f"{GENERATOR_ERROR} (a host generator made at "
                f"{HOST_GENERATORS[id(generator)]} draws for a device tensor; device rule)"
            )

    def _factory(self, func, args, kwargs):
        kind = device_kind(kwargs.get("device"))
        self._generator(kwargs.get(_RANDOM_WITH_GENERATOR_ARG), [], kwargs)
        out = func(*args, **kwargs)
        if kind == "host":
            return mark_host(out, caller()[0])
        if kind == "device":
            if func in _FROM_PYTHON and not (args and isinstance(args[0], torch.Tensor)):
                COUNTER.add(f"blocking host-to-device copy ({func.__name__} from Python data)")
            elif args and is_host(args[0]) and func in _FROM_PYTHON:
                COUNTER.add(f"blocking host-to-device copy ({func.__name__})")
                if out is args[0]:
                    out = out.clone()
            return mark_device(out)
        if args and isinstance(args[0], torch.Tensor) and func in _FROM_PYTHON:
            return mark_host(out, HOST[id(args[0])]) if is_host(args[0]) else out
        where = project_caller()
        if where is not None:
            mark_host(out, where)
        return out

    def _to(self, func, args, kwargs):
        source = args[0]
        target, non_blocking = _to_target(args, kwargs)
        was_host = id(source) in HOST
        if target is None or (target == "host") == was_host:
            out = func(*args, **kwargs)
            if was_host and out is not source:
                mark_host(out, HOST[id(source)])
            return out
        if not non_blocking:
            COUNTER.add(
                "blocking host-to-device copy" if target == "device" else "device-to-host copy"
            )
        out = func(*args, **{**kwargs, "copy": True})  # a new tensor, as on a GPU
        if target == "host":
            return mark_host(out, caller()[0])
        return mark_device(out)

    def _cpu(self, func, args, kwargs):
        source = args[0]
        if id(source) in HOST:
            return func(*args, **kwargs)
        COUNTER.add("cpu()")
        out = source.to("cpu", copy=True)  # a new tensor, as on a GPU
        return mark_host(out, caller()[0])

    def _copy(self, func, args, kwargs):
        dst, src = args[0], args[1] if len(args) > 1 else kwargs["src"]
        non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking")) or False
        if isinstance(src, torch.Tensor) and (id(dst) in HOST) != (id(src) in HOST):
            if not non_blocking:
                COUNTER.add(
                    "device-to-host copy" if id(dst) in HOST else "blocking host-to-device copy"
                )
        return func(*args, **kwargs)

    def _index(self, func, args, kwargs):
        target = args[0]
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        if id(target) in HOST:  # a device index into a host tensor
            items = index if isinstance(index, tuple | list) else (index,)
            for i in items:
                if isinstance(i, torch.Tensor) and id(i) not in HOST and i.dim() > 0:
                    raise DeviceRuleError(
                        f"indices should be either on cpu or on the same device as the indexed "
                        f"tensor (cpu) (the host tensor was made at {HOST[id(target)]}; "
                        "device rule)"
                    )
        else:
            value = args[2] if len(args) > 2 else kwargs.get("values")
            tensor_value = isinstance(value, torch.Tensor) and value.dim() > 0
            if _bool_index(index) and (func is torch.Tensor.__getitem__ or tensor_value):
                COUNTER.add("boolean-mask indexing (value-dependent)")
        out = func(*args, **kwargs)
        if func is torch.Tensor.__getitem__ and id(target) in HOST:
            mark_host(out, HOST[id(target)])
        return out
