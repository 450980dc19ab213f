"""Where the fused output stage's tokens are: the final hidden states whole on every TP rank,
or one sequence shard per rank (``--sequence-parallel``).

``WholeRows`` (``[T, h]`` on every rank): a chunk is consecutive tokens; each rank's vocabulary
shard gives a part of ``dL/dh``, summed over the TP group once, at the end (megatron-core's
column-parallel layer does the same).

``ShardedRows`` (``[T/tp, h]`` on each rank, rank ``r`` holding tokens ``r T/tp`` to
``(r + 1) T/tp - 1``: its flattened ``[s/tp, b]`` shard of the ``[s, b]`` tokens): chunk ``k`` is
the ``k``-th block of ``c/tp`` local rows of every rank, all-gathered rank-major (``[c, h]`` on
every rank), so that each rank computes the chunk's logits on its vocabulary shard exactly as for
whole rows. The stage works through the tokens in this order (the *stage order*) and gives its
per-token outputs back in the tokens' own order, ``[T]`` on every rank as without sequence
parallelism. A chunk's part of ``dL/dh`` is reduce-scattered to the rows' owners (each rank gets
its own rows, summed over the vocabulary shards). Tokens the backward pass recomputes one by one
(the masked ones) are shared by one SUM all-reduce of their ``[n, h]`` rows (each owner adds its
own) and their gradient returned by another. No rank holds ``[T, h]`` hidden states or
gradients; the gathered chunk (``[c, h]``) is the largest copy.

Every TP rank must pass the same upstream gradient (the loss is the same on every rank): the
tokens recomputed, and so the collectives, follow from it.
"""

from __future__ import annotations

import torch

from megatron_tempnet.distributed.groups import TPGroup

Rows = slice | torch.Tensor
"""Consecutive tokens (a slice of the stage order) or scattered ones (an index tensor)."""


def _blocks(count: int, size: int) -> list[slice]:
    """``0`` to ``count - 1`` in consecutive slices of ``size`` (the last one may be shorter)."""
    return [slice(first, min(first + size, count)) for first in range(0, count, size)]


class WholeRows:
    """Every token's hidden state on every TP rank (the stage order is the tokens' order)."""

    def __init__(self, tokens: int, tp: TPGroup, chunk: int):
        self.tokens, self.tp, self.chunk = tokens, tp, chunk

    def chunks(self) -> list[slice]:
        """The chunks of the stage order, ``chunk`` tokens each (the last one fewer)."""
        return _blocks(self.tokens, self.chunk)

    def rows(self, hidden: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The hidden states ``[n, h]`` of ``rows``, on every TP rank."""
        return hidden[rows]

    def to_stage(self, values: torch.Tensor) -> torch.Tensor:
        """``[T]`` in the tokens' order -> the stage order."""
        return values

    def to_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """``[T]`` in the stage order -> the tokens' order."""
        return values

    def add_grad(self, grad_hidden: torch.Tensor, rows: Rows, grad_logits, weight) -> None:
        """This vocabulary shard's part of ``dL/dh`` of ``rows`` (``grad_logits @ weight``) into
        ``grad_hidden``: set for a slice (rows no pass has written yet), added for an index
        tensor (the backward pass's corrections)."""
        if isinstance(rows, slice) and grad_hidden.dtype == grad_logits.dtype:
            torch.matmul(grad_logits, weight, out=grad_hidden[rows])
        elif isinstance(rows, slice):
            grad_hidden[rows] = torch.matmul(grad_logits, weight)
        else:
            part = torch.matmul(grad_logits, weight).to(grad_hidden.dtype)
            grad_hidden.index_add_(0, rows, part)

    def finish(self, grad_hidden: torch.Tensor) -> None:
        """Sum the vocabulary shards' parts of ``dL/dh`` (``[T, h]``) over the TP group."""
        self.tp.all_reduce(grad_hidden)


class ShardedRows(WholeRows):
    """This TP rank's sequence shard of the hidden states ``[T/tp, h]`` (module docstring)."""

    def __init__(self, local_tokens: int, tp: TPGroup, chunk: int, device):
        super().__init__(local_tokens * tp.size, tp, chunk)
        self.local = local_tokens
        step = max(1, chunk // tp.size)  # local rows per chunk: gathered, at most ``chunk``
        self.local_chunks = _blocks(local_tokens, step)
        tokens = torch.arange(self.tokens, device=device).view(tp.size, local_tokens)
        # [T]: the token at each position of the stage order (chunk by chunk, rank-major)
        self.order = torch.cat([tokens[:, part].reshape(-1) for part in self.local_chunks])

    def chunks(self) -> list[slice]:
        n = self.tp.size
        return [slice(n * part.start, n * part.stop) for part in self.local_chunks]

    def _local(self, rows: slice) -> slice:
        """A chunk of the stage order -> this rank's rows in it."""
        return slice(rows.start // self.tp.size, rows.stop // self.tp.size)

    def _owned(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scattered positions of the stage order -> (this rank holds the token ``[n]``, its
        local row ``[n]``, any row where it does not)."""
        token = self.order[rows]
        return token // self.local == self.tp.rank, token % self.local

    def rows(self, hidden: torch.Tensor, rows: Rows) -> torch.Tensor:
        if isinstance(rows, slice):
            return self.tp.gather_rows(hidden[self._local(rows)])  # [c, h], rank-major
        mine, local = self._owned(rows)
        shared = torch.where(mine[:, None], hidden[local], 0.0)  # [n, h]
        self.tp.all_reduce(shared)  # each row from its owner (the others add zeros)
        return shared

    def to_stage(self, values: torch.Tensor) -> torch.Tensor:
        return values[self.order]

    def to_tokens(self, values: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(values).index_copy_(0, self.order, values)

    def add_grad(self, grad_hidden: torch.Tensor, rows: Rows, grad_logits, weight) -> None:
        """The rows' ``dL/dh`` summed over the vocabulary shards, added to their owners'
        ``grad_hidden`` (``[T/tp, h]``)."""
        part = torch.matmul(grad_logits, weight).to(grad_hidden.dtype)  # [n, h]: this shard's
        if isinstance(rows, slice):
            grad_hidden[self._local(rows)] += self.tp.reduce_scatter_rows(part)
            return
        self.tp.all_reduce(part)
        mine, local = self._owned(rows)
        grad_hidden.index_add_(0, local, torch.where(mine[:, None], part, 0.0))

    def finish(self, grad_hidden: torch.Tensor) -> None:
        """Nothing: every chunk's gradient was summed on its way to its owner."""


def token_rows(hidden: torch.Tensor, tp: TPGroup, chunk: int, sequence_parallel: bool):
    """The layout of ``hidden`` (``[T, h]``, or ``[T/tp, h]`` with ``sequence_parallel``)."""
    if sequence_parallel and tp.size > 1:
        return ShardedRows(hidden.shape[0], tp, chunk, hidden.device)
    return WholeRows(hidden.shape[0], tp, chunk)
