"""Where tensors cross into or out of the operation rule: collectives (NCCL's rule), loaders,
``torch.load``, NumPy, generators and explicit synchronisations."""

from __future__ import annotations

import functools
import inspect
import sys
import weakref

import torch
import torch.distributed as dist

from tests.helpers.device_rules.counting import COUNTER
from tests.helpers.device_rules.provenance import (
    HOST,
    HOST_GENERATORS,
    NCCL_ERROR,
    SUSPENDED,
    DeviceRuleError,
    caller,
    device_kind,
    forget,
    mark_all,
    mark_host,
    project_caller,
    suspended,
)

# ------------------------------------------------------------------------------ collectives

_gloo_groups: set[int] = set()
_keep_groups: list = []  # groups live as long as the process: ids stay theirs

_OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
_TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _collective_tensors(bound: inspect.BoundArguments) -> list:
    found = []
    for name, value in bound.arguments.items():
        if name == "group":
            continue
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _check_group(name: str, group, tensors) -> None:
    if SUSPENDED.depth or (group is not None and id(group) in _gloo_groups):
        return
    host = [t for t in tensors if id(t) in HOST]
    if host:
        raise DeviceRuleError(
            f"{NCCL_ERROR} (torch.distributed.{name} on an NCCL group got a host tensor "
            f"{tuple(host[0].shape)} made at {HOST[id(host[0])]}; device rule)"
        )


def _wrap_collective(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        _check_group(name, bound.arguments.get("group"), _collective_tensors(bound))
        return original(*args, **kwargs)

    collective.__device_rule_original__ = original
    return collective


def _wrap_batch_p2p(original):
    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:
            _check_group("batch_isend_irecv", op.group, [op.tensor])
        return original(p2p_op_list)

    batch_isend_irecv.__device_rule_original__ = original
    return batch_isend_irecv


def _wrap_object_collective(name: str, original):
    @functools.wraps(original)
    def object_collective(*args, **kwargs):
        COUNTER.add(f"torch.distributed.{name}")
        with suspended():
            out = original(*args, **kwargs)
        for value in (*args, *kwargs.values()):  # received objects land in the caller's lists
            if isinstance(value, list):
                mark_all(value, f"an object received by torch.distributed.{name}")
        return out

    object_collective.__device_rule_original__ = original
    return object_collective


def _wrap_sync(name: str, original):
    @functools.wraps(original)
    def sync(*args, **kwargs):
        COUNTER.add(name)
        return original(*args, **kwargs)

    sync.__device_rule_original__ = original
    return sync


def _wrap_new_group(original):
    @functools.wraps(original)
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        backend = kwargs.get("backend")
        if backend is None and len(args) > 2:
            backend = args[2]
        if backend is not None and str(backend).lower() == "gloo" and group is not None:
            _gloo_groups.add(id(group))
            _keep_groups.append(group)
        return group

    new_group.__device_rule_original__ = original
    return new_group


def _collective_replacements() -> dict:
    c10d = dist.distributed_c10d
    out = {}
    for name in _TENSOR_COLLECTIVES:
        if hasattr(c10d, name):
            out[name] = _wrap_collective(name, getattr(c10d, name))
    out["batch_isend_irecv"] = _wrap_batch_p2p(c10d.batch_isend_irecv)
    for name in _OBJECT_COLLECTIVES:
        out[name] = _wrap_object_collective(name, getattr(c10d, name))
    out["barrier"] = _wrap_sync("torch.distributed.barrier", c10d.barrier)
    out["new_group"] = _wrap_new_group(c10d.new_group)
    return out


def _rebind(replacements: dict) -> None:
    """Put the wrappers wherever the originals are reachable by name: ``torch.distributed``,
    ``distributed_c10d`` and any loaded module that bound one (``dist_all_gather_func``)."""
    originals = {id(getattr(dist.distributed_c10d, n)): w for n, w in replacements.items()}
    for module in list(sys.modules.values()):
        if module is None or module.__name__.startswith(("torch._", "tests.helpers.device")):
            if module is not dist.distributed_c10d:
                continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            if callable(value) and id(value) in originals:
                setattr(module, key, originals[id(value)])


# ------------------------------------------------------------------------- other entry points


def _install_loaders() -> None:
    from torch.utils.data import dataloader

    original_next = dataloader._BaseDataLoaderIter.__next__

    def __next__(self):
        batch = original_next(self)
        mark_all(batch, "a DataLoader batch")
        return batch

    dataloader._BaseDataLoaderIter.__next__ = __next__

    original_load = torch.load

    @functools.wraps(original_load)
    def load(*args, **kwargs):
        out = original_load(*args, **kwargs)
        location = kwargs.get("map_location", args[1] if len(args) > 1 else None)
        if device_kind(location) != "device":
            mark_all(out, f"torch.load at {caller()[0]}")
        return out

    torch.load = load
    torch.serialization.load = load


def _install_numpy() -> None:
    """``from_numpy`` and ``frombuffer`` (the mode does not see them): host tensors when the
    project's code (or PyTorch's data loading) makes them, like a factory's."""
    for name in ("from_numpy", "frombuffer"):
        original = getattr(torch, name)

        def host(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            where = project_caller()
            return out if where is None else mark_host(out, where)

        host.__device_rule_original__ = original
        setattr(torch, name, functools.wraps(original)(host))


def _install_generator() -> None:
    base = torch._C.Generator

    class _Meta(type(base)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, base) if cls is RuleGenerator else super().__instancecheck__(obj)

    class RuleGenerator(base, metaclass=_Meta):
        """``torch.Generator`` recording whether project code made it without a device."""

        def __new__(cls, device=None):
            self = base.__new__(cls) if device is None else base.__new__(cls, device)
            where = project_caller()
            if where is not None and (device is None or device_kind(device) == "host"):
                key = id(self)
                HOST_GENERATORS[key] = where
                weakref.finalize(self, forget, HOST_GENERATORS, key)
            return self

    RuleGenerator.__name__ = RuleGenerator.__qualname__ = "Generator"
    torch.Generator = RuleGenerator


def _install_synchronize() -> None:
    torch.cuda.synchronize = _wrap_sync("torch.cuda.synchronize", torch.cuda.synchronize)
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return
    accelerator = get_accelerator()
    accelerator.synchronize = _wrap_sync("accelerator synchronize", accelerator.synchronize)


def install() -> None:
    """Every boundary above, in this process."""
    _rebind(_collective_replacements())
    _install_loaders()
    _install_numpy()
    _install_generator()
    _install_synchronize()
