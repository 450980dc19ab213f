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

``latest`` is replaced atomically (written under another name, flushed to disk, renamed) once
every file of the new checkpoint is written, so a crash during a save leaves the previous
checkpoint as ``latest``.
"""

from __future__ import annotations

import os

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.files import write_atomic

LATEST = "latest"
CONFIG = "config.json"
CONFIG_YAML = "config.yaml"
FROZEN_LM_EXCLUDED = "FROZEN_LM_EXCLUDED"
"""Marks a checkpoint without its frozen parameters (re-read from --pretrained-checkpoint)."""
WEIGHTS_ONLY = "WEIGHTS_ONLY"
"""Marks a converted checkpoint: weights, no optimizer, RNG or data position."""


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
    """``load_dir``'s newest complete checkpoint (``latest``), or a ``CheckpointError``."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{flag} {load_dir}: no such directory")
    tag = latest_tag(load_dir)
    if tag is None:
        raise CheckpointError(f"{flag} {load_dir}: no checkpoint there (no 'latest' file)")
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {load_dir}: 'latest' names {tag}, which is missing")
    return path
