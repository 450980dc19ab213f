"""Writing one checkpoint: every rank its own files, in parallel, then the publication.

A ``SaveJob`` is everything a save writes, taken from the training state at one moment:
this rank's boxes (``checkpoint.sharded_state``: views of the live tensors for a synchronous save,
host copies for an asynchronous one), its RNG and task state, and on rank 0 the training
state (``train_state.json``) and markers. ``write`` runs it on every rank (collective over the
checkpoint's own process group, so that a background thread can run it while training goes
on):

1. every rank writes its boxes (``shards/rank{r}.bin``; the coordinator the metadata) and its
   ``rng_rank{r}.pt``, digesting each file as it writes it; a failed write is kept, not raised,
   so that the rank still reaches step 2;
2. the ranks exchange their files' digests and failures (the only exchange);
3. rank 0 writes ``COMPLETE`` with every digest and replaces ``latest``, then prunes
   (--keep-last); or, after any failure, removes the directory and every rank raises the same
   ``CheckpointError``.

No file is read back: a rank's digests come from the bytes it wrote.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_tempnet.checkpoint.checkpoint_format import (
    COMPLETE,
    TRAIN_STATE,
    CheckpointError,
    checkpoint_tags,
    is_complete,
    latest_tag,
    new_digest,
    publish_latest,
    write_complete,
)
from megatron_tempnet.checkpoint.file_io import FileWriter, describe_error
from megatron_tempnet.checkpoint.host_buffers import HostArena
from megatron_tempnet.checkpoint.shard_storage import Box, save_boxes
from megatron_tempnet.utils.logging import log_rank0


def rank_file(rank: int) -> str:
    """Rank ``rank``'s RNG and task state, relative to the checkpoint directory."""
    return f"rng_rank{rank}.pt"


@dataclass
class SaveJob:
    """What one rank writes for checkpoint ``tag`` of ``save_dir``."""

    save_dir: str
    tag: str
    boxes: list[Box]
    rank_state: bytes
    """``rng_rank{r}.pt``'s bytes (serialised when the job is made)."""
    train_state: dict | None = None
    """Rank 0: ``train_state.json``."""
    markers: dict[str, str] = field(default_factory=dict)
    """Rank 0: marker files and their text."""
    keep_last: int = 0
    algorithm: str = "xxh3_128"

    @property
    def directory(self) -> str:
        return os.path.join(self.save_dir, self.tag)


def serialise(obj) -> bytes:
    """``torch.save``'s bytes of ``obj`` (a small state: RNG, task state)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def snapshot(boxes: list[Box], arena: HostArena | None = None) -> tuple[list[Box], HostArena]:
    """Host copies of the boxes, for a write that runs while training changes the originals,
    and the arena that holds them (one buffer, pinned on CUDA so that the copies run at full
    bandwidth: ``host_buffers``). ``arena``: the previous snapshot's, reused when the boxes are
    the same (the save after the first allocates nothing, and touches no fresh page)."""
    tensors = [box.tensor for box in boxes]
    if arena is None or not arena.holds(tensors):
        arena = HostArena.for_tensors(tensors)
    copies = arena.copy_from(tensors)
    return [Box(b.fqn, b.global_shape, b.offsets, c) for b, c in zip(boxes, copies)], arena


def clear_for_save(save_dir: str, tag: str) -> None:
    """Remove what an earlier save of ``tag`` left (an interrupted save, or a checkpoint newer
    than the one resumed from); never the one ``latest`` names. Rank 0."""
    directory = os.path.join(save_dir, tag)
    if not os.path.exists(directory):
        return
    if latest_tag(save_dir) == tag:
        raise CheckpointError(
            f"--save {save_dir}: {tag} is the checkpoint 'latest' names: it is not overwritten"
        )
    why = "complete, not named by 'latest'" if is_complete(directory) else "an interrupted save"
    log_rank0("removing %s (%s) before saving it again", directory, why)
    remove_checkpoint(directory)


def remove_checkpoint(directory: str) -> None:
    """Marker first: a deletion cut short leaves an incomplete directory, never a complete one
    with files missing."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, COMPLETE))
    shutil.rmtree(directory, ignore_errors=True)


def _write_bytes(writer: FileWriter, path: str, data: bytes, algorithm: str):
    digest = new_digest(algorithm)
    digest.update(data)
    writer.stream(path, lambda f: f.write(data))
    return len(data), digest.hexdigest()


def _write_own_files(job: SaveJob, group) -> tuple[dict[str, tuple[int, str]], str | None]:
    """This rank's files with their digests, and its failure (None: all written)."""
    rank = dist.get_rank()
    try:
        files = save_boxes(
            job.directory, job.boxes, group=group, writer=FileWriter(), algorithm=job.algorithm
        )
    except CheckpointError as e:  # raised on every rank by the engine: all go on to exchange
        return {}, str(e)
    writer = FileWriter(records=True)
    own = {rank_file(rank): job.rank_state}
    if job.train_state is not None:
        own[TRAIN_STATE] = json.dumps(job.train_state, indent=1).encode("utf-8")
    own.update({name: text.encode("utf-8") for name, text in job.markers.items()})
    for name, data in own.items():
        result = _write_bytes(writer, os.path.join(job.directory, name), data, job.algorithm)
        if writer.failure is None:
            files[name] = result
    return files, writer.failure


def write(job: SaveJob, group) -> None:
    """Write ``job`` on every rank of ``group`` and publish it (collective); a
    ``CheckpointError`` on every rank when any rank's part failed."""
    files, failure = _write_own_files(job, group)
    failure = _publish(job, files, failure, group)
    if failure is None:
        log_rank0("saved checkpoint %s", job.directory)
        return
    previous = latest_tag(job.save_dir)
    if dist.get_rank() == 0:
        remove_checkpoint(job.directory)
    kept = f"'latest' still names {previous}" if previous else "no checkpoint was published"
    raise CheckpointError(
        f"saving {job.directory} failed: {failure}; {kept} and the incomplete directory was removed"
    )


def _publish(job: SaveJob, files: dict, failure: str | None, group) -> str | None:
    """Exchange the digests; rank 0 marks the checkpoint complete, publishes and prunes.
    Returns the failure, if any (the same on every rank)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (files, failure), group=group)
    failure = next((f for _, f in gathered if f is not None), None)
    if dist.get_rank() == 0 and failure is None:
        try:
            every = {name: d for rank_files, _ in gathered for name, d in rank_files.items()}
            write_complete(job.directory, every, job.algorithm)
            publish_latest(job.save_dir, job.tag)
        except OSError as e:
            failure = describe_error(job.directory, e)
        if failure is None and job.keep_last:
            prune(job.save_dir, job.keep_last)
    result = [failure]
    dist.broadcast_object_list(result, src=0, group=group)
    return result[0]


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (after the new one is
    complete and published: the one ``latest`` names is never among them)."""
    latest = latest_tag(save_dir)
    complete = [t for t in checkpoint_tags(save_dir) if is_complete(os.path.join(save_dir, t))]
    for old in complete[:-keep_last]:
        if old != latest:
            remove_checkpoint(os.path.join(save_dir, old))
