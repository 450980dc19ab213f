"""The on-disk format of a checkpoint directory, shared by the trainer and every reader.

    SAVE/latest                      the tag of the newest complete checkpoint (written last)
    SAVE/config.json                 the run's resolved config
    SAVE/config.yaml                 the same as flag values: a valid --yaml-cfg
    SAVE/.digests/                   what a load found intact, by file (``DigestCache``)
    SAVE/iter_0000100/               one checkpoint (``tag_for(100)``):
        shards/rank{r:05d}.bin           rank r's share of the weights, float32 masters and
                                         AdamW moments, as boxes of layout-free global tensors
                                         (``shard_storage``, ``sharded_state``)
        shards/metadata.json             every global tensor's dtype, shape and saved boxes
        train_state.json                 the iteration, data position, schedule, AdamW's step,
                                         the layout that saved and the run's config
        rng_rank{r}.pt                   rank r's RNG states and its own task state
        FROZEN_LM_EXCLUDED               marker: the frozen parameters were left out
        WEIGHTS_ONLY                     marker: weights only (a conversion), no training state
        COMPLETE                         the completion marker, written last: every other file
                                         of the checkpoint with its size and digest

A save writes every file (each flushed to disk, each rank digesting what it writes as it
writes it: xxh3-128, or SHA-256 with --ckpt-digest sha256), then ``COMPLETE``, then replaces
``latest`` atomically (written under another name, flushed, renamed): a crash at any point of
a save leaves the previous checkpoint as ``latest``, and a directory without ``COMPLETE`` is an
interrupted save, never loaded. A load checks every file's presence and size against
``COMPLETE``, and the digest of each file it reads before reading it; a verdict is remembered
by the file's inode, size and times (``DigestCache``), so a file unchanged since is not read
twice for it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterable

import xxhash

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.files import write_atomic
from megatron_tempnet.utils.logging import log_rank0

FORMAT = 2
"""The version of this project's checkpoint layout (``train_state.json``'s ``format``)."""
TEMPNET_DIST = "tempnet_dist"
"""This project's checkpoint format (``--ckpt-format``; ``checkpoint.checkpointer``)."""

LATEST = "latest"
CONFIG = "config.json"
CONFIG_YAML = "config.yaml"
FROZEN_LM_EXCLUDED = "FROZEN_LM_EXCLUDED"
"""Marks a checkpoint without its frozen parameters (re-read from --pretrained-checkpoint)."""
WEIGHTS_ONLY = "WEIGHTS_ONLY"
"""Marks a converted checkpoint: weights, no optimizer, RNG or data position."""
TRAIN_STATE = "train_state.json"
"""A checkpoint's training state and run config (rank 0's)."""
COMPLETE = "COMPLETE"
"""The completion marker: JSON ``{"format", "digest": algorithm, "files": {relative path:
{"size", algorithm: hex}}}`` (format 1: SHA-256 only)."""
_FORMAT = 2
DIGESTS = ("xxh3_128", "sha256")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked; names the directory and what is wrong."""


class IncompatibleCheckpoint(CheckpointError):
    """An intact checkpoint this run cannot use (another model, format or batch size): no
    older checkpoint is tried instead (--load-fallback is for damaged ones)."""


def read_train_state(directory: str, source: str) -> dict:
    """The checkpoint's ``train_state.json`` (its ``config``: the run config it was saved
    with); a ``CheckpointError`` naming it when it is missing or unreadable."""
    path = os.path.join(directory, TRAIN_STATE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{source}: {directory} has no {TRAIN_STATE}")
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{source}: {path} cannot be read ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{source}: {path} is not a training state")
    return state


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def latest_tag(load_dir: str) -> str | None:
    """The tag ``latest`` names, or None when there is no complete checkpoint (or ``latest`` is
    DeepSpeed's, naming a Megatron-DeepSpeed ``global_stepN``: not a checkpoint of this
    project)."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    return None if not tag or tag.startswith("global_step") else tag


def publish_latest(save_dir: str, tag: str) -> None:
    """Point ``latest`` at ``tag``: atomically, and on disk before it is renamed into place."""
    write_atomic(os.path.join(save_dir, LATEST), tag, fsync=True)


def has_marker(directory: str, marker: str) -> bool:
    """Whether the checkpoint directory (``SAVE/iter_...``) carries ``marker``."""
    return os.path.exists(os.path.join(directory, marker))


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


def is_complete(directory: str) -> bool:
    """Whether the save of this checkpoint directory finished (its marker is there)."""
    return os.path.isfile(os.path.join(directory, COMPLETE))


def checkpoint_files(directory: str) -> list[str]:
    """Every file of a checkpoint directory (relative, sorted), but the marker and files still
    under their temporary names."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != COMPLETE and not name.endswith(".partial"):
                found.append(rel)
    return sorted(found)


def new_digest(algorithm: str):
    """A running digest of ``algorithm`` (``DIGESTS``)."""
    return xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.sha256()


def file_digest(path: str, algorithm: str = "xxh3_128", *, fsync: bool = False) -> tuple[int, str]:
    """``(size, hex digest)`` of a file; ``fsync``: also flush it to disk."""
    digest, size = new_digest(algorithm), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def write_complete(
    directory: str, files: dict[str, tuple[int, str]], algorithm: str = "xxh3_128"
) -> None:
    """Mark the checkpoint complete, recording ``files`` (relative path -> size, digest of
    ``algorithm``): the last file of a save, flushed to disk with its directory entry."""
    record = {k: {"size": size, algorithm: d} for k, (size, d) in sorted(files.items())}
    text = json.dumps({"format": _FORMAT, "digest": algorithm, "files": record}, indent=1)
    write_atomic(os.path.join(directory, COMPLETE), text, fsync=True)
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def mark_complete(directory: str, algorithm: str = "xxh3_128") -> None:
    """Record every file of a checkpoint written by one process (a conversion) as complete."""
    write_complete(
        directory,
        {
            f: file_digest(os.path.join(directory, f), algorithm, fsync=True)
            for f in checkpoint_files(directory)
        },
        algorithm,
    )


class DigestCache:
    """What matched its recorded digest (a file, or a part of one: ``part``), remembered by the
    file's path, inode, size, modification and change times (a write changes both times; so does
    resetting the modification time): such a part is not read again to be checked. Kept in
    memory, and in ``directory`` when one is given (one small JSON file per checked file and
    rank, written by ``flush``), so that a restarted run trusts what it checked before."""

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self.rank = os.environ.get("RANK", "0")
        self.known: dict[str, tuple[str, set[str]]] = {}  # path -> (identity, parts)
        self._dirty: set[str] = set()

    @staticmethod
    def _identity(path: str) -> str:
        st = os.stat(path)
        return f"{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"

    def _file(self, path: str) -> str:
        name = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{name}.rank{self.rank}.json")

    def _entry(self, path: str) -> set[str]:
        """The parts of ``path`` known to match, as the file is now."""
        identity = self._identity(path)
        if path not in self.known and self.directory is not None:
            try:
                with open(self._file(path)) as f:
                    saved = json.load(f)
                self.known[path] = (saved["identity"], set(saved["parts"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
        if self.known.get(path, ("",))[0] != identity:
            self.known[path] = (identity, set())
        return self.known[path][1]

    def matches(self, path: str, digest: str, part: str = "") -> bool:
        return f"{part}:{digest}" in self._entry(path)

    def remember(self, path: str, digest: str, part: str = "") -> None:
        self._entry(path).add(f"{part}:{digest}")
        self._dirty.add(path)

    def flush(self) -> None:
        """Write what was remembered since the last flush (a cache that cannot be written only
        costs a re-read)."""
        if self.directory is not None:
            for path in sorted(self._dirty):
                identity, parts = self.known[path]
                try:
                    os.makedirs(self.directory, exist_ok=True)
                    text = json.dumps({"identity": identity, "parts": sorted(parts)})
                    write_atomic(self._file(path), text)
                except OSError:
                    pass
        self._dirty.clear()


def check_checkpoint(
    directory: str,
    source: str,
    verify: Iterable[str] | None = None,
    cache: DigestCache | None = None,
) -> None:
    """Raise a ``CheckpointError`` naming the first file of ``directory`` that is missing,
    truncated or altered since its save, or the checkpoint when it is incomplete.

    Every file's presence and size are checked; the digests of the files in ``verify`` only
    (relative paths; None: all), unless ``cache`` knows them unchanged since they matched. (A
    load checks the parts of the tensor files it reads by their own digests:
    ``shard_storage.verify_reads``.)
    """
    marker = os.path.join(directory, COMPLETE)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{source}: {directory} is missing")
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"{source}: {directory} is incomplete (no {COMPLETE} marker: its save did not finish)"
        )
    try:
        with open(marker) as f:
            record = json.load(f)
        files, algorithm = record["files"], record.get("digest", "sha256")
        if algorithm not in DIGESTS:
            raise ValueError(f"unknown digest {algorithm!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{source}: {marker} is damaged ({e})") from None
    for name, entry in sorted(files.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{source}: {path} is missing (recorded in {COMPLETE})")
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise CheckpointError(
                f"{source}: {path} is truncated or altered: {size} bytes, {entry['size']} "
                "when saved"
            )
    for name in sorted(files) if verify is None else sorted(verify):
        if name not in files:
            raise CheckpointError(f"{source}: {name} is not recorded in {marker}")
        path, expected = os.path.join(directory, name), files[name][algorithm]
        if cache is not None and cache.matches(path, expected):
            continue
        if file_digest(path, algorithm)[1] != expected:
            raise CheckpointError(
                f"{source}: {path} is altered: its {algorithm} digest differs from the one "
                "recorded when it was saved"
            )
        if cache is not None:
            cache.remember(path, expected)
    if cache is not None:
        cache.flush()


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
        except IncompatibleCheckpoint:
            raise
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


def rank_state_files(directory: str) -> list[str]:
    """Every rank's RNG and task state file, in rank order."""
    names = [os.path.basename(f) for f in glob.glob(os.path.join(directory, "rng_rank*.pt"))]
    return sorted(names, key=lambda f: int(f[len("rng_rank") : -len(".pt")]))


def not_this_format(directory: str, source: str) -> str:
    """Why ``directory`` cannot be read: a checkpoint of the earlier format, or none at all."""
    old = os.path.isdir(os.path.join(directory, "portable")) or glob.glob(
        os.path.join(directory, "*model_states.pt")
    )
    if old:
        parent = os.path.dirname(directory)
        return (
            f"{source}: {directory} is in the earlier checkpoint format (DeepSpeed's files"
            f"{' and portable/' * os.path.isdir(os.path.join(directory, 'portable'))}): convert "
            f"it once with: python tools/checkpoint/upgrade.py {parent}"
        )
    return f"{source}: {directory} has no shards/: not a checkpoint of this project"
