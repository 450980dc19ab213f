"""A run's checkpoints: ``save``, ``resume``, ``load_pretrained``, at any layout.

``Checkpointer`` is what the trainer holds: the host group the ranks exchange over (gloo,
--checkpoint-timeout-minutes), the ``DigestCache`` of the run's --save, and two parts with one
job each: ``saver.CheckpointSaver`` (a save, synchronous or in the background with
--async-save) and ``loader.CheckpointLoader`` (a resume or a load of weights, this project's
checkpoints at any layout or another framework's). The format is in ``checkpoint_format``.
"""

from __future__ import annotations

import os
from datetime import timedelta

from megatron_tempnet.checkpoint.checkpoint_format import DigestCache
from megatron_tempnet.checkpoint.host_buffers import HostArena
from megatron_tempnet.checkpoint.loader import CheckpointLoader, LoadMode
from megatron_tempnet.checkpoint.ranks import current_layout, describe_layout, timeout_named
from megatron_tempnet.checkpoint.saver import CheckpointSaver
from megatron_tempnet.distributed.groups import host_group, init_host_group

__all__ = ["Checkpointer", "LoadMode", "current_layout", "describe_layout", "timeout_named"]


class Checkpointer:
    """The checkpoints of one run (every rank makes one, after the engine: collective).

    ``model``: the task's ``TrainModel`` (its ``tensor_layout``, ``optional`` prefixes,
    ``frozen_from_pretrained`` and ``foreign_checkpoint``); ``config``: the run's ``RunConfig``.
    """

    def __init__(self, engine, model, config):
        if model.tensor_layout is None:
            raise ValueError("a model without a tensor layout cannot be checkpointed")
        ckpt = config.checkpoint
        # the host group: an asynchronous save's exchanges run beside training's collectives,
        # and a slow file system gets --checkpoint-timeout-minutes
        group = host_group() or init_host_group(timedelta(minutes=ckpt.checkpoint_timeout_minutes))
        cache = DigestCache(os.path.join(ckpt.save, ".digests") if ckpt.save else None)
        self.saver = CheckpointSaver(engine, model, ckpt, group)
        self.loader = CheckpointLoader(engine, model, config, group, cache)

    def save(self, iteration: int, client_state: dict, rank_state=None) -> None:
        """``CheckpointSaver.save``."""
        self.saver.save(iteration, client_state, rank_state)

    def prepare_async(self) -> None:
        """``CheckpointSaver.prepare_async``."""
        self.saver.prepare_async()

    def wait(self) -> None:
        """``CheckpointSaver.wait``."""
        self.saver.wait()

    @property
    def host_copies(self) -> HostArena | None:
        """--async-save's host buffer (``bytes_held``, ``bytes_needed``), once made."""
        return self.saver.host_copies

    def resume(self) -> dict | None:
        """``CheckpointLoader.resume``."""
        return self.loader.resume()

    def load_pretrained(self, load_dir: str, flag: str = "--pretrained-checkpoint") -> None:
        """``CheckpointLoader.load_pretrained``."""
        self.loader.load_pretrained(load_dir, flag)

    @property
    def bytes_read(self) -> int:
        """The last load's bytes read."""
        return self.loader.bytes_read

    @property
    def bytes_checked(self) -> int:
        """The last load's bytes read to check their digests."""
        return self.loader.bytes_checked

    @property
    def bytes_held(self) -> int:
        """The last load's bytes of the tensors it filled."""
        return self.loader.bytes_held
