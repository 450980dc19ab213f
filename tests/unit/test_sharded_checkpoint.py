"""The sharded checkpoint's arithmetic and files in one process: every kind of tensor-parallel
shard and every flat range of it (a ZeRO fragment) maps to boxes of the full tensor that tile
it exactly; boxes saved by some ranks load into other boxes reading only the bytes they need."""

from __future__ import annotations

import json
import os

import pytest
import torch
import xxhash

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError, DigestCache
from megatron_tempnet.checkpoint.shard_reading import (
    files_read,
    load_boxes,
    load_full,
    saved_tensors,
    verify_reads,
)
from megatron_tempnet.checkpoint.shard_storage import Box, save_boxes
from megatron_tempnet.checkpoint.sharded_state import placement
from megatron_tempnet.distributed.groups import vocab_partition
from megatron_tempnet.distributed.sharding import TensorLayout, shard_tensor

LAYOUT = TensorLayout(vocab_size=13, padded_vocab_size=16, swiglu=True)
FULL_SHAPES = {
    "vocab": (13, 3),
    "column": (8, 5),
    "row": (4, 6),
    "gated": (8, 3),
    "replicated": (7,),
    "vocab_columns": (3, 13),
}


def _shard(kind: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    if kind == "vocab_columns":  # TempNet's W1: the rank's true columns only
        part = vocab_partition(LAYOUT.padded_vocab_size // tp, rank, LAYOUT.vocab_size)
        return full[:, part.start : part.start + part.n_true].clone()
    return shard_tensor(kind, full, rank, tp, padded_vocab=LAYOUT.padded_vocab_size)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", sorted(FULL_SHAPES) + ["gated-bias"])
def test_fragments_of_every_shard_tile_the_full_tensor(kind, tp):
    """Each TP rank's shard cut into random flat fragments (ZeRO's partitions); every
    fragment's boxes, filled from the fragment's own values, rebuild the full tensor with no
    element written twice (a replicated tensor: each TP rank its share)."""
    generator = torch.Generator().manual_seed(tp)
    kind, shape = ("gated", (8,)) if kind == "gated-bias" else (kind, FULL_SHAPES[kind])
    full = torch.randn(shape, generator=generator)
    rebuilt = torch.full(shape, float("nan"))
    for rank in range(tp):
        shard = _shard(kind, full, rank, tp)
        place = placement(kind, tuple(shard.shape), LAYOUT, rank, tp)
        assert place.global_shape == shape
        flat, n = shard.reshape(-1), place.numel
        low, high = (n * rank // tp, n * (rank + 1) // tp) if kind == "replicated" else (0, n)
        cuts = torch.randint(low, high + 1, (3,), generator=generator).tolist()
        edges = sorted({low, high, *cuts})
        for a, b in zip(edges, edges[1:]):
            for start, offsets, sizes in place.boxes(a, b):
                count = int(torch.tensor(sizes).prod())
                region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                assert torch.isnan(rebuilt[region]).all(), (rank, region)
                rebuilt[region] = flat[start : start + count].view(sizes)
    assert torch.equal(rebuilt, full)


def test_boxes_saved_at_one_split_load_at_another_reading_only_their_bytes(tmp_path):
    """A [64, 32] float32 tensor saved as two row halves (two ranks' ZeRO partitions) and a
    bf16 one whole: a column half (another TP split) reads exactly its own bytes from both
    halves; the bf16 tensor converts on the way into a float32 box."""
    w = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    b = torch.randn(5, 3).bfloat16()
    halves = [Box("w", (64, 32), (0, 0), w[:32]), Box("w", (64, 32), (32, 0), w[32:])]
    save_boxes(str(tmp_path), [*halves, Box("b", (5, 3), (0, 0), b)])
    meta = json.load(open(tmp_path / "shards" / "metadata.json"))  # JSON, nothing to unpickle
    assert [c["offsets"] for c in meta["tensors"]["w"]["chunks"]] == [[0, 0], [32, 0]]
    assert saved_tensors(str(tmp_path))["b"].dtype == torch.bfloat16
    right = torch.zeros(64, 16)
    read = load_boxes(str(tmp_path), [Box("w", (64, 32), (0, 16), right)])
    assert torch.equal(right, w[:, 16:]) and read == right.numel() * 4
    as_float = torch.zeros(5, 3)
    load_boxes(str(tmp_path), [Box("b", (5, 3), (0, 0), as_float)])
    assert torch.equal(as_float, b.float()) and torch.equal(load_full(str(tmp_path), "w"), w)
    assert files_read(str(tmp_path), [Box("w", (64, 32), (40, 0), torch.zeros(8, 32))]) == {
        "shards/metadata.json",
        "shards/rank00000.bin",
    }
    with pytest.raises(CheckpointError, match=r"w is \(64, 32\) in the checkpoint and \(64, 30\)"):
        load_boxes(str(tmp_path), [Box("w", (64, 30), (0, 0), torch.zeros(64, 30))])


def test_a_save_that_leaves_part_of_a_tensor_out_is_refused(tmp_path):
    w = torch.zeros(4, 4)
    with pytest.raises(CheckpointError, match="the saved parts of w cover 8 of its 16 elements"):
        save_boxes(str(tmp_path), [Box("w", (4, 4), (0, 0), w[:2])])
    assert not os.path.exists(tmp_path / "shards" / "metadata.json")


def test_a_load_checks_the_saved_parts_it_reads_by_their_own_digests(tmp_path):
    """A flipped bit in one saved half stops a load that reads it, naming file, bytes and
    tensor; a load of the other half checks that half only; a check remembered in the cache is
    not repeated until the file changes."""
    w = torch.randn(8, 4)
    save_boxes(str(tmp_path), [Box("w", (8, 4), (0, 0), w[:4]), Box("w", (8, 4), (4, 0), w[4:])])
    record = json.load(open(tmp_path / "shards" / "metadata.json"))
    first, second = record["tensors"]["w"]["chunks"]
    assert record["digest"] == "xxh3_128"
    assert first["digest"] == xxhash.xxh3_128(w[:4].numpy().tobytes()).hexdigest()
    path = tmp_path / "shards" / "rank00000.bin"
    data = bytearray(path.read_bytes())
    data[second["offset"] + 3] ^= 1
    path.write_bytes(bytes(data))
    top, bottom = (
        Box("w", (8, 4), (0, 0), torch.zeros(4, 4)),
        Box("w", (8, 4), (4, 0), torch.zeros(4, 4)),
    )
    cache = DigestCache(str(tmp_path / "cache"))
    assert verify_reads(str(tmp_path), [top], cache) == 64
    assert verify_reads(str(tmp_path), [top], DigestCache(str(tmp_path / "cache"))) == 0
    message = f"{path} is altered: its bytes 64 to 128 \\(w\\) differ from their digest"
    with pytest.raises(CheckpointError, match=message):
        verify_reads(str(tmp_path), [bottom], cache)


def test_a_large_box_is_saved_in_cells_so_a_part_of_it_is_checked_alone(tmp_path):
    """A [512, 4096] float32 box (8 MiB) is saved as cells with their own digests: a load of
    its right half checks about half of it, and the values come back exactly."""
    w = torch.randn(512, 4096)
    save_boxes(str(tmp_path), [Box("w", (512, 4096), (0, 0), w)])
    chunks = json.load(open(tmp_path / "shards" / "metadata.json"))["tensors"]["w"]["chunks"]
    assert len(chunks) == 2 and sum(c["nbytes"] for c in chunks) == w.numel() * 4
    right = Box("w", (512, 4096), (0, 2048), torch.zeros(512, 2048))
    assert verify_reads(str(tmp_path), [right]) == w.numel() * 4 // 2
    load_boxes(str(tmp_path), [right])
    assert torch.equal(right.tensor, w[:, 2048:])
