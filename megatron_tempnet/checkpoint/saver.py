"""Saving a run's checkpoints (``Checkpointer.save``): every rank writes its own share of the
training state once (``checkpoint.sharded_state``: its ZeRO fragment of the float32 masters and
AdamW's moments, the same range of its weights), in parallel, on ``torch.distributed.checkpoint``
(``checkpoint.shard_storage``), with its RNG and task state; rank 0 adds the iteration, data
position, schedule, AdamW's step and config (``train_state.json``). ``checkpoint_writer``
writes and publishes; with --async-save the state is copied to host memory (one buffer of its
size, pinned on CUDA: ``checkpoint.host_buffers``) and written by a background thread while
training goes on, published only when every rank's write is done (``wait`` joins it: before the
next save and before the run exits).
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from megatron_tempnet import compat
from megatron_tempnet.checkpoint import checkpoint_writer
from megatron_tempnet.checkpoint.checkpoint_format import FORMAT, FROZEN_LM_EXCLUDED, tag_for
from megatron_tempnet.checkpoint.checkpoint_writer import SaveJob
from megatron_tempnet.checkpoint.host_buffers import HostArena
from megatron_tempnet.checkpoint.ranks import current_layout, timeout_named
from megatron_tempnet.checkpoint.rng_state import rng_state
from megatron_tempnet.checkpoint.sharded_state import optimizer_step, parameter_boxes
from megatron_tempnet.utils.logging import log_rank0

_FROZEN_NOTE = (
    "This checkpoint holds the trained parameters only: the frozen ones are read again from the "
    "run's --pretrained-checkpoint on every resume.\n"
)


class CheckpointSaver:
    """One run's saves: ``engine`` and ``model`` (the task's ``TrainModel``) as in
    ``Checkpointer``, ``ckpt`` the run's ``CheckpointConfig``, ``group`` the host group."""

    def __init__(self, engine, model, ckpt, group):
        self.engine, self.model, self.ckpt, self.group = engine, model, ckpt, group
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._arena: HostArena | None = None  # --async-save's host copies

    def save(self, iteration: int, client_state: dict, rank_state=None) -> None:
        """Save at ``iteration`` (collective). ``client_state``: the data position, schedule and
        config; ``rank_state``: this rank's own state (CLIP's per-sample state shard). With
        --async-save the write goes on in the background; otherwise a failure on any rank
        stops every rank with one ``CheckpointError`` and the previous checkpoint stays."""
        self.wait()
        save_dir, tag = self.ckpt.save, tag_for(iteration)
        if dist.get_rank() == 0:
            checkpoint_writer.clear_for_save(save_dir, tag)
        dist.barrier(group=self.group)
        job = self._job(iteration, client_state, rank_state)
        if not self.ckpt.async_save:
            with self._timeout_named():
                checkpoint_writer.write(job, self.group)
            return
        # the arena is reused by the next save (after wait)
        job.boxes, self._arena = checkpoint_writer.snapshot(job.boxes, self._arena)
        log_rank0("saving %s in the background (--async-save)", job.directory)
        self._failure = None
        self._thread = threading.Thread(target=self._write_in_background, args=(job,), daemon=True)
        self._thread.start()

    def prepare_async(self) -> None:
        """--async-save: allocate (and touch) the host copies now, after the run's first step
        (when every value to save exists), so that no save waits for their allocation."""
        if not self.ckpt.async_save or self._arena is not None:
            return
        compat.link_optimizer_states(self.engine.optimizer)
        params = parameter_boxes(
            self.engine,
            self.model.tensor_layout,
            saving=True,
            skip_frozen=self.model.frozen_from_pretrained,
            moments=True,
        )
        self._arena = HostArena.for_tensors(
            [b.tensor for p in params for boxes in p.boxes.values() for b in boxes]
        )

    @property
    def host_copies(self) -> HostArena | None:
        """--async-save's host buffer (``bytes_held``, ``bytes_needed``), once made."""
        return self._arena

    def _write_in_background(self, job: SaveJob) -> None:
        try:
            with self._timeout_named():
                checkpoint_writer.write(job, self.group)
        except BaseException as e:  # re-raised by wait(), in the training thread
            self._failure = e

    def _timeout_named(self):
        return timeout_named(self.ckpt.checkpoint_timeout_minutes)

    def wait(self) -> None:
        """Let a background save finish (its failure is raised here, on every rank)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _job(self, iteration: int, client_state: dict, rank_state) -> SaveJob:
        engine, exclude = self.engine, self.model.frozen_from_pretrained
        compat.link_optimizer_states(engine.optimizer)
        boxes = parameter_boxes(
            engine, self.model.tensor_layout, saving=True, skip_frozen=exclude, moments=True
        )
        step = optimizer_step(engine)  # collective: every rank takes part
        own = {**rng_state(), "rank_state": rank_state, "loss_scale": compat.loss_scale(engine)}
        job = SaveJob(
            self.ckpt.save,
            tag_for(iteration),
            [b for p in boxes for bs in p.boxes.values() for b in bs],
            checkpoint_writer.serialise(own),
            keep_last=self.ckpt.keep_last,
            algorithm=self.ckpt.ckpt_digest,
        )
        if dist.get_rank() == 0:
            job.train_state = {
                "format": FORMAT,
                **client_state,
                "iteration": iteration,
                "step": step,
                "layout": current_layout(engine),
                "vocab_size": self.model.tensor_layout.vocab_size,
            }
            if exclude:
                job.markers[FROZEN_LM_EXCLUDED] = _FROZEN_NOTE
        return job
