"""Faults injected into a run's own processes (``run_program(setup=...)`` /
``Running.start(setup)``): a rank killed at a chosen point of its n-th save, a write that meets
a full disk. Each function runs first in the process it breaks, and patches nothing elsewhere.
"""

from __future__ import annotations

import builtins
import fnmatch
import os
import signal

SAVE_POINTS = {
    # point: what is happening when the rank dies
    "shard": "its tensor file (its share of weights, masters and moments) is half written",
    "metadata": "the tensors' index (rank 0's) is half written",
    "rank_state": "the rank's RNG and task state file is half written",
    "train_state": "the training state (iteration, data position) is half written",
    "between_ranks": "every file is written, the other ranks wait for this one's digests",
    "marker": "the completion marker is written under its temporary name, not renamed",
    "latest": "'latest' is written under its temporary name, not renamed",
    "prune": "an old checkpoint's marker is deleted, its files not yet",
}
RANK0_POINTS = ("metadata", "train_state", "marker", "latest", "prune")
"""What rank 0 alone writes or does."""
_FILES = {
    "shard": "*shards/rank*.bin",
    "metadata": "*shards/metadata.json",
    "rank_state": "*rng_rank*.pt",
    "train_state": "*train_state.json",
}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_at_save(save_number: int) -> dict:
    """``{"armed": bool}``, set while this process writes its ``save_number``-th checkpoint
    (in the training thread, or in the background with --async-save)."""
    from megatron_tempnet.checkpoint import checkpoint_writer

    state, original = {"armed": False, "saves": 0}, checkpoint_writer.write

    def counted(*args, **kwargs):
        state["saves"] += 1
        state["armed"] = state["saves"] == save_number
        try:
            return original(*args, **kwargs)
        finally:
            state["armed"] = False

    checkpoint_writer.write = counted
    return state


def kill_in_save(point: str, rank: int, save_number: int) -> None:
    """SIGKILL rank ``rank`` at ``point`` (``SAVE_POINTS``) of its ``save_number``-th save."""
    if _rank() != rank:
        return
    state = _arm_at_save(save_number)
    if point in _FILES:
        from megatron_tempnet.checkpoint.file_io import FileWriter

        original = FileWriter._write

        def write(self, path, write_fn):
            original(self, path, write_fn)
            if state["armed"] and fnmatch.fnmatch(path, _FILES[point]):
                os.truncate(path, os.path.getsize(path) // 2)
                _die()

        FileWriter._write = write
    elif point == "between_ranks":
        from megatron_tempnet.checkpoint import checkpoint_writer

        publish = checkpoint_writer._publish

        def die_first(*args, **kwargs):
            if state["armed"]:
                _die()
            return publish(*args, **kwargs)

        checkpoint_writer._publish = die_first
    elif point in ("marker", "latest"):
        name = "COMPLETE" if point == "marker" else "latest"
        replace = os.replace

        def die_before_rename(src, dst, *args, **kwargs):
            if state["armed"] and os.path.basename(dst) == name:
                _die()
            return replace(src, dst, *args, **kwargs)

        os.replace = die_before_rename
    elif point == "prune":
        from megatron_tempnet.checkpoint import checkpoint_writer

        rmtree = checkpoint_writer.shutil.rmtree

        def die_in_rmtree(path, *args, **kwargs):
            if state["armed"]:
                _die()
            return rmtree(path, *args, **kwargs)

        checkpoint_writer.shutil.rmtree = die_in_rmtree
    else:
        raise ValueError(f"unknown save point {point!r}")


def full_disk(pattern: str, rank: int, save_number: int) -> None:
    """Writes of files matching ``pattern`` by rank ``rank`` in its ``save_number``-th save go
    to ``/dev/full``: the kernel's ENOSPC, as on a file system that filled up."""
    if _rank() != rank:
        return
    state = _arm_at_save(save_number)
    from megatron_tempnet.checkpoint import file_io

    def open_full(path, mode="r", *args, **kwargs):
        if state["armed"] and "w" in mode and fnmatch.fnmatch(str(path), pattern):
            path = "/dev/full"
        return builtins.open(path, mode, *args, **kwargs)

    file_io.open = open_full


class PlantedPickle:
    """Unpickling this calls ``open(path, "w")``, which creates ``path``: a test sees whether a
    loader ran code from a file (the harmless stand-in for ``os.system``)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
