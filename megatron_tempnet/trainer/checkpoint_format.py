"""The on-disk format of a checkpoint directory, shared by the trainer and every reader.

    SAVE/latest                      the tag of the newest complete checkpoint (written last)
    SAVE/config.json                 the run's resolved config
    SAVE/config.yaml                 the same as flag values: a valid --yaml-cfg
    SAVE/iter_0000100/               one checkpoint (``tag_for(100)``): DeepSpeed's files, e.g.
        mp_rank_00_model_states.pt       the module's state per model-parallel rank (PP = 1), or
        layer_03-model_00-model_states.pt  one file per pipeline piece and TP rank (PP > 1)
        *_optim_states.pt                the optimizer (ZeRO partitions)
        rng_rank{r}.pt                   rank r's RNG states and its own task state
        FROZEN_LM_EXCLUDED               marker: the frozen parameters were left out
        WEIGHTS_ONLY                     marker: weights only (a conversion), no training state
        COMPLETE                         the completion marker, written last: every other file
                                         of the checkpoint with its size and SHA-256

A save writes every file (each flushed to disk), then ``COMPLETE``, then replaces ``latest``
atomically (written under another name, flushed, renamed): a crash at any point of a save leaves
the previous checkpoint as ``latest``, and a directory without ``COMPLETE`` is an interrupted
save, never loaded. A load checks every file against ``COMPLETE`` (present, same size, same
SHA-256) before it reads any of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.files import write_atomic
from megatron_tempnet.utils.logging import log_rank0

LATEST = "latest"
CONFIG = "config.json"
CONFIG_YAML = "config.yaml"
FROZEN_LM_EXCLUDED = "FROZEN_LM_EXCLUDED"
"""Marks a checkpoint without its frozen parameters (re-read from --pretrained-checkpoint)."""
WEIGHTS_ONLY = "WEIGHTS_ONLY"
"""Marks a converted checkpoint: weights, no optimizer, RNG or data position."""
COMPLETE = "COMPLETE"
"""The completion marker: JSON ``{"files": {relative path: {"size", "sha256"}}}``."""
_FORMAT = 1


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked; names the directory and what is wrong."""


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def latest_tag(load_dir: str) -> str | None:
    """The tag ``latest`` names, or None when there is no complete checkpoint."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def publish_latest(save_dir: str, tag: str) -> None:
    """Point ``latest`` at ``tag``: atomically, and on disk before it is renamed into place."""
    write_atomic(os.path.join(save_dir, LATEST), tag, fsync=True)


def has_marker(checkpoint: str, marker: str) -> bool:
    """Whether the checkpoint directory (``SAVE/iter_...``) carries ``marker``."""
    return os.path.exists(os.path.join(checkpoint, marker))


def checkpoint_dir(load_dir: str, flag: str = "--load") -> str:
    """``load_dir``'s newest checkpoint (``latest``) once its files pass their check, or a
    ``CheckpointError`` (for the tools that read a checkpoint without a training run)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{flag} {load_dir}: no such directory")
    tag = choose_checkpoint(load_dir, f"{flag} {load_dir}", fallback=None)
    if tag is None:
        raise CheckpointError(f"{flag} {load_dir}: no checkpoint there (no 'latest' file)")
    return os.path.join(load_dir, tag)


def checkpoint_tags(save_dir: str) -> list[str]:
    """Every checkpoint directory's tag in ``save_dir``, oldest first (complete or not)."""
    if not os.path.isdir(save_dir):
        return []
    names = (d for d in os.listdir(save_dir) if d.startswith("iter_") and d[5:].isdigit())
    return sorted(d for d in names if os.path.isdir(os.path.join(save_dir, d)))


def is_complete(checkpoint: str) -> bool:
    """Whether the save of this checkpoint directory finished (its marker is there)."""
    return os.path.isfile(os.path.join(checkpoint, COMPLETE))


def checkpoint_files(checkpoint: str) -> list[str]:
    """Every file of a checkpoint directory (relative, sorted), but the marker and files still
    under their temporary names."""
    found = []
    for root, _, names in os.walk(checkpoint):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), checkpoint)
            if rel != COMPLETE and not name.endswith(".partial"):
                found.append(rel)
    return sorted(found)


def file_digest(path: str, *, fsync: bool = False) -> tuple[int, str]:
    """``(size, SHA-256 hex)`` of a file; ``fsync``: also flush it to disk (a save's last step)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def write_complete(checkpoint: str, files: dict[str, tuple[int, str]]) -> None:
    """Mark the checkpoint complete, recording ``files`` (relative path -> size, SHA-256): the
    last file of a save, flushed to disk with its directory entry."""
    record = {k: {"size": size, "sha256": sha} for k, (size, sha) in sorted(files.items())}
    text = json.dumps({"format": _FORMAT, "files": record}, indent=1)
    write_atomic(os.path.join(checkpoint, COMPLETE), text, fsync=True)
    descriptor = os.open(checkpoint, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def mark_complete(checkpoint: str) -> None:
    """Record every file of a checkpoint written by one process (a conversion) as complete."""
    write_complete(
        checkpoint,
        {
            f: file_digest(os.path.join(checkpoint, f), fsync=True)
            for f in checkpoint_files(checkpoint)
        },
    )


def check_checkpoint(checkpoint: str, source: str, part: tuple[int, int] = (0, 1)) -> None:
    """Raise a ``CheckpointError`` naming the first file of ``checkpoint`` that is missing,
    truncated or altered since its save, or the checkpoint when it is incomplete.

    Every file's presence and size are checked; the checksums of the files ``i`` with
    ``i % n == k`` only (``part = (k, n)``: ranks share the reading).
    """
    marker = os.path.join(checkpoint, COMPLETE)
    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{source}: {checkpoint} is missing")
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"{source}: {checkpoint} is incomplete (no {COMPLETE} marker: its save did not finish)"
        )
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{source}: {marker} is damaged ({e})") from None
    k, n = part
    for i, (name, record) in enumerate(sorted(files.items())):
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{source}: {path} is missing (recorded in {COMPLETE})")
        size = os.path.getsize(path)
        if size != record["size"]:
            raise CheckpointError(
                f"{source}: {path} is truncated or altered: {size} bytes, {record['size']} "
                "when saved"
            )
        if i % n == k and file_digest(path)[1] != record["sha256"]:
            raise CheckpointError(
                f"{source}: {path} is altered: its SHA-256 differs from the one recorded when "
                "it was saved"
            )


def choose_checkpoint(
    load_dir: str,
    source: str,
    *,
    fallback: bool | None,
    check: Callable[[str], None] | None = None,
) -> str | None:
    """The tag to load from ``load_dir``: the one ``latest`` names once ``check(directory)``
    (default ``check_checkpoint``) passes; None when the directory holds no complete checkpoint.

    Directories newer than ``latest`` are interrupted saves: ignored, with a log line. When the
    newest checkpoint fails its check, ``fallback`` (--load-fallback) takes the newest older one
    that passes, and says so; without it the error names the damaged file (and the flag, unless
    ``fallback`` is None: a reader that offers none).
    """
    check = check or (lambda d: check_checkpoint(d, source))
    tags, latest = checkpoint_tags(load_dir), latest_tag(load_dir)
    for tag in tags:
        if latest is None or tag > latest:
            state = "complete" if is_complete(os.path.join(load_dir, tag)) else "incomplete"
            log_rank0(
                "%s: ignoring %s: an interrupted save (%s, not named by 'latest'); it is replaced "
                "when that iteration is saved again",
                source,
                tag,
                state,
            )
    complete = [t for t in tags if is_complete(os.path.join(load_dir, t))]
    if latest is None:
        if not complete:
            return None
        if not fallback:
            hint = "add --load-fallback to load the newest valid one, or " * (fallback is False)
            raise CheckpointError(
                f"{source}: no 'latest' file, but complete checkpoints ({', '.join(complete)}): "
                f"{hint}write a tag into {os.path.join(load_dir, LATEST)}"
            )
    older = [t for t in reversed(complete) if latest is None or t < latest]
    candidates = ([latest] if latest is not None else []) + older
    for tag in candidates:
        try:
            check(os.path.join(load_dir, tag))
        except CheckpointError as e:
            if fallback is None:
                raise
            if not fallback:
                raise CheckpointError(
                    f"{e}; add --load-fallback to load the newest older checkpoint that is valid"
                ) from None
            log_rank0("--load-fallback: %s; trying the next older checkpoint", e)
            continue
        if tag != latest:
            log_rank0(
                "--load-fallback: loading %s, the newest complete and valid checkpoint in %s "
                "('latest' names %s)",
                tag,
                load_dir,
                latest,
            )
        return tag
    raise CheckpointError(
        f"{source}: no complete and valid checkpoint to fall back to ({len(candidates)} checked)"
    )
