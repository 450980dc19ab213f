"""The GPU's rules, enforced on CPU tensors: NCCL takes device tensors only, CUDA does not mix
devices in one operation, and a host synchronisation is counted wherever it happens.

On a machine without a GPU every tensor is a CPU tensor, so a tensor that would be left on the
host on a GPU machine (and crash NCCL or a CUDA kernel there) passes every CPU test. The rule tells
the two kinds apart by **provenance**:

* **host**: made by a factory (``torch.tensor``, ``zeros``, ``arange``, ``from_numpy``, ...)
  without ``device=`` in the project's own code (or PyTorch's data loading); by ``.cpu()`` or
  ``.to("cpu")`` (the string: DeepSpeed's CPU accelerator calls its device ``"cpu"``, so
  upstream code's ``"cpu"`` is the device); with ``device=x.device`` of a host ``x`` (a host
  tensor's ``.device`` reads ``HOST_DEVICE`` outside PyTorch's own code); in a ``DataLoader``
  batch; by ``torch.load`` (unless mapped to a device); in an object received by an object
  collective; and everything computed from host tensors only.
* **device**: everything else: parameters, activations, whatever upstream libraries allocate (they
  pass ``device=torch.cuda.current_device()``), anything made with ``device=`` or moved with
  ``.to(device)``, and the tests' own tensors (they stand for a model's).

A ``torch.Generator()`` made without ``device=`` in project code is a host generator.

With the rule installed (``install``):

* a collective (every ``torch.distributed`` function, rebound wherever an upstream module holds
  it by name) given a host tensor on a group that was not created with ``backend="gloo"`` raises
  NCCL's error, ``No backend type associated with device type cpu``;
* an operation that mixes a host tensor of one or more dimensions with a device tensor raises
  CUDA's, ``Expected all tensors to be on the same device, but found at least two devices, cuda:0
  and cpu!`` (a 0-dimensional host tensor is a CPU scalar, which CUDA accepts); a host generator
  drawing for a device tensor raises CUDA's generator error;
* every device-to-host synchronisation is counted (``SyncCounter``): ``.item()``, ``.tolist()``,
  ``bool()``/``int()``/``float()``, ``.cpu()``, ``.numpy()``, formatting, outputs whose shape
  depends on values (boolean-mask indexing, ``nonzero``, ``unique``, ...), blocking copies
  between host and device (``.to(device)`` without ``non_blocking=True``, ``torch.tensor(data,
  device=...)``), a host scalar read by a device operation, object collectives, barriers and
  explicit ``synchronize`` calls. Each event records where it happened.

Every message adds where the offending host tensor was made. The rule is test support: the
library never imports it. ``torch.compile``d functions run as plain Python under it (Dynamo
cannot trace its mode). Its limits: operations only PyTorch's C++ calls (autograd's backward)
and tensors of the legacy constructors (``torch.Tensor([...])``) are not seen.
"""

from __future__ import annotations

import atexit
import collections
import functools
import inspect
import json
import os
import sys
import threading
import traceback
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROJECT = tuple(
    os.path.join(REPO, p)
    for p in ("megatron_tempnet" + os.sep, "tools" + os.sep, "examples" + os.sep, "pretrain_")
)
_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_DATA = os.path.join(_TORCH, "utils", "data") + os.sep

NCCL_ERROR = "No backend type associated with device type cpu"
MIX_ERROR = (
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
)
GENERATOR_ERROR = "Expected a 'cuda' device type for generator but found 'cpu'"


class DeviceRuleError(RuntimeError):
    """What NCCL or CUDA would raise on a GPU machine (their own message, then where)."""


# ------------------------------------------------------------------------------- provenance

_host: dict[int, str] = {}  # id(tensor) -> where it was made (a host tensor)
_host_generators: dict[int, str] = {}


def _forget(table: dict, key: int) -> None:
    table.pop(key, None)


def mark_host(t: torch.Tensor, origin: str) -> torch.Tensor:
    """Record ``t`` as a host tensor made at ``origin``."""
    key = id(t)
    if key not in _host:
        weakref.finalize(t, _forget, _host, key)
    _host[key] = origin
    return t


def mark_device(t: torch.Tensor) -> torch.Tensor:
    _host.pop(id(t), None)
    return t


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and id(t) in _host


def _mark_all(obj, origin: str) -> None:
    """Every tensor in ``obj`` (nested dicts, lists, tuples) becomes a host tensor."""
    if isinstance(obj, torch.Tensor):
        mark_host(obj, origin)
    elif isinstance(obj, dict):
        for value in obj.values():
            _mark_all(value, origin)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _mark_all(value, origin)


def _caller(skip_torch: bool = True) -> tuple[str, bool]:
    """``file:line`` of the code that called into torch, and whether it is the project's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _THIS and not (skip_torch and name.startswith(_TORCH)):
            return f"{_short(name)}:{frame.f_lineno}", name.startswith(_PROJECT)
        frame = frame.f_back
    return "?", False


def _short(path: str) -> str:
    if path.startswith(REPO + os.sep):
        return os.path.relpath(path, REPO)
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


_SITE_PACKAGES = os.sep + "site-packages" + os.sep


def _upstream_caller() -> bool:
    """The call comes from an installed library (megatron-core, DeepSpeed, ...), not PyTorch."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _THIS and not name.startswith(_TORCH):
            return _SITE_PACKAGES in name
        frame = frame.f_back
    return False


def _called_from_torch() -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == _THIS:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_TORCH)


def _project_caller() -> str | None:
    """Where the project's code (or PyTorch's data loading, which runs on the host) made the
    call (``file:line``), or None for other code."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _THIS:
            host_code = name.startswith(_PROJECT) or name.startswith(_TORCH_DATA)
            return f"{_short(name)}:{frame.f_lineno}" if host_code else None
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------------- counting


class SyncCounter:
    """Host synchronisations, each with the label current when it happened (``mark``)."""

    def __init__(self):
        self.label: object = None
        self.events: list[tuple[object, str, str]] = []

    def mark(self, label) -> None:
        self.label = label

    def add(self, kind: str) -> None:
        self.events.append((self.label, kind, _where()))

    def by_label(self) -> dict:
        out: dict = collections.defaultdict(list)
        for label, kind, where in self.events:
            out[label].append((kind, where))
        return dict(out)

    def counts(self) -> dict:
        return {label: len(events) for label, events in self.by_label().items()}


def _where() -> str:
    """The innermost frame outside torch and this file, and the project's frame above it."""
    stack = traceback.extract_stack()[:-3]
    upstream = project = None
    for entry in reversed(stack):
        path = os.path.abspath(entry.filename)
        if path == _THIS or path.startswith(_TORCH):
            continue
        if upstream is None:
            upstream = f"{_short(path)}:{entry.lineno}"
        if path.startswith(_PROJECT):
            project = f"{_short(path)}:{entry.lineno}"
            break
    if project is None or project == upstream:
        return upstream or "?"
    return f"{upstream} (from {project})"


_counter = SyncCounter()


def counter() -> SyncCounter:
    """The process's counter (events of the installed rule)."""
    return _counter


# ------------------------------------------------------------------------------ the op rule


HOST_DEVICE = torch.device("cpu", 0)
"""What a host tensor's ``.device`` is (outside PyTorch's own code), so that ``device=x.device``
makes a host tensor of a host ``x``; the compute device is ``torch.device("cpu")``."""
_DEVICE_ATTRIBUTE = torch._C.TensorBase.__dict__["device"]


def _device_kind(device) -> str | None:
    """``"host"`` for ``"cpu"`` strings, ``HOST_DEVICE`` (or a map_location that keeps CPU
    storages), ``"device"`` for any other device (``torch.device("cpu")`` is the compute
    device), None for none."""
    if device is None:
        return None
    if isinstance(device, str):
        # DeepSpeed's CPU accelerator names its device "cpu": upstream, that is the device
        return "host" if device.startswith("cpu") and not _upstream_caller() else "device"
    if isinstance(device, torch.device):
        return "host" if device.type == "cpu" and device.index == 0 else "device"
    if isinstance(device, int) and not isinstance(device, bool):
        return "device"
    return "host"  # a map_location function or dict: torch.load's CPU storages


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
    host = [t for t in tensors if id(t) in _host]
    if not host or len(host) == len(tensors):
        return
    big = [t for t in host if t.dim() > 0]
    if big:
        name = getattr(func, "__name__", str(func))
        raise DeviceRuleError(
            f"{MIX_ERROR} (in {name}: a host tensor {tuple(big[0].shape)} made at "
            f"{_host[id(big[0])]} meets a device tensor; device rule)"
        )
    _counter.add("host scalar read by a device operation")


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
            target = "host" if id(a) in _host else "device"
            break
        if isinstance(a, str | int | torch.device) and not isinstance(a, bool):
            target = _device_kind(a)
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


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool and id(i) not in _host for i in items
    )


class _Suspended(threading.local):
    depth = 0


_suspended = _Suspended()


class suspended:
    """No checks inside (an object collective's own tensors: on NCCL, PyTorch puts them on the
    GPU itself)."""

    def __enter__(self):
        _suspended.depth += 1

    def __exit__(self, *exc):
        _suspended.depth -= 1


class DeviceRules(TorchFunctionMode):
    """The operation part of the rule (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _suspended.depth:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DEVICE_ATTRIBUTE:
            if args and id(args[0]) in _host and not _called_from_torch():
                return HOST_DEVICE
            return func(*args, **kwargs)
        if func in _SYNC_METHODS:
            if args and id(args[0]) not in _host:
                _counter.add(_SYNC_METHODS[func])
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
            if any(id(t) not in _host for t in tensors):
                _counter.add(f"{getattr(func, '__name__', func)} (value-dependent)")
        elif func is torch.Tensor.new_tensor and args and id(args[0]) not in _host:
            _counter.add("blocking host-to-device copy (new_tensor)")
        _mixing(func, tensors)
        out = func(*args, **kwargs)
        kind = _device_kind(kwargs.get("device"))
        if kind == "host" and isinstance(out, torch.Tensor):
            mark_host(out, _caller()[0])
        elif kind == "device" and isinstance(out, torch.Tensor):
            mark_device(out)
        elif tensors and all(id(t) in _host for t in tensors):
            origin = _host[id(tensors[0])]
            if isinstance(out, torch.Tensor):
                mark_host(out, origin)
            elif isinstance(out, tuple | list):
                _mark_all(out, origin)
        return out

    @staticmethod
    def _generator(generator, tensors, kwargs) -> None:
        if generator is None or id(generator) not in _host_generators:
            return
        kind = _device_kind(kwargs.get("device"))
        if kind == "device" or (kind is None and any(id(t) not in _host for t in tensors)):
            raise DeviceRuleError(
                f"{GENERATOR_ERROR} (a host generator made at "
                f"{_host_generators[id(generator)]} draws for a device tensor; device rule)"
            )

    def _factory(self, func, args, kwargs):
        kind = _device_kind(kwargs.get("device"))
        self._generator(kwargs.get(_RANDOM_WITH_GENERATOR_ARG), [], kwargs)
        out = func(*args, **kwargs)
        if kind == "host":
            return mark_host(out, _caller()[0])
        if kind == "device":
            if func in _FROM_PYTHON and not (args and isinstance(args[0], torch.Tensor)):
                _counter.add(f"blocking host-to-device copy ({func.__name__} from Python data)")
            elif args and is_host(args[0]) and func in _FROM_PYTHON:
                _counter.add(f"blocking host-to-device copy ({func.__name__})")
                if out is args[0]:
                    out = out.clone()
            return mark_device(out)
        if args and isinstance(args[0], torch.Tensor) and func in _FROM_PYTHON:
            return mark_host(out, _host[id(args[0])]) if is_host(args[0]) else out
        where = _project_caller()
        if where is not None:
            mark_host(out, where)
        return out

    def _to(self, func, args, kwargs):
        source = args[0]
        target, non_blocking = _to_target(args, kwargs)
        was_host = id(source) in _host
        if target is None or (target == "host") == was_host:
            out = func(*args, **kwargs)
            if was_host and out is not source:
                mark_host(out, _host[id(source)])
            return out
        if not non_blocking:
            _counter.add(
                "blocking host-to-device copy" if target == "device" else "device-to-host copy"
            )
        out = func(*args, **{**kwargs, "copy": True})  # a new tensor, as on a GPU
        if target == "host":
            return mark_host(out, _caller()[0])
        return mark_device(out)

    def _cpu(self, func, args, kwargs):
        source = args[0]
        if id(source) in _host:
            return func(*args, **kwargs)
        _counter.add("cpu()")
        out = source.to("cpu", copy=True)  # a new tensor, as on a GPU
        return mark_host(out, _caller()[0])

    def _copy(self, func, args, kwargs):
        dst, src = args[0], args[1] if len(args) > 1 else kwargs["src"]
        non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking")) or False
        if isinstance(src, torch.Tensor) and (id(dst) in _host) != (id(src) in _host):
            if not non_blocking:
                _counter.add(
                    "device-to-host copy" if id(dst) in _host else "blocking host-to-device copy"
                )
        return func(*args, **kwargs)

    def _index(self, func, args, kwargs):
        target = args[0]
        index = args[1] if len(args) > 1 else kwargs.get("indices")
        if id(target) in _host:  # a device index into a host tensor
            items = index if isinstance(index, tuple | list) else (index,)
            for i in items:
                if isinstance(i, torch.Tensor) and id(i) not in _host and i.dim() > 0:
                    raise DeviceRuleError(
                        f"indices should be either on cpu or on the same device as the indexed "
                        f"tensor (cpu) (the host tensor was made at {_host[id(target)]}; "
                        "device rule)"
                    )
        else:
            value = args[2] if len(args) > 2 else kwargs.get("values")
            tensor_value = isinstance(value, torch.Tensor) and value.dim() > 0
            if _bool_index(index) and (func is torch.Tensor.__getitem__ or tensor_value):
                _counter.add("boolean-mask indexing (value-dependent)")
        out = func(*args, **kwargs)
        if func is torch.Tensor.__getitem__ and id(target) in _host:
            mark_host(out, _host[id(target)])
        return out


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
    "_all_gather_base",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
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
    if _suspended.depth or (group is not None and id(group) in _gloo_groups):
        return
    host = [t for t in tensors if id(t) in _host]
    if host:
        raise DeviceRuleError(
            f"{NCCL_ERROR} (torch.distributed.{name} on an NCCL group got a host tensor "
            f"{tuple(host[0].shape)} made at {_host[id(host[0])]}; device rule)"
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
        _counter.add(f"torch.distributed.{name}")
        with suspended():
            out = original(*args, **kwargs)
        for value in (*args, *kwargs.values()):  # received objects land in the caller's lists
            if isinstance(value, list):
                _mark_all(value, f"an object received by torch.distributed.{name}")
        return out

    object_collective.__device_rule_original__ = original
    return object_collective


def _wrap_sync(name: str, original):
    @functools.wraps(original)
    def sync(*args, **kwargs):
        _counter.add(name)
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
        _mark_all(batch, "a DataLoader batch")
        return batch

    dataloader._BaseDataLoaderIter.__next__ = __next__

    original_load = torch.load

    @functools.wraps(original_load)
    def load(*args, **kwargs):
        out = original_load(*args, **kwargs)
        location = kwargs.get("map_location", args[1] if len(args) > 1 else None)
        if _device_kind(location) != "device":
            _mark_all(out, f"torch.load at {_caller()[0]}")
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
            where = _project_caller()
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
            where = _project_caller()
            if where is not None and (device is None or _device_kind(device) == "host"):
                key = id(self)
                _host_generators[key] = where
                weakref.finalize(self, _forget, _host_generators, key)
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


# -------------------------------------------------------------------------------- install

_installed: DeviceRules | None = None
_lock = threading.Lock()


def install(report: str | None = None) -> SyncCounter:
    """Enforce the rule in this process from now on (idempotent); returns the counter.
    ``report``: a directory where each rank writes ``rank{r}.json`` (its events by label) at
    exit."""
    global _installed
    with _lock:
        if _installed is None:
            # torch.compile'd functions run as plain Python: Dynamo cannot trace the rule's
            # mode, and this way their operations are checked like any other
            torch._dynamo.config.disable = True
            _rebind(_collective_replacements())
            _install_loaders()
            _install_numpy()
            _install_generator()
            _install_synchronize()
            _installed = DeviceRules()
            _installed.__enter__()
        if report is not None:
            atexit.register(_write_report, report)
    return _counter


def installed() -> bool:
    return _installed is not None


def _write_report(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    events = [[label, kind, where] for label, kind, where in _counter.events]
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump(events, f)


def read_report(directory: str) -> dict[int, list[tuple]]:
    """``{rank: [(label, kind, where), ...]}`` written by ``install(report=directory)``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out[int(name[4:-5])] = [tuple(e) for e in json.load(f)]
    return out


def assert_steady_syncs(directory: str, steady: list[int], ranks: int) -> None:
    """In the report ``directory`` of a training run on ``ranks`` processes: at most one host
    synchronisation per rank in each of the ``steady`` iterations (the ones found are listed
    with their places otherwise), and the one read of the step's statistics is seen. Prints
    the count of every iteration (``pytest -s``)."""
    events = read_report(directory)
    assert sorted(events) == list(range(ranks))
    for rank, found in events.items():
        per_iteration = collections.Counter(label for label, _, _ in found)
        print(f"rank {rank}: host synchronisations per iteration {dict(per_iteration)}")
        for iteration in steady:
            waits = [(kind, where) for label, kind, where in found if label == iteration]
            assert len(waits) <= 1, (rank, iteration, waits)
        assert per_iteration[steady[0]] >= 1


def count_iterations() -> None:
    """Label the counter's events with the training iteration they belong to (the trainer sets
    each iteration's learning rates first)."""
    from megatron_tempnet.trainer import loop

    original = loop.set_learning_rates

    def set_learning_rates(optimizer, iteration, opt):
        _counter.mark(iteration + 1)
        return original(optimizer, iteration, opt)

    loop.set_learning_rates = set_learning_rates


def install_for_run(report: str) -> None:
    """An entry point's process: the rule, iterations labelled, the report written at exit."""
    install(report)
    count_iterations()
