"""Which tensors are host tensors (by provenance), and where a call comes from."""

from __future__ import annotations

import os
import sys
import threading
import weakref

import torch

HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # this package: its frames are skipped
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE.rstrip(os.sep))))
PROJECT = tuple(
    os.path.join(REPO, p)
    for p in ("megatron_tempnet" + os.sep, "tools" + os.sep, "examples" + os.sep, "pretrain_")
)
TORCH = os.path.dirname(torch.__file__) + os.sep
TORCH_DATA = os.path.join(TORCH, "utils", "data") + os.sep

NCCL_ERROR = "No backend type associated with device type cpu"
MIX_ERROR = (
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
)
GENERATOR_ERROR = "Expected a 'cuda' device type for generator but found 'cpu'"


class DeviceRuleError(RuntimeError):
    """What NCCL or CUDA would raise on a GPU machine (their own message, then where)."""


# ------------------------------------------------------------------------------- provenance

HOST: dict[int, str] = {}  # id(tensor) -> where it was made (a host tensor)
HOST_GENERATORS: dict[int, str] = {}


def forget(table: dict, key: int) -> None:
    table.pop(key, None)


def mark_host(t: torch.Tensor, origin: str) -> torch.Tensor:
    """Record ``t`` as a host tensor made at ``origin``."""
    key = id(t)
    if key not in HOST:
        weakref.finalize(t, forget, HOST, key)
    HOST[key] = origin
    return t


def mark_device(t: torch.Tensor) -> torch.Tensor:
    HOST.pop(id(t), None)
    return t


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and id(t) in HOST


def mark_all(obj, origin: str) -> None:
    """Every tensor in ``obj`` (nested dicts, lists, tuples) becomes a host tensor."""
    if isinstance(obj, torch.Tensor):
        mark_host(obj, origin)
    elif isinstance(obj, dict):
        for value in obj.values():
            mark_all(value, origin)
    elif isinstance(obj, list | tuple):
        for value in obj:
            mark_all(value, origin)


def caller(skip_torch: bool = True) -> tuple[str, bool]:
    """``file:line`` of the code that called into torch, and whether it is the project's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(HERE) and not (skip_torch and name.startswith(TORCH)):
            return f"{short_path(name)}:{frame.f_lineno}", name.startswith(PROJECT)
        frame = frame.f_back
    return "?", False


def short_path(path: str) -> str:
    if path.startswith(REPO + os.sep):
        return os.path.relpath(path, REPO)
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


_SITE_PACKAGES = os.sep + "site-packages" + os.sep


def upstream_caller() -> bool:
    """The call comes from an installed library (megatron-core, DeepSpeed, ...), not PyTorch."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(HERE) and not name.startswith(TORCH):
            return _SITE_PACKAGES in name
        frame = frame.f_back
    return False


def called_from_torch() -> bool:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(HERE):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(TORCH)


def project_caller() -> str | None:
    """Where the project's code (or PyTorch's data loading, which runs on the host) made the
    call (``file:line``), or None for other code."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(HERE):
            host_code = name.startswith(PROJECT) or name.startswith(TORCH_DATA)
            return f"{short_path(name)}:{frame.f_lineno}" if host_code else None
        frame = frame.f_back
    return None


HOST_DEVICE = torch.device("cpu", 0)
"""What a host tensor's ``.device`` is (outside PyTorch's own code), so that ``device=x.device``
makes a host tensor of a host ``x``; the compute device is ``torch.device("cpu")``."""
DEVICE_ATTRIBUTE = torch._C.TensorBase.__dict__["device"]


def device_kind(device) -> str | None:
    """``"host"`` for ``"cpu"`` strings, ``HOST_DEVICE`` (or a map_location that keeps CPU
    storages), ``"device"`` for any other device (``torch.device("cpu")`` is the compute
    device), None for none."""
    if device is None:
        return None
    if isinstance(device, str):
        # DeepSpeed's CPU accelerator names its device "cpu": upstream, that is the device
        return "host" if device.startswith("cpu") and not upstream_caller() else "device"
    if isinstance(device, torch.device):
        return "host" if device.type == "cpu" and device.index == 0 else "device"
    if isinstance(device, int) and not isinstance(device, bool):
        return "device"
    return "host"  # a map_location function or dict: torch.load's CPU storages


class _Suspended(threading.local):
    depth = 0


SUSPENDED = _Suspended()


class suspended:
    """No checks inside (an object collective's own tensors: on NCCL, PyTorch puts them on the
    GPU itself)."""

    def __enter__(self):
        SUSPENDED.depth += 1

    def __exit__(self, *exc):
        SUSPENDED.depth -= 1
