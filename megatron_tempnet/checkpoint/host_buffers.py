"""--async-save's host copies: one buffer of the exact size, pinned in place.

Why not a pinned tensor per box. ``torch.empty(shape, pin_memory=True)`` goes through
PyTorch's caching host allocator, which rounds every request up to the next power of two
(``CachingHostAllocator.h``: ``PowerOf2Ceil(size)``, for any size unless
``pinned_max_round_threshold`` is set) and keeps the rounded block. A rank's checkpoint share is
hundreds of boxes of arbitrary sizes, and each one alone can hold up to twice its bytes. For
LLaMA-2-70B at TP 8 x PP 2 x DP 4, ZeRO 1, bf16, a rank's share is 14 B x 69.0e9 / 64 = 15.1 GB.
A layer's float32 ``linear_qkv`` shard is 40 MiB (a 64 MiB block), its fc1 halves and fc2 are
112 MiB each (128 MiB blocks), and the ZeRO fragments' partial rows fall anywhere between two
powers of two. The layer boxes alone hold 1.18x their bytes (17.8 GB per rank, 142 GB per
8-GPU node instead of 121 GB), and a share of unlucky sizes holds up to 2x (30 GB per rank).

So ``HostArena`` lays the boxes out one after the other in ONE ``uint8`` buffer (each view's
offset aligned to ``ALIGNMENT`` bytes, so that ``view(dtype)`` is valid for every dtype),
allocates it at its size (whole pages) with the ordinary CPU allocator, touches every page
once (no save pays the page faults), and on CUDA pins it in place with ``cudaHostRegister``
(unpinned with ``cudaHostUnregister`` when the arena is freed). Its overhead is the alignment
padding and at most two pages: ``bytes_held / bytes_needed`` stays at about 1.00.

If ``cudaHostRegister`` fails (the host cannot lock that much memory, or the platform does not
support registering host memory), the arena warns and stays unpinned: the copies are then
blocking (slower, equally correct).
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence

import torch

from megatron_tempnet.utils.logging import get_logger, log_rank0

ALIGNMENT = 64
"""Bytes: every view starts at a multiple (a cache line; a multiple of every element size)."""
GIB = 2**30
_LOG = get_logger(__name__)  # a failed registration is one rank's: every rank says its own

Spec = tuple[tuple[int, ...], torch.dtype]
"""A box's (shape, dtype)."""


def spec_of(tensor: torch.Tensor) -> Spec:
    return tuple(tensor.shape), tensor.dtype


def spec_bytes(spec: Spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def layout(specs: Sequence[Spec], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Byte offsets of the boxes ``specs`` in one buffer (each a multiple of ``alignment``,
    in order, none overlapping) and the buffer's size in bytes (the end of the last box)."""
    offsets, end = [], 0
    for spec in specs:
        start = -(-end // alignment) * alignment
        offsets.append(start)
        end = start + spec_bytes(spec)
    return offsets, end


def power_of_two_bytes(specs: Sequence[Spec]) -> int:
    """What one pinned tensor per box holds under PyTorch's caching host allocator (each
    request rounded up to the next power of two): the allocation this module replaces."""
    return sum(1 << (n - 1).bit_length() if n else 0 for n in map(spec_bytes, specs))


def _page_aligned(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the allocation, the buffer): ``size`` bytes rounded up to whole pages, page-aligned
    inside an allocation one page larger (a registered page is shared with no other
    allocation), every page touched now (no save pays the page faults). The buffer is a
    tensor of its own storage (``is_pinned`` looks at the storage's first byte) that keeps
    the allocation alive."""
    page = os.sysconf("SC_PAGE_SIZE")
    span = -(-size // page) * page
    if not span:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)
    raw = torch.empty(span + page, dtype=torch.uint8)
    raw.fill_(0)
    start = -raw.data_ptr() % page
    return raw, torch.frombuffer(memoryview(raw.numpy())[start : start + span], dtype=torch.uint8)


class HostArena:
    """Host copies of boxes shaped and typed as ``specs``, in one buffer.

    ``views[i]``: the i-th box's tensor ``[*shape_i]`` of ``dtype_i``, a view of the buffer.
    ``pin``: register the buffer with CUDA (default: when CUDA is available).
    """

    def __init__(self, specs: Sequence[Spec], pin: bool | None = None):
        self.specs = [(tuple(shape), dtype) for shape, dtype in specs]
        offsets, size = layout(self.specs)
        raw, self.buffer = _page_aligned(size)
        self.views = [
            self.buffer[o : o + spec_bytes(s)].view(s[1]).view(s[0])
            for o, s in zip(offsets, self.specs)
        ]
        self.bytes_held = raw.numel()
        self.bytes_needed = sum(map(spec_bytes, self.specs))
        want = torch.cuda.is_available() if pin is None else pin
        self.pinned = bool(want and self.buffer.numel()) and self._register()
        log_rank0(
            "--async-save: host copies in one buffer of %.2f GiB for %.2f GiB of boxes (%.3fx), %s",
            self.bytes_held / GIB,
            self.bytes_needed / GIB,
            self.ratio,
            "pinned (cudaHostRegister)" if self.pinned else "not pinned",
        )

    @classmethod
    def for_tensors(cls, tensors: Sequence[torch.Tensor], pin: bool | None = None) -> HostArena:
        return cls([spec_of(t) for t in tensors], pin=pin)

    @property
    def ratio(self) -> float:
        """``bytes_held / bytes_needed`` (1.0 for no bytes)."""
        return self.bytes_held / self.bytes_needed if self.bytes_needed else 1.0

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are shaped and typed as this arena's boxes (reuse it)."""
        return [spec_of(t) for t in tensors] == self.specs

    def copy_from(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy ``tensors`` (device or host, shaped as the boxes) into the views; returns the
        views. Pinned: asynchronous copies, then one device synchronisation (the copies are
        complete before training changes the sources); unpinned: blocking copies."""
        if not self.holds(tensors):
            raise ValueError("the tensors to copy are not shaped and typed as the arena's boxes")
        for view, tensor in zip(self.views, tensors):
            view.copy_(tensor, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.synchronize()
        return list(self.views)

    def _register(self) -> bool:
        """Pin the buffer in place (not through the caching host allocator: no rounding);
        its unregistration is tied to the arena's lifetime. False (with a warning) when CUDA
        refuses."""
        runtime = torch.cuda.cudart()
        ptr, nbytes = self.buffer.data_ptr(), self.buffer.numel()
        result = runtime.cudaHostRegister(ptr, nbytes, 0)  # flags 0: cudaHostRegisterDefault
        code = int(result)  # the binding's cudaError enum; 0 is cudaSuccess
        if code != 0:
            _LOG.warning(
                "--async-save: cudaHostRegister of this rank's %.2f GiB host buffer failed (CUDA "
                "error %d: %s): its copies run unpinned, blocking and slower (the host could not "
                "lock that much memory, or its platform does not support registering host "
                "memory); the checkpoints are the same",
                nbytes / GIB,
                code,
                _error_string(runtime, result),
            )
            _clear_cuda_error()
            return False
        # holds the buffer: its pages are unregistered before they can be freed
        weakref.finalize(self, _unregister, runtime, self.buffer)
        return True


def _unregister(runtime, buffer: torch.Tensor) -> None:
    result = runtime.cudaHostUnregister(buffer.data_ptr())
    if int(result) != 0:
        _LOG.warning(
            "--async-save: cudaHostUnregister of the host buffer failed (CUDA error %d: %s)",
            int(result),
            _error_string(runtime, result),
        )
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """A failed runtime call leaves its error as CUDA's last error, which the check after the
    next kernel launch would report as that kernel's: a small kernel's check takes it now."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def _error_string(runtime, result) -> str:
    try:
        return str(runtime.cudaGetErrorString(result))
    except (TypeError, RuntimeError):  # a code the binding cannot describe
        return "see the CUDA runtime's error codes"
