"""A run's checkpoints: ``save``, ``resume``, ``load_pretrained``, at any layout.

Every rank writes its own share of the training state once (``trainer.sharded_state``: its
ZeRO fragment of the float32 masters and AdamW's moments, the same range of its weights), in
parallel, on ``torch.distributed.checkpoint`` (``trainer.shard_storage``), with its RNG and task
state; rank 0 adds the iteration, data position, schedule, AdamW's step and config
(``train_state.json``). ``checkpoint_writer`` writes and publishes; with --async-save the state
is copied to host memory (one buffer of its size, pinned on CUDA: ``trainer.host_buffers``) and
written by a background thread while training goes on, published only when every rank's write
is done (``wait`` joins it: before the next save and before the run exits).

A load reads, on each rank, what that rank holds at the layout it runs, whatever layout saved:
the boxes it wants are filled from the saved ones they overlap. It checks every file's size
first, and the digest of each file it reads (``DigestCache`` remembers the verdicts). At the
layout that saved, everything is exact, RNG streams included; at another, everything but the
RNG streams (dropout draws differ after the resume), and the per-rank task states are handed
over whole (``rank_states``) to be re-keyed.

``LoadMode.WEIGHTS`` (--finetune, --pretrained-checkpoint, a conversion's ``WEIGHTS_ONLY``)
loads the model's weights and float32 masters only; the parameters under an ``optional``
prefix may be missing and keep their initialisation. A run whose frozen parameters come from
--pretrained-checkpoint saves what it trains only (``FROZEN_LM_EXCLUDED``) and reads the
frozen ones from there on every resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet import compat
from megatron_tempnet.distributed.groups import host_group, init_host_group
from megatron_tempnet.trainer import checkpoint_writer
from megatron_tempnet.trainer.checkpoint_format import (
    FROZEN_LM_EXCLUDED,
    TRAIN_STATE,
    WEIGHTS_ONLY,
    CheckpointError,
    DigestCache,
    IncompatibleCheckpoint,
    check_checkpoint,
    choose_checkpoint,
    has_marker,
    latest_tag,
    not_this_format,
    rank_state_files,
    read_train_state,
    tag_for,
)
from megatron_tempnet.trainer.checkpoint_writer import SaveJob, rank_file
from megatron_tempnet.trainer.config import TEMPNET_DIST
from megatron_tempnet.trainer.file_io import load_file
from megatron_tempnet.trainer.host_buffers import HostArena
from megatron_tempnet.trainer.rng_state import rng_state, set_rng_state
from megatron_tempnet.trainer.shard_reading import (
    SavedTensor,
    files_read,
    load_boxes,
    narrow,
    saved_tensors,
    verify_reads,
)
from megatron_tempnet.trainer.shard_storage import DIRECTORY
from megatron_tempnet.trainer.sharded_state import (
    MASTER,
    WEIGHT,
    key,
    optimizer_step,
    parameter_boxes,
    prepare_optimizer_states,
)
from megatron_tempnet.utils.logging import log_rank0

FORMAT = 2
OURS = TEMPNET_DIST
_REQUIRED = ", and --exit-on-missing-checkpoint stops the run instead of starting from scratch"
_FROZEN_NOTE = (
    "This checkpoint holds the trained parameters only: the frozen ones are read again from the "
    "run's --pretrained-checkpoint on every resume.\n"
)


class LoadMode(enum.Enum):
    RESUME = "resume"
    """Everything: weights, masters, optimizer, RNG, data position (--load)."""
    WEIGHTS = "weights"
    """The weights and masters only: the run starts at iteration 0 (--finetune, conversions)."""


def current_layout(engine) -> dict[str, int]:
    return {
        "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel": parallel_state.get_data_parallel_world_size(),
        "zero_stage": engine.zero_optimization_stage(),
    }


def describe_layout(layout: dict[str, int]) -> str:
    return (
        f"TP {layout['tensor_parallel']} x PP {layout['pipeline_parallel']} x DP "
        f"{layout['data_parallel']} (ZeRO {layout['zero_stage']})"
    )


@dataclasses.dataclass
class _Plan:
    """What a load of one checkpoint directory reads on this rank."""

    directory: str
    mode: LoadMode
    boxes: list
    files: set[str]
    state: dict | None
    names: list[str]
    fresh_moments: list[str]
    missing: set[str]


@contextlib.contextmanager
def timeout_named(minutes: float):
    """The host group's timeout (a rank still writing or reading its files while the others
    wait in a collective) as a ``CheckpointError`` that names its flag and value."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CheckpointError) or "Timed out" not in str(e):
            raise
        raise CheckpointError(
            "the ranks waited for each other's checkpoint files longer than "
            f"--checkpoint-timeout-minutes ({minutes:g}): a slow file system needs a larger "
            f"value ({str(e).splitlines()[0]})"
        ) from e


class Checkpointer:
    """The checkpoints of one run (every rank makes one, after the engine: collective).

    ``model``: the task's ``TrainModel`` (its ``tensor_layout``, ``optional`` prefixes and
    ``frozen_from_pretrained``); ``config``: the run's ``RunConfig``.
    """

    def __init__(self, engine, model, config):
        if model.tensor_layout is None:
            raise ValueError("a model without a tensor layout cannot be checkpointed")
        self.engine, self.model, self.config = engine, model, config
        self.ckpt = config.checkpoint
        # the host group: an asynchronous save's exchanges run beside training's collectives,
        # and a slow file system gets --checkpoint-timeout-minutes
        self.group = host_group() or init_host_group(
            timedelta(minutes=self.ckpt.checkpoint_timeout_minutes)
        )
        cache = os.path.join(self.ckpt.save, ".digests") if self.ckpt.save else None
        self.cache = DigestCache(cache)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._arena: HostArena | None = None  # --async-save's host copies
        # the last load's bytes: read, read to check digests, and of the tensors filled
        self.bytes_read = self.bytes_checked = self.bytes_held = 0

    # ------------------------------------------------------------------ saving

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

    # ------------------------------------------------------------------ loading

    def resume(self) -> dict | None:
        """--pretrained-checkpoint and --load as the run's flags ask; the state to continue
        from (``iteration``, ``data``, ``schedule``, ``rank_state`` or ``rank_states``), or
        None for a fresh start."""
        ckpt = self.ckpt
        fresh = ckpt.load and latest_tag(ckpt.load) is None
        if ckpt.pretrained_checkpoint and (fresh or self.model.frozen_from_pretrained):
            # a fresh run starts from these weights; a frozen-LM run re-reads its LM every time
            log_rank0(
                "%s: loading --pretrained-checkpoint %s",
                "no checkpoint in --load yet" if fresh else "the frozen LM",
                ckpt.pretrained_checkpoint,
            )
            self.load_pretrained(ckpt.pretrained_checkpoint)
        if not ckpt.load or (fresh and ckpt.pretrained_checkpoint):
            return None
        mode = LoadMode.WEIGHTS if ckpt.finetune else LoadMode.RESUME
        flag = "--finetune --load" if ckpt.finetune else "--load"
        with self._timeout_named():
            return self._load(ckpt.load, mode, flag, require=ckpt.exit_on_missing_checkpoint)

    def load_pretrained(self, load_dir: str, flag: str = "--pretrained-checkpoint") -> None:
        """The weights of ``load_dir``'s newest checkpoint (every parameter, frozen included)."""
        with self._timeout_named():
            self._load(load_dir, LoadMode.WEIGHTS, flag, require=True)

    def _load(self, load_dir: str, mode: LoadMode, flag: str, *, require: bool) -> dict | None:
        source = f"{flag} {load_dir}"
        required = require or mode is LoadMode.WEIGHTS
        if not os.path.isdir(load_dir):
            if required:
                raise CheckpointError(f"{source}: no such directory" + _REQUIRED * require)
            log_rank0("no checkpoint in %s: starting from scratch", load_dir)
            return None
        foreign = self._foreign(load_dir, source)
        if foreign is not None:
            self._load_foreign(foreign, mode, source)
            return None
        plans: dict[str, _Plan] = {}

        def check(directory: str) -> None:
            plans[directory] = self._checked_plan(directory, mode, source)

        tag = choose_checkpoint(load_dir, source, fallback=self.ckpt.load_fallback, check=check)
        if tag is None:
            if required:
                raise CheckpointError(
                    f"{source}: no checkpoint there (no 'latest')" + _REQUIRED * require
                )
            log_rank0("no checkpoint in %s: starting from scratch", load_dir)
            return None
        plan = plans[os.path.join(load_dir, tag)]
        self.bytes_held = sum(b.tensor.numel() * b.tensor.element_size() for b in plan.boxes)
        error, self.bytes_read = _read(plan, source)
        self._agree(error)
        if plan.mode is LoadMode.WEIGHTS:
            log_rank0(
                "loaded weights from %s (%s), a tempnet_dist checkpoint", plan.directory, flag
            )
            return None
        return self._finish_resume(plan, source)

    def _foreign(self, load_dir: str, source: str):
        """Another framework's checkpoint in ``load_dir`` (none where this project's is)."""
        opener = self.model.foreign_checkpoint
        if opener is None or latest_tag(load_dir) is not None:
            return None
        return opener(load_dir, source)

    def _load_foreign(self, foreign, mode: LoadMode, source: str) -> None:
        """The weights of another framework's checkpoint, whatever layout saved it: each rank
        reads the full tensors of its parameters and keeps its boxes of them."""
        log_rank0("%s holds %s", source, foreign.description)
        if mode is LoadMode.RESUME:
            log_rank0(
                "%s: its weights only (its optimizer, RNG and data position are another "
                "framework's): starting at iteration 0, as with --finetune",
                source,
            )
        params = parameter_boxes(
            self.engine, self.model.tensor_layout, saving=False, skip_frozen=False, moments=False
        )
        names = [p.name for p in params]
        every = [None] * dist.get_world_size()  # every stage's: what none of them reads is stray
        dist.all_gather_object(every, names, group=self.group)
        error = None
        try:
            stray = foreign.stray(sorted({n for ns in every for n in ns}))
            if stray:
                raise IncompatibleCheckpoint(
                    f"{source}: its tensor {stray[0]} has no place in this model ({len(stray)} "
                    "such): a checkpoint of another architecture? (--use-checkpoint-args takes "
                    "the model from it)"
                )
            saved = {
                key(WEIGHT, n): SavedTensor(torch.float32, shape, ())
                for n, shape in foreign.shapes(names).items()
            }
            boxes, _, missing = _select(params, saved, self.model.optional, source)
            self.bytes_held = self.bytes_read = 0
            for fqn, group in itertools.groupby(sorted(boxes, key=_fqn), key=_fqn):
                full = foreign.full(fqn.partition("/")[2])
                for box in group:
                    box.tensor.copy_(narrow(full, box.offsets, box.tensor.shape))
                    self.bytes_held += box.tensor.numel() * box.tensor.element_size()
                self.bytes_read += full.numel() * full.element_size()
            for what in sorted(missing):
                log_rank0("%s starts from its initialisation: %s has no %s", what, source, what)
        except CheckpointError as e:
            error = str(e)
        self._agree(error)
        log_rank0("loaded weights from %s (%s)", foreign.path, source)

    def _agree(self, error: str | None) -> None:
        """Raise the first rank's error on every rank (collective)."""
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, error, group=self.group)
        error = next((e for e in gathered if e is not None), None)
        if error is not None:
            raise CheckpointError(error)

    def _checked_plan(self, directory: str, mode: LoadMode, source: str) -> _Plan:
        """The plan of a load of ``directory``, its files checked (collective: a checkpoint any
        rank refuses stops every rank, with the same error)."""
        plan, error, incompatible = None, None, False
        try:
            try:
                plan = self._plan(directory, mode, source)
            except IncompatibleCheckpoint as e:
                error, incompatible = str(e), True
                raise
            whole = {f for f in plan.files if not f.startswith(f"{DIRECTORY}/rank")}
            check_checkpoint(directory, source, verify=whole, cache=self.cache)
            try:  # the parts of the tensor files this rank reads, by their own digests
                self.bytes_checked = verify_reads(directory, plan.boxes, self.cache)
            except CheckpointError as e:
                raise CheckpointError(f"{source}: {e}") from None
            for name in sorted(f for f in plan.files if f.endswith(".pt")):
                try:  # opened without running code: a planted pickle stops every rank now
                    load_file(os.path.join(directory, name), mmap=True)
                except CheckpointError as e:
                    raise CheckpointError(f"{source}: {e}") from None
        except CheckpointError as e:
            error = str(e)
        gathered = [None] * dist.get_world_size()
        names = plan.names if plan is not None else []
        missing = plan.missing if plan is not None else set()
        dist.all_gather_object(gathered, (error, incompatible, names, missing), group=self.group)
        first = next(((e, i) for e, i, _, _ in gathered if e is not None), None)
        if first is None:  # what any stage lacks is said once, by rank 0
            plan.missing = set().union(*(m for *_, m in gathered))
        if first is None and plan.mode is LoadMode.RESUME:  # the same on every rank
            extra = _extra_tensor(plan, {n for _, _, ns, _ in gathered for n in ns}, source)
            first = None if extra is None else (extra, True)
        if first is not None:
            raise (IncompatibleCheckpoint if first[1] else CheckpointError)(first[0])
        return plan

    def _plan(self, directory: str, mode: LoadMode, source: str) -> _Plan:
        """What this rank reads from ``directory`` (raises what makes it unusable)."""
        engine, tag = self.engine, os.path.basename(directory)
        if not os.path.isdir(os.path.join(directory, DIRECTORY)):
            raise IncompatibleCheckpoint(not_this_format(directory, source))
        if mode is LoadMode.RESUME and has_marker(directory, WEIGHTS_ONLY):
            log_rank0(
                "%s: %s holds weights only (no training state): starting at iteration 0 from its "
                "weights, as with --finetune",
                source,
                tag,
            )
            mode = LoadMode.WEIGHTS
        resume = mode is LoadMode.RESUME
        if resume and has_marker(directory, FROZEN_LM_EXCLUDED):
            if not self.model.frozen_from_pretrained:
                raise IncompatibleCheckpoint(
                    f"{source}: {tag} holds the trained parameters without the frozen ones: "
                    "resume it as the run that saved it (with its --pretrained-checkpoint)"
                )
        state = _train_state(directory, source) if resume else None
        if resume:
            self._check_batch(state, source)
        optimizer = resume and not self.ckpt.no_load_optim
        if optimizer:
            prepare_optimizer_states(engine, 0)  # the moments exist: the boxes are their views
        params = parameter_boxes(
            engine,
            self.model.tensor_layout,
            saving=False,
            skip_frozen=resume and self.model.frozen_from_pretrained,
            moments=optimizer,
        )
        optional = self.model.optional if mode is LoadMode.WEIGHTS else {}
        boxes, fresh, missing = _select(params, saved_tensors(directory), optional, source)
        files = files_read(directory, boxes)
        if resume:
            same = state["layout"] == current_layout(engine)
            files |= {TRAIN_STATE, rank_file(dist.get_rank())} if same else {TRAIN_STATE}
            files |= set() if same else set(rank_state_files(directory))
        names = [p.name for p in params]
        return _Plan(directory, mode, boxes, files, state, names, fresh, missing)

    def _check_batch(self, state: dict, source: str) -> None:
        """At another layout, the global batch size stays (the data position and the schedule
        count its samples)."""
        saved = state["config"]["training"]["global_batch_size"]
        now = self.config.training.global_batch_size
        if state["layout"] != current_layout(self.engine) and saved != now:
            raise IncompatibleCheckpoint(
                f"{source}: saved with --global-batch-size {saved}, this run has {now}: a resume "
                f"at another layout keeps the global batch size (the data position and the "
                f"schedule count its samples): set --global-batch-size {saved}"
            )

    def _finish_resume(self, plan: _Plan, source: str) -> dict:
        """AdamW's step, the engine's counters, the RNG streams and the task state."""
        engine, state, rank = self.engine, plan.state, dist.get_rank()
        if not self.ckpt.no_load_optim:
            prepare_optimizer_states(engine, int(state["step"]))
        if plan.fresh_moments:
            log_rank0(
                "%d tensor(s) did not train in the checkpoint (e.g. %s): their AdamW moments "
                "start at zero",
                len(plan.fresh_moments),
                plan.fresh_moments[0],
            )
        iteration = int(state["iteration"])
        batch = state["config"]["training"]["global_batch_size"]
        engine.global_steps = iteration
        engine.global_samples = int(
            (state.get("data") or {}).get("consumed_samples", iteration * batch)
        )
        client = {k: state.get(k) for k in ("data", "schedule", "config")}
        client["iteration"] = iteration
        saved_layout = state["layout"]
        if saved_layout == current_layout(engine):
            own = load_file(os.path.join(plan.directory, rank_file(rank)))
            if self.ckpt.no_load_rng:
                log_rank0("--no-load-rng: the RNG streams start from the run's seeds")
            else:
                set_rng_state(own)
            compat.set_loss_scale(engine, own.get("loss_scale"))
            client["rank_state"] = own.get("rank_state")
        else:
            log_rank0(
                "%s: resharded from %s to %s; RNG streams are not carried across a layout "
                "change: random draws (dropout) from iteration %d on differ from an "
                "uninterrupted run's; everything else is exact",
                source,
                describe_layout(saved_layout),
                describe_layout(current_layout(engine)),
                iteration + 1,
            )
            files = [
                load_file(os.path.join(plan.directory, f)) for f in rank_state_files(plan.directory)
            ]
            compat.set_loss_scale(engine, files[0].get("loss_scale") if files else None)
            client["rank_states"] = [
                f["rank_state"] for f in files if f.get("rank_state") is not None
            ]
        log_rank0(
            "resumed from %s at iteration %d, a tempnet_dist checkpoint", plan.directory, iteration
        )
        return client


def _select(params, saved: dict, optional: dict[str, str], source: str):
    """The boxes to fill, each named after the saved tensor it is read from; the parameters
    whose moments were not saved (they start at zero); what the checkpoint lacks of
    ``optional`` (it keeps its initialisation). Raises on a missing or misshapen tensor."""
    boxes, fresh, missing = [], [], set()
    for p in params:
        if key(WEIGHT, p.name) not in saved:
            what = next((w for pre, w in optional.items() if p.name.startswith(pre)), None)
            if what is not None:
                missing.add(what)  # e.g. TempNet on an LM-only checkpoint
                continue
            raise IncompatibleCheckpoint(
                f"{source}: the checkpoint has no tensor {p.name}, which this model has: a "
                "checkpoint of another architecture or loss?"
            )
        shape = saved[key(WEIGHT, p.name)].shape
        if shape != p.global_shape:
            raise IncompatibleCheckpoint(
                f"{source}: tensor {p.name} is {shape} in the checkpoint and {p.global_shape} "
                "in this model (full, unsharded shapes): a checkpoint of another model shape, "
                "vocabulary or TempNet size?"
            )
        for value, value_boxes in p.boxes.items():
            src = _source(value, p, saved)
            if src is None:
                fresh.append(p.name)
                continue
            boxes += [dataclasses.replace(b, fqn=src) for b in value_boxes]
    return boxes, sorted(set(fresh)), missing


def _source(value: str, p, saved: dict) -> str | None:
    """The saved tensor a value of parameter ``p`` is read from (None: not saved, a moment of
    a parameter that did not train then). A float32 weight is its master where one was saved
    (a bf16 checkpoint read by a float32 run); a master is the weight where none was (the
    weight was float32)."""
    weight, master = key(WEIGHT, p.name), key(MASTER, p.name)
    if value == WEIGHT:
        return master if p.param.dtype == torch.float32 and master in saved else weight
    if value == MASTER:
        return master if master in saved else weight
    return key(value, p.name) if key(value, p.name) in saved else None


def _read(plan: _Plan, source: str) -> tuple[str | None, int]:
    """Fill this rank's boxes: the error, if any (the ranks agree on it after), and the bytes
    read."""
    try:
        read = load_boxes(plan.directory, plan.boxes)
    except CheckpointError as e:
        return f"{source}: {e}", 0
    for what in sorted(plan.missing):
        log_rank0("%s starts from its initialisation: %s has no %s", what, source, what)
    return None, read


def _extra_tensor(plan: _Plan, names: set[str], source: str) -> str | None:
    """A resume reads a checkpoint of this model: none of its tensors lacks a place here."""
    saved = {
        fqn.partition("/")[2]
        for fqn in saved_tensors(plan.directory)
        if fqn.startswith(f"{WEIGHT}/")
    }
    extra = sorted(saved - names)
    if not extra:
        return None
    return (
        f"{source}: the checkpoint's tensor {extra[0]} has no place in this model "
        f"({len(extra)} such): a checkpoint of another architecture or loss?"
    )


def _train_state(directory: str, source: str) -> dict:
    state = read_train_state(directory, source)
    if state.get("format") != FORMAT:
        path = os.path.join(directory, TRAIN_STATE)
        raise CheckpointError(
            f"{source}: {path}: format {state.get('format')!r}, this version reads {FORMAT}"
        )
    return state


def _fqn(box) -> str:
    return box.fqn
