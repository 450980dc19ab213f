"""Sharded tensor files on ``torch.distributed.checkpoint`` (DCP): every rank writes its own
boxes of the global tensors, once, into its own file; any rank reads any box back, touching
only the bytes it needs.

A *global tensor* is a tensor of the layout-free model (``checkpoint.sharded_state`` names and
shapes them: ``weight/lm.pieces.3.self_attention.linear_qkv.weight``, ``exp_avg/...``). A
``Box`` is a rectangular part of one (its ``offsets`` in the global tensor, its ``tensor`` of
the box's sizes): a save passes each rank's boxes (together they tile every global tensor
exactly once, which the coordinator checks); a load passes the boxes a rank wants, filled in
place from whatever boxes were saved (DCP's planner intersects them).

On disk, in the checkpoint directory:

    shards/rank{r:05d}.bin    rank r's boxes, raw (row-major, native byte order), one after
                              the other; digested while it is written
    shards/metadata.json      every global tensor: dtype, shape, and each saved box's file,
                              byte offset, offsets and digest (JSON: nothing to unpickle)

DCP contributes the save protocol (each rank's plan to the coordinator, the metadata, failures
raised on every rank) and the resharding arithmetic (``create_read_items_for_chunk_list``);
the storage classes decide the bytes: no ``torch.save`` per tensor, no pickle, reads through
``mmap`` of the bytes asked for only (``checkpoint.shard_reading``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import (
    Metadata,
    SavePlan,
    SavePlanner,
    StorageWriter,
    WriteItem,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError, new_digest
from megatron_tempnet.checkpoint.file_io import FileWriter

DIRECTORY = "shards"
METADATA = f"{DIRECTORY}/metadata.json"
FORMAT = 1
_CHUNK = 1 << 26  # bytes per write and digest update: bounds the host copy of a device box


def rank_file(rank: int) -> str:
    """Rank ``rank``'s file, relative to the checkpoint directory."""
    return f"{DIRECTORY}/rank{rank:05d}.bin"


@dataclass
class Box:
    """A rectangular part of the global tensor ``fqn`` (``global_shape``) at ``offsets``:
    ``tensor`` holds it (saved from, or loaded into, in place)."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size(self.offsets), torch.Size(self.tensor.shape))


@dataclass(frozen=True)
class Stored:
    """Where a saved box's bytes are: its file (relative), byte offset and length, and their
    digest (taken as they were written)."""

    path: str
    offset: int
    nbytes: int
    digest: str = ""


CELL_BYTES = 4 << 20
"""A box of at least twice this is saved as a grid of cells of at least this (at most 8 x 8,
over its first and last dimensions): each cell has its own digest, so a load that reads part
of a box (another TP split, another ZeRO range) checks about what it reads."""


def _splits(n: int, parts: int) -> list[tuple[int, int]]:
    return [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def cells(box: Box) -> list[Box]:
    """``box`` as a grid of cells (views of its tensor), or itself when it is small."""
    shape = tuple(box.tensor.shape)
    count = min(64, box.tensor.numel() * box.tensor.element_size() // CELL_BYTES)
    if count < 2 or not shape:
        return [box]
    columns = 1 if len(shape) == 1 else min(shape[-1], 8, max(2, round(count**0.5)))
    rows = min(shape[0], max(1, count // columns))
    result = []
    for r0, r1 in _splits(shape[0], rows):
        for c0, c1 in _splits(shape[-1], columns) if len(shape) > 1 else [(0, 0)]:
            part = box.tensor[r0:r1] if len(shape) == 1 else box.tensor[r0:r1, ..., c0:c1]
            offsets = list(box.offsets)
            offsets[0] += r0
            if len(shape) > 1:
                offsets[-1] += c0
            if part.numel():
                result.append(Box(box.fqn, box.global_shape, tuple(offsets), part))
    return result


def _raw_bytes(tensor: torch.Tensor) -> Iterable[memoryview]:
    """The tensor's bytes, row-major, in pieces of at most ``_CHUNK`` (each copied to the host
    on its own: a device box is never copied whole)."""
    flat = tensor.detach().reshape(-1)
    step = max(1, _CHUNK // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        host = part if part.device.type == "cpu" else part.to("cpu")
        yield memoryview(host.contiguous().view(torch.uint8).numpy())


# ---------------------------------------------------------------------------- saving


class BoxSavePlanner(SavePlanner):
    """Plans a save of one rank's boxes (the state dict DCP is given is empty)."""

    def __init__(self, boxes: list[Box]):
        self.boxes = {(b.fqn, tuple(b.offsets)): b for b in boxes}
        self.plan: SavePlan | None = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for box in self.boxes.values():
            properties = TensorProperties(dtype=box.tensor.dtype)
            data = TensorWriteData(box.chunk, properties, torch.Size(box.global_shape))
            index = MetadataIndex(box.fqn, torch.Size(box.offsets))
            items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        plans, metadata = create_default_global_save_plan(all_plans)
        _check_tiling(metadata)
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.boxes[(write_item.index.fqn, tuple(write_item.index.offset))].tensor


def _check_tiling(metadata: Metadata) -> None:
    """Every global tensor is covered by its saved boxes exactly (sizes add up; a box out of
    bounds or two that overlap would make them add up to something else only with luck, so
    overlaps are checked along the first dimension too)."""
    for fqn, md in metadata.state_dict_metadata.items():
        total = sum(_volume(c.sizes) for c in md.chunks)
        if total != _volume(md.size):
            raise CheckpointError(
                f"the saved parts of {fqn} cover {total} of its {_volume(md.size)} elements: "
                "the ranks disagree about the model's layout"
            )
        for c in md.chunks:
            if any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, md.size)):
                raise CheckpointError(f"a saved part of {fqn} lies outside its shape {md.size}")


def _volume(sizes) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


class Writer(StorageWriter):
    """Writes each rank's boxes into ``shards/rank{r}.bin`` through ``writer`` (a
    ``checkpoint.file_io.FileWriter``: flushed to disk, failures named), digesting the bytes as
    they go; the coordinator writes ``shards/metadata.json``. ``files``: what this rank wrote,
    ``{relative path: (size, digest)}``."""

    def __init__(
        self, directory: str, writer: FileWriter | None = None, algorithm: str = "xxh3_128"
    ):
        super().__init__()
        self.directory = directory
        self.writer = writer or FileWriter()
        self.algorithm = algorithm
        self.files: dict[str, tuple[int, str]] = {}

    def reset(self, checkpoint_id=None) -> None:
        self.files = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        os.makedirs(os.path.join(self.directory, DIRECTORY), exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=rank_file(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        name, results = plan.storage_data, []
        if plan.items:
            results = self._write_file(name, plan.items, planner)
        future = torch.futures.Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: list[WriteItem], planner) -> list[WriteResult]:
        results, digest, size = [], new_digest(self.algorithm), 0

        def write(f) -> None:
            nonlocal size
            for item in items:
                start, own = size, new_digest(self.algorithm)
                for part in _raw_bytes(planner.resolve_data(item)):
                    f.write(part)
                    digest.update(part)
                    own.update(part)
                    size += part.nbytes
                stored = Stored(name, start, size - start, own.hexdigest())
                results.append(WriteResult(item.index, size - start, stored))

        self.writer.stream(os.path.join(self.directory, name), write)
        self.files[name] = (size, digest.hexdigest())
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator's last step: the metadata, with every box's place."""
        stored = {r.index: r.storage_data for rank in results for r in rank}
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            chunks = []
            for i, chunk in enumerate(md.chunks):
                where = stored[MetadataIndex(fqn, chunk.offsets, i)]
                chunks.append(_chunk_record(chunk.offsets, chunk.sizes, where))
            tensors[fqn] = _tensor_record(md.properties.dtype, md.size, chunks)
        self.files[METADATA] = _write_metadata(self.directory, tensors, self.writer, self.algorithm)

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _chunk_record(offsets, sizes, where: Stored) -> dict:
    return {
        "offsets": list(offsets),
        "sizes": list(sizes),
        "file": where.path,
        "offset": where.offset,
        "nbytes": where.nbytes,
        "digest": where.digest,
    }


def _tensor_record(dtype: torch.dtype, shape, chunks: list[dict]) -> dict:
    return {"dtype": str(dtype).removeprefix("torch."), "shape": list(shape), "chunks": chunks}


def _write_metadata(
    directory: str, tensors: dict, writer: FileWriter, algorithm: str
) -> tuple[int, str]:
    record = {"format": FORMAT, "digest": algorithm, "tensors": tensors}
    data = json.dumps(record, separators=(",", ":")).encode()
    writer.stream(os.path.join(directory, METADATA), lambda f: f.write(data))
    digest = new_digest(algorithm)
    digest.update(data)
    return len(data), digest.hexdigest()


def write_full_tensors(
    directory: str,
    tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
    *,
    writer: FileWriter | None = None,
    algorithm: str = "xxh3_128",
) -> dict[str, tuple[int, str]]:
    """Write whole global tensors from one process, one at a time (``(fqn, load)``: ``load()``
    makes the tensor when its turn comes): the format ``save_boxes`` writes, each tensor one
    box (in cells), without holding more than one tensor. Returns the files with sizes and
    digests."""
    writer = writer or FileWriter()
    os.makedirs(os.path.join(directory, DIRECTORY), exist_ok=True)
    name, records, digest, size = rank_file(0), {}, new_digest(algorithm), 0

    def write(f) -> None:
        nonlocal size
        for fqn, load in tensors:
            tensor, chunks = load(), []
            whole = Box(fqn, tuple(tensor.shape), (0,) * tensor.dim(), tensor)
            for cell in cells(whole):
                start, own = size, new_digest(algorithm)
                for part in _raw_bytes(cell.tensor):
                    f.write(part)
                    digest.update(part)
                    own.update(part)
                    size += part.nbytes
                where = Stored(name, start, size - start, own.hexdigest())
                chunks.append(_chunk_record(cell.offsets, tuple(cell.tensor.shape), where))
            records[fqn] = _tensor_record(tensor.dtype, tuple(tensor.shape), chunks)

    writer.stream(os.path.join(directory, name), write)
    files = {name: (size, digest.hexdigest())}
    files[METADATA] = _write_metadata(directory, records, writer, algorithm)
    return files


def save_boxes(
    directory: str,
    boxes: list[Box],
    *,
    group=None,
    writer: FileWriter | None = None,
    algorithm: str = "xxh3_128",
) -> dict[str, tuple[int, str]]:
    """Write this rank's ``boxes`` into ``directory``: collective over ``group`` (every rank
    of it saves), or with no process group, one process writing everything. Returns the files
    this rank wrote with their sizes and digests."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    storage = Writer(directory, writer, algorithm)
    single = not (dist.is_available() and dist.is_initialized())
    try:
        with single_process_quiet():
            dcp.save(
                {},
                storage_writer=storage,
                planner=BoxSavePlanner([c for box in boxes for c in cells(box)]),
                process_group=None if single else group,
                no_dist=single,
            )
    except CheckpointException as e:  # a failure on any rank, raised on every rank
        raise CheckpointError(first_failure(e)) from None
    return storage.files


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that one process saves alone: that is what a conversion means to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def first_failure(error) -> str:
    failures = getattr(error, "failures", {}) or {}
    for rank in sorted(failures):
        cause = failures[rank]
        return str(cause[0] if isinstance(cause, tuple) else cause).removeprefix("cannot write ")
    return str(error)
