"""How a model's tensors are split over tensor-parallel ranks, and back.

A *full* tensor is the one-process (TP = 1) tensor with the vocabulary unpadded (true vocabulary
rows only); a *shard* is what one TP rank holds. Each tensor has a *kind*:

    vocab          rows (vocabulary) padded to V_pad = multiple of make_vocab_size_divisible_by x
                   TP: word_embeddings.weight, output_layer.weight
    column         rows: linear_qkv.weight/bias (by query group: each group's q, k, v rows stay
                   together, megatron-core's layout), linear_fc1.weight/bias without SwiGLU
    gated          rows, SwiGLU's fc1: the gate and up halves are split separately
                   (rank r: [gate_r; up_r])
    row            columns: linear_proj.weight, linear_fc2.weight (row-parallel layers)
    vocab_columns  columns over the vocabulary, each rank's true columns only (TempNet's W1,
                   ``[hidden, V]``: rank r holds columns [r V_pad/TP, min((r+1) V_pad/TP, V)))
    replicated     everything else (norms, row-parallel biases, positions, TempNet's others)

``split_kind`` names a state-dict key's kind from its name (the LM's names, ``GPTStack``'s
``pieces.{i}.…``, the same in every layout); ``parameter_kind`` from the parameter itself, with
megatron-core's ``tensor_model_parallel``/``partition_dim`` marks, and checks that both agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tempnet.distributed.groups import vocab_partition

KINDS = ("replicated", "vocab", "column", "gated", "row", "vocab_columns")
_VOCAB = ("word_embeddings.weight", "output_layer.weight")
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_VOCAB_COLUMNS = ("tempnet.weight1",)


def split_kind(name: str) -> str:
    """``vocab``, ``column``, ``row`` or ``replicated`` for an LM state-dict key (gating aside)."""
    if name.endswith(_VOCAB):
        return "vocab"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def tensor_kind(name: str, *, swiglu: bool) -> str:
    """The kind of the tensor ``name`` as a parameter (TempNet's W1 as the shard it trains)."""
    if name.endswith(_VOCAB_COLUMNS):
        return "vocab_columns"
    kind = split_kind(name)
    if kind == "column" and _is_gated(name, swiglu):
        return "gated"
    return kind


def parameter_kind(name: str, param: torch.Tensor, *, swiglu: bool) -> str:
    """``tensor_kind(name)``, checked against the parameter's megatron-core split marks."""
    kind = tensor_kind(name, swiglu=swiglu)
    if getattr(param, "tensor_model_parallel", False):
        dim = getattr(param, "partition_dim", 0)
        marked = {0: ("vocab", "column", "gated"), 1: ("row", "vocab_columns")}.get(dim, ())
    else:
        marked = ("replicated",)
    if kind not in marked:
        raise ValueError(
            f"parameter {name}: its name says it is split as {kind!r}, its tensor-parallel marks "
            f"say {marked}: distributed/sharding.py does not know this tensor's layout"
        )
    return kind


def _is_gated(name: str, swiglu: bool) -> bool:
    return swiglu and ".linear_fc1." in name


def shard_tensor(
    kind: str, full: torch.Tensor, rank: int, tp: int, *, padded_vocab: int
) -> torch.Tensor:
    """Rank ``rank``'s shard of a full tensor of ``kind`` (a new, contiguous tensor)."""
    if kind == "vocab":
        rows = padded_vocab // tp
        out = full.new_zeros(rows, *full.shape[1:])  # padded rows: zero
        start = rank * rows
        take = max(0, min(rows, full.shape[0] - start))
        out[:take] = full[start : start + take]
        return out
    if kind == "vocab_columns":
        part = vocab_partition(padded_vocab // tp, rank, full.shape[1])
        return full[:, part.start : part.start + part.n_true].clone()
    if kind == "row":
        return full.chunk(tp, dim=1)[rank].clone()
    if kind == "gated":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    if kind == "column":
        return full.chunk(tp, dim=0)[rank].clone()
    return full.clone()


def merge_tensor(kind: str, shards: list[torch.Tensor], *, vocab_size: int) -> torch.Tensor:
    """The full tensor of ``kind`` from every rank's shard (in rank order); inverse of
    ``shard_tensor``."""
    if kind == "vocab":
        return torch.cat(shards, dim=0)[:vocab_size]
    if kind in ("row", "vocab_columns"):
        return torch.cat(shards, dim=1)
    if kind == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if kind == "column":
        return torch.cat(shards, dim=0)
    return shards[0]


def full_shape(kind: str, shard_shape, tp: int, *, vocab_size: int) -> tuple[int, ...]:
    """The full tensor's shape, from one rank's shard shape."""
    shape = list(shard_shape)
    if kind == "vocab":
        shape[0] = vocab_size
    elif kind == "vocab_columns":
        shape[1] = vocab_size
    elif kind == "row":
        shape[1] *= tp
    elif kind in ("column", "gated"):
        shape[0] *= tp
    return tuple(shape)


def shard(
    name: str, full: torch.Tensor, rank: int, tp: int, *, swiglu: bool, padded_vocab: int
) -> torch.Tensor:
    """Rank ``rank``'s shard of the full LM tensor ``name``."""
    kind = split_kind(name)
    if kind == "column" and _is_gated(name, swiglu):
        kind = "gated"
    return shard_tensor(kind, full, rank, tp, padded_vocab=padded_vocab)


def merge(name: str, shards: list[torch.Tensor], *, swiglu: bool, vocab_size: int) -> torch.Tensor:
    """The full LM tensor ``name`` from every rank's shard (in rank order); inverse of
    ``shard``."""
    kind = split_kind(name)
    if kind == "column" and _is_gated(name, swiglu):
        kind = "gated"
    return merge_tensor(kind, shards, vocab_size=vocab_size)


@dataclass(frozen=True)
class TensorLayout:
    """What a model's split tensors need to be cut and merged: its vocabulary (unpadded, and
    padded for this run's TP size) and whether its fc1 is SwiGLU's."""

    vocab_size: int
    padded_vocab_size: int
    swiglu: bool = False
