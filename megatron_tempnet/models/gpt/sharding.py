"""How the language model's tensors are split over tensor-parallel ranks, and back.

A *full* tensor is the one-process (TP = 1) tensor with the vocabulary unpadded (true vocabulary
rows only); a *shard* is what one TP rank holds in ``GPTStack`` (``layers``):

    word_embeddings.weight, output_layer.weight   rows (vocabulary), padded to V_pad = multiple
                                                  of make_vocab_size_divisible_by x TP
    linear_qkv.weight/bias                        rows, by query group (each group's q, k, v rows
                                                  stay together, megatron-core's layout)
    linear_fc1.weight/bias                        rows; with SwiGLU the gate and up halves are
                                                  split separately (rank r: [gate_r; up_r])
    linear_proj.weight, linear_fc2.weight         columns (row-parallel layers)
    everything else                               replicated (norms, row-parallel biases,
                                                  learned positions, TempNet)

Names are the keys of ``GPTStack.state_dict()`` (``pieces.{i}.…``): the same in every layout.
"""

from __future__ import annotations

import torch

_VOCAB = ("word_embeddings.weight", "output_layer.weight")
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def split_kind(name: str) -> str:
    """``vocab``, ``column``, ``row`` or ``replicated`` for a state-dict key."""
    if name.endswith(_VOCAB):
        return "vocab"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def _is_gated(name: str, swiglu: bool) -> bool:
    return swiglu and ".linear_fc1." in name


def shard(
    name: str, full: torch.Tensor, rank: int, tp: int, *, swiglu: bool, padded_vocab: int
) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``name`` (a new, contiguous tensor)."""
    kind = split_kind(name)
    if kind == "vocab":
        rows = padded_vocab // tp
        out = full.new_zeros(rows, *full.shape[1:])  # padded rows: zero
        start = rank * rows
        take = max(0, min(rows, full.shape[0] - start))
        out[:take] = full[start : start + take]
        return out
    if kind == "row":
        return full.chunk(tp, dim=1)[rank].clone()
    if kind == "column":
        if _is_gated(name, swiglu):
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
        return full.chunk(tp, dim=0)[rank].clone()
    return full.clone()


def merge(name: str, shards: list[torch.Tensor], *, swiglu: bool, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order); inverse of ``shard``."""
    kind = split_kind(name)
    if kind == "vocab":
        return torch.cat(shards, dim=0)[:vocab_size]
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "column":
        if _is_gated(name, swiglu):
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(shards, dim=0)
    return shards[0]
