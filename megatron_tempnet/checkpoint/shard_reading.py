"""Reading sharded tensor files (``checkpoint.shard_storage`` writes them): the index, the boxes a
rank wants filled from whichever saved boxes they overlap (through ``mmap``: only the bytes a
box needs are read), and the digests of the saved boxes a load reads.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    ReadItem,
    StorageReader,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError, new_digest
from megatron_tempnet.checkpoint.shard_storage import (
    FORMAT,
    METADATA,
    Box,
    Stored,
    first_failure,
    single_process_quiet,
)


@dataclass(frozen=True)
class SavedTensor:
    """A global tensor as the metadata describes it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    files: tuple[str, ...]


def load_full(directory: str, fqn: str, saved: SavedTensor | None = None) -> torch.Tensor:
    """The whole global tensor ``fqn``, in its saved dtype."""
    saved = saved or saved_tensors(directory)[fqn]
    out = torch.empty(saved.shape, dtype=saved.dtype)
    load_boxes(directory, [Box(fqn, saved.shape, (0,) * len(saved.shape), out)])
    return out


def _read_record(directory: str) -> dict:
    path = os.path.join(directory, METADATA)
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this version reads {FORMAT}")
        data["tensors"]  # noqa: B018 (present)
        return data
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None


def read_metadata(directory: str) -> dict:
    """``shards/metadata.json``'s tensors as written (a ``CheckpointError`` naming the file when
    it is unreadable)."""
    return _read_record(directory)["tensors"]


def saved_tensors(directory: str) -> dict[str, SavedTensor]:
    """Every global tensor of the checkpoint: dtype, shape and the files that hold it."""
    return {
        fqn: SavedTensor(
            _dtype(t["dtype"]), tuple(t["shape"]), tuple(sorted({c["file"] for c in t["chunks"]}))
        )
        for fqn, t in read_metadata(directory).items()
    }


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a checkpoint tensor has the unknown dtype {name!r}")
    return dtype


def _metadata(tensors: dict) -> Metadata:
    state, storage = {}, {}
    for fqn, t in tensors.items():
        chunks = []
        for i, c in enumerate(t["chunks"]):
            chunk = ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
            chunks.append(chunk)
            storage[MetadataIndex(fqn, chunk.offsets, i)] = Stored(
                c["file"], int(c["offset"]), int(c["nbytes"]), c.get("digest", "")
            )
        properties = TensorProperties(dtype=_dtype(t["dtype"]))
        state[fqn] = TensorStorageMetadata(properties, torch.Size(t["shape"]), chunks)
    return Metadata(state, storage_data=storage)


class Reader(StorageReader):
    """Reads saved boxes through ``mmap``: only the pages of the bytes asked for are read.
    ``bytes_read``: the bytes copied out of the files."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory
        self.bytes_read = 0
        self._maps: dict[str, mmap.mmap] = {}

    def reset(self, checkpoint_id=None) -> None:
        self._maps = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return _metadata(read_metadata(self.directory))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a, **kw) -> None:
        self.storage = metadata.storage_data
        self.dtypes = {f: m.properties.dtype for f, m in metadata.state_dict_metadata.items()}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _map(self, name: str) -> mmap.mmap:
        if name not in self._maps:
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:  # ACCESS_COPY: writable for frombuffer, never written
                    self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path} cannot be read ({e})") from None
        return self._maps[name]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        for item in plan.items:
            stored = self.storage[item.storage_index]
            dtype = self.dtypes[item.storage_index.fqn]
            element = torch.empty((), dtype=dtype).element_size()
            saved = torch.frombuffer(
                self._map(stored.path), dtype=dtype, count=stored.nbytes // element,
                offset=stored.offset,
            )  # fmt: skip
            chunk = planner.saved_chunk(item)
            source = narrow(saved.view(chunk.sizes), item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item)
            with torch.no_grad():  # a float32 master is the optimizer's leaf: written in place
                target.copy_(source)
            self.bytes_read += source.numel() * element
        self._maps = {}
        future = torch.futures.Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of ``tensor`` at ``offsets`` of ``lengths`` (a view)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, int(offset), int(length))
    return tensor


class BoxLoadPlanner(LoadPlanner):
    """Plans the reads that fill one rank's boxes (DCP intersects them with the saved ones)."""

    def __init__(self, boxes: list[Box]):
        self.wanted: dict[str, list[Box]] = {}
        for box in boxes:
            self.wanted.setdefault(box.fqn, []).append(box)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        saved = self.metadata.state_dict_metadata
        for fqn, boxes in self.wanted.items():
            if fqn not in saved:
                raise CheckpointError(f"the checkpoint has no tensor {fqn}")
            if tuple(saved[fqn].size) != tuple(boxes[0].global_shape):
                raise CheckpointError(
                    f"{fqn} is {tuple(saved[fqn].size)} in the checkpoint and "
                    f"{tuple(boxes[0].global_shape)} in this model"
                )
            items += create_read_items_for_chunk_list(fqn, saved[fqn], [b.chunk for b in boxes])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def saved_chunk(self, item: ReadItem) -> ChunkStorageMetadata:
        chunks = self.metadata.state_dict_metadata[item.storage_index.fqn].chunks
        return chunks[item.storage_index.index]

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn}: not a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        box = self.wanted[read_item.dest_index.fqn][read_item.dest_index.index]
        return narrow(box.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # written in place


def load_boxes(directory: str, boxes: list[Box]) -> int:
    """Fill ``boxes`` from the checkpoint in ``directory`` (this process alone: no
    collective); returns the bytes read."""
    import torch.distributed.checkpoint as dcp

    reader = Reader(directory)
    try:
        with single_process_quiet():
            dcp.load({}, storage_reader=reader, planner=BoxLoadPlanner(boxes), no_dist=True)
    except CheckpointException as e:
        raise CheckpointError(first_failure(e)) from None
    return reader.bytes_read


def _saved_boxes_read(directory: str, boxes: list[Box], record: dict) -> dict[Stored, str]:
    """The saved boxes a load of ``boxes`` reads from (each with its tensor's name)."""
    metadata = _metadata(record["tensors"])
    planner = BoxLoadPlanner(boxes)
    planner.set_up_planner({}, metadata)
    items = planner.create_local_plan().items
    return {metadata.storage_data[i.storage_index]: i.storage_index.fqn for i in items}


def files_read(directory: str, boxes: list[Box]) -> set[str]:
    """The files a load of ``boxes`` reads (the metadata's included), without reading them."""
    saved = _saved_boxes_read(directory, boxes, _read_record(directory))
    return {METADATA} | {stored.path for stored in saved}


def verify_reads(directory: str, boxes: list[Box], cache=None) -> int:
    """Check every saved box a load of ``boxes`` reads against the digest taken when it was
    written (a box is checked whole, once; ``cache``: a ``DigestCache`` of boxes found intact
    before). A ``CheckpointError`` names the file, the bytes and the tensor of the first that
    differs. Returns the bytes read to check."""
    record = _read_record(directory)
    algorithm, checked = record.get("digest", "xxh3_128"), 0
    saved = _saved_boxes_read(directory, boxes, record)
    maps: dict[str, mmap.mmap] = {}
    for stored, fqn in sorted(saved.items(), key=lambda s: (s[0].path, s[0].offset)):
        path = os.path.join(directory, stored.path)
        part = f"{stored.offset}+{stored.nbytes}"
        if not stored.nbytes or (cache is not None and cache.matches(path, stored.digest, part)):
            continue
        if stored.path not in maps:
            with open(path, "rb") as f:
                maps[stored.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        digest = new_digest(algorithm)
        with memoryview(maps[stored.path]) as view:
            digest.update(view[stored.offset : stored.offset + stored.nbytes])
        checked += stored.nbytes
        if digest.hexdigest() != stored.digest:
            raise CheckpointError(
                f"{path} is altered: its bytes {stored.offset} to {stored.offset + stored.nbytes} "
                f"({fqn}) differ from their digest recorded when they were saved"
            )
        if cache is not None:
            cache.remember(path, stored.digest, part)
    for m in maps.values():
        m.close()
    if cache is not None:
        cache.flush()
    return checked
