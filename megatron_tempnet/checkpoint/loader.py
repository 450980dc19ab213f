"""Loading a run's checkpoints (``Checkpointer.resume``, ``load_pretrained``), at any layout.

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
frozen ones from there on every resume. Another framework's checkpoint (the model's
``foreign_checkpoint``) gives its weights.

Names: ``load_dir`` is the directory a flag names (--load, --pretrained-checkpoint), holding
checkpoints ``iter_NNNNNNN``; ``directory`` is one checkpoint's (``load_dir/tag``); ``source``
is the flag and its value, as errors name them.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os

import torch
import torch.distributed as dist

from megatron_tempnet import compat
from megatron_tempnet.checkpoint.checkpoint_format import (
    FORMAT,
    FROZEN_LM_EXCLUDED,
    TRAIN_STATE,
    WEIGHTS_ONLY,
    CheckpointError,
    IncompatibleCheckpoint,
    check_checkpoint,
    choose_checkpoint,
    has_marker,
    latest_tag,
    not_this_format,
    rank_state_files,
    read_train_state,
)
from megatron_tempnet.checkpoint.checkpoint_writer import rank_file
from megatron_tempnet.checkpoint.file_io import load_file
from megatron_tempnet.checkpoint.ranks import current_layout, describe_layout, timeout_named
from megatron_tempnet.checkpoint.rng_state import set_rng_state
from megatron_tempnet.checkpoint.shard_reading import (
    SavedTensor,
    files_read,
    load_boxes,
    narrow,
    saved_tensors,
    verify_reads,
)
from megatron_tempnet.checkpoint.shard_storage import DIRECTORY
from megatron_tempnet.checkpoint.sharded_state import (
    MASTER,
    WEIGHT,
    key,
    parameter_boxes,
    prepare_optimizer_states,
)
from megatron_tempnet.utils.logging import log_rank0


def _required(require: bool) -> str:
    """What an error about a missing checkpoint adds when --exit-on-missing-checkpoint asked."""
    if not require:
        return ""
    return ", and --exit-on-missing-checkpoint stops the run instead of starting from scratch"


class LoadMode(enum.Enum):
    RESUME = "resume"
    """Everything: weights, masters, optimizer, RNG, data position (--load)."""
    WEIGHTS = "weights"
    """The weights and masters only: the run starts at iteration 0 (--finetune, conversions)."""


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


@dataclasses.dataclass
class _Verdict:
    """One rank's verdict on a checkpoint it would load, gathered by every rank: its error (None:
    usable) and whether the checkpoint is of another model or run (``IncompatibleCheckpoint``);
    the parameters this rank loads and what of ``optional`` the checkpoint lacks."""

    error: str | None
    incompatible: bool = False
    names: list[str] = dataclasses.field(default_factory=list)
    missing: set[str] = dataclasses.field(default_factory=set)


class CheckpointLoader:
    """One run's loads: ``engine``, ``model`` and ``config`` as in ``Checkpointer``, ``group`` the
    host group, ``cache`` the ``DigestCache``. ``bytes_read``, ``bytes_checked`` and
    ``bytes_held``: the last load's bytes read, read to check digests, and of the tensors
    filled."""

    def __init__(self, engine, model, config, group, cache):
        self.engine, self.model, self.config = engine, model, config
        self.ckpt, self.group, self.cache = config.checkpoint, group, cache
        self.bytes_read = self.bytes_checked = self.bytes_held = 0

    def _timeout_named(self):
        return timeout_named(self.ckpt.checkpoint_timeout_minutes)

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
                raise CheckpointError(f"{source}: no such directory" + _required(require))
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
                    f"{source}: no checkpoint there (no 'latest')" + _required(require)
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
        return _finish_resume(self.engine, self.ckpt, plan, source)

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
        mine = _Verdict(error, incompatible)
        if plan is not None:
            mine.names, mine.missing = plan.names, plan.missing
        every: list[_Verdict] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=self.group)
        refusal = next((v for v in every if v.error is not None), None)
        if refusal is None:  # what any stage lacks is said once, by rank 0
            plan.missing = set().union(*(v.missing for v in every))
        if refusal is None and plan.mode is LoadMode.RESUME:  # the same on every rank
            extra = _extra_tensor(plan, {n for v in every for n in v.names}, source)
            refusal = None if extra is None else _Verdict(extra, incompatible=True)
        if refusal is not None:
            raise (IncompatibleCheckpoint if refusal.incompatible else CheckpointError)(
                refusal.error
            )
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


def _finish_resume(engine, ckpt, plan: _Plan, source: str) -> dict:
    """AdamW's step, the engine's counters, the RNG streams and the task state (``ckpt``: the
    run's ``CheckpointConfig``)."""
    state, rank = plan.state, dist.get_rank()
    if not ckpt.no_load_optim:
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
        if ckpt.no_load_rng:
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
        client["rank_states"] = [f["rank_state"] for f in files if f.get("rank_state") is not None]
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
