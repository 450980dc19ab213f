"""The layout-free copy of the training state every checkpoint carries (``portable/``).

Beside DeepSpeed's own files (which only the layout that wrote them can read), a checkpoint
directory ``iter_XXXXXXX/`` holds ``portable/``:

- ``stage_tp{t:02d}_pp{p:03d}.pt``, written by the first data-parallel rank of tensor-parallel
  rank ``t`` of pipeline stage ``p``: for every parameter of that rank, under its layout-free
  name (``lm.pieces.{i}.…``, ``tempnet.…``, the names of the one-process model), a dict with
  ``kind`` (``distributed.sharding``'s split kind), ``param`` (the float32 master weight of
  the rank's TP shard, gathered over the ZeRO partitions; a frozen parameter's weight as it is)
  and, for a trained parameter, AdamW's ``exp_avg`` and ``exp_avg_sq`` of the same shard;
- ``index.json``, written last by rank 0: the format, the layout that wrote it (TP, PP, DP,
  ZeRO stage), the unpadded vocabulary size, AdamW's step count, the iteration, the data
  position and the run's config.

A layout reads it by merging each tensor's TP shards into the full tensor
(``sharding.merge_tensor``) and cutting its own shard (``sharding.shard_tensor``): exact, since
every value is stored as it is trained, whatever ZeRO stage wrote or reads it. Files are opened
with ``mmap``: a rank reads the bytes of the tensors it needs only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from megatron_tempnet.distributed.sharding import full_shape, merge_tensor
from megatron_tempnet.trainer.checkpoint_format import CheckpointError
from megatron_tempnet.trainer.file_io import FileWriter, load_file

DIRECTORY = "portable"
INDEX = "index.json"
FORMAT = 1
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    zero_stage: int

    def __str__(self) -> str:
        return (
            f"TP {self.tensor_parallel} x PP {self.pipeline_parallel} x DP {self.data_parallel} "
            f"(ZeRO {self.zero_stage})"
        )


def stage_file(directory: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(directory, DIRECTORY, f"stage_tp{tp_rank:02d}_pp{pp_rank:03d}.pt")


def write_stage(
    directory: str, tp_rank: int, pp_rank: int, tensors: dict[str, dict], writer: FileWriter
) -> None:
    """One (TP rank, stage)'s tensors (``writer``: the save's, see ``trainer.file_io``)."""
    path = stage_file(directory, tp_rank, pp_rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer.save({"format": FORMAT, "tensors": tensors}, path)


def write_index(directory: str, layout: Layout, writer: FileWriter, **fields) -> None:
    """The index (rank 0, after every stage file is written)."""
    path = os.path.join(directory, DIRECTORY, INDEX)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    index = {"format": FORMAT, "layout": asdict(layout), **fields}
    writer.write_text(path, json.dumps(index, indent=1))


def has_portable_state(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, DIRECTORY, INDEX))


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    return load_file(path, mmap=True)


class PortableState:
    """A checkpoint's ``portable/`` state: full tensors by layout-free name."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, DIRECTORY, INDEX)
        try:
            with open(index_path) as f:
                self.index = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path} cannot be read ({e})") from None
        if self.index.get("format") != FORMAT:
            raise CheckpointError(
                f"{index_path}: format {self.index.get('format')!r}, this version reads {FORMAT}"
            )
        self.layout = Layout(**self.index["layout"])
        self.vocab_size = int(self.index["vocab_size"])
        self.step = int(self.index["step"])
        tp, pp = self.layout.tensor_parallel, self.layout.pipeline_parallel
        self._shards: dict[str, list[dict]] = {}  # name -> the TP ranks' entries, in rank order
        for p in range(pp):
            stage = [_load(stage_file(directory, t, p))["tensors"] for t in range(tp)]
            for name in stage[0]:
                if name not in self._shards:  # a tied weight is on two stages: one is enough
                    self._shards[name] = [ranks[name] for ranks in stage]

    def names(self) -> list[str]:
        return list(self._shards)

    def __contains__(self, name: str) -> bool:
        return name in self._shards

    def kind(self, name: str) -> str:
        return self._shards[name][0]["kind"]

    def has(self, name: str, key: str) -> bool:
        return key in self._shards[name][0]

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The full tensor's shape, without reading it."""
        shard = self._shards[name][0]["param"].shape
        tp = self.layout.tensor_parallel
        return full_shape(self.kind(name), shard, tp, vocab_size=self.vocab_size)

    def full(self, name: str, key: str = "param") -> torch.Tensor:
        """The full tensor ``name`` (``param``, ``exp_avg``, ``exp_avg_sq``), merged over TP."""
        shards = [entry[key] for entry in self._shards[name]]
        return merge_tensor(self.kind(name), shards, vocab_size=self.vocab_size)
