"""Tensor-parallel groups, megatron-core's vocabulary partitioning, and the host group."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel process group with this process's rank in it.

    ``group=None`` with ``size=1`` means no tensor parallelism: every collective is a no-op.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """In-place all-reduce over the group (skipped when the group has one rank)."""
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (no autograd)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` ``[n, ...]`` stacked rank-major: ``[size * n, ...]`` (no
        autograd)."""
        if self.size == 1:
            return rows
        out = rows.new_empty((self.size * rows.shape[0], *rows.shape[1:]))
        dist.all_gather_single(out, rows.contiguous(), group=self.group)
        return out

    def reduce_scatter_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``[size * n, ...]`` summed over the ranks; this rank's block of ``n`` rows (rank-major;
        no autograd)."""
        if self.size == 1:
            return rows
        out = rows.new_empty((rows.shape[0] // self.size, *rows.shape[1:]))
        dist.reduce_scatter_single(out, rows.contiguous(), group=self.group)
        return out


def compute_device() -> torch.device:
    """Where batches and reduced statistics live (NCCL reduces CUDA tensors only)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_tp_group(tp_group: dist.ProcessGroup | None = None) -> TPGroup:
    """The group to reduce over, with this process's rank in it; ``None``: no tensor
    parallelism (one rank, no communication). Callers pass their group explicitly, e.g.
    megatron-core's ``parallel_state.get_tensor_model_parallel_group()``."""
    if tp_group is None:
        return TPGroup(group=None, rank=0, size=1)
    return TPGroup(group=tp_group, rank=dist.get_rank(tp_group), size=dist.get_world_size(tp_group))


@dataclass(frozen=True)
class VocabPartition:
    """This rank's slice ``[start, end)`` of the padded vocabulary (megatron-core's layout).

    ``n_true`` is how many of the slice's columns are real tokens (``< vocab_size``); the rest are
    padding that every sum, norm and TempNet input must skip.
    """

    start: int
    end: int
    n_true: int


def vocab_partition(partition_size: int, rank: int, vocab_size: int) -> VocabPartition:
    """Megatron-core splits the padded vocabulary into equal contiguous slices, rank-major."""
    start = rank * partition_size
    end = start + partition_size
    n_true = max(0, min(end, vocab_size) - start)
    return VocabPartition(start=start, end=end, n_true=n_true)


def parallel_argmax(local: torch.Tensor, start: int, tp: TPGroup) -> torch.Tensor:
    """Global argmax ``[n]`` of vocabulary-parallel ``[n, v_local]`` values whose first column is
    token ``start``: a MAX then a MIN all-reduce of ``[n]``; ties go to the lowest id."""
    n = local.shape[0]
    best = local.max(dim=-1).values if local.shape[-1] else local.new_full((n,), float("-inf"))
    tp.all_reduce(best, dist.ReduceOp.MAX)
    big = torch.iinfo(torch.int64).max
    index = torch.full((n,), big, dtype=torch.int64, device=local.device)
    if local.shape[-1]:
        hits = local == best[:, None]
        index = torch.where(hits.any(-1), hits.int().argmax(-1) + start, big).to(torch.int64)
    tp.all_reduce(index, dist.ReduceOp.MIN)
    return index


_host: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (default group, host group)


def init_host_group(timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of every rank, with its own ``timeout``, for the collectives that wait while
    a rank works on files: a checkpoint's exchanges (also from ``--async-save``'s background
    thread), and the other ranks' wait while rank 0 scans the data at start-up. Training's
    collectives keep --distributed-timeout-minutes. Collective; ``host_group`` returns it until
    the default group is destroyed."""
    global _host
    group = dist.new_group(backend="gloo", timeout=timeout)
    dist.barrier(group=group)  # its connections made now, not in the first save
    _host = (dist.group.WORLD, group)
    return group


def host_group() -> dist.ProcessGroup | None:
    """The group ``init_host_group`` made for the current default group, else None."""
    if _host is None or _host[0] is not dist.group.WORLD or dist.group.WORLD is None:
        return None
    return _host[1]
