"""Checkpoints through the DeepSpeed engine, plus what makes a resume exact at any layout.

The engine writes the module's weights and the optimizer (per model-parallel rank; ZeRO
partitions per data-parallel rank) with ``client_state``: the iteration, the data position and the
resolved config. Every rank adds its RNG states and its task state (``rng_rank{r}.pt``, e.g. its
shard of CLIP's per-sample state), and every checkpoint carries a layout-free copy of the
training state (``portable/``, ``trainer.portable``). The learning rate is a function of the
iteration, so it needs no state. The directory layout and the publication of ``latest`` are
``checkpoint_format``'s.

A resume at the layout that saved (TP, PP, DP size, ZeRO stage) goes through DeepSpeed's load,
bit for bit, RNG streams included. At another layout it is resharded from ``portable/``
(``trainer.resharding``): weights, float32 masters, AdamW's moments and step, the iteration and
the data position are exact; the RNG streams are not carried (dropout draws differ after the
resume), and the per-rank task states are handed over whole (``load_state_dicts``) to be
re-keyed.

A run whose frozen parameters come from ``--pretrained-checkpoint`` saves what it trains only
(``exclude_frozen``) and marks the checkpoint ``FROZEN_LM_EXCLUDED``: a resume reads the frozen
parameters from the pretrained checkpoint first.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import shutil
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_tempnet import compat
from megatron_tempnet.distributed.sharding import TensorLayout
from megatron_tempnet.trainer.checkpoint_format import (
    COMPLETE,
    FROZEN_LM_EXCLUDED,
    WEIGHTS_ONLY,
    CheckpointError,
    check_checkpoint,
    checkpoint_files,
    checkpoint_tags,
    choose_checkpoint,
    file_digest,
    has_marker,
    is_complete,
    latest_tag,
    publish_latest,
    tag_for,
    write_complete,
)
from megatron_tempnet.trainer.file_io import describe_error, load_file
from megatron_tempnet.trainer.portable import PortableState, has_portable_state
from megatron_tempnet.trainer.resharding import (
    check_shapes,
    current_layout,
    restore,
    save_portable_state,
)
from megatron_tempnet.utils.logging import log_rank0

_REQUIRED = ", and --exit-on-missing-checkpoint stops the run instead of starting from scratch"
_FROZEN_NOTE = (
    "This checkpoint holds the trained parameters only: the frozen ones are read again from the "
    "run's --pretrained-checkpoint on every resume.\n"
)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
        "runtime": compat.rng_runtime(),  # whose generator states the tracker's are
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    """The saved streams, where they fit: the CPU's always; the tracker's (dropout) and CUDA's
    only on the runtime that saved them (a CPU generator's state is no CUDA one's)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    saved = state.get("runtime", "cuda" if "cuda" in state else "cpu")  # older files: inferred
    if not compat.tracker_states_restorable(saved):
        log_rank0(
            "the checkpoint's dropout RNG streams were saved on %s and this run is on %s: they "
            "start from the run's seeds; everything else is exact",
            saved.upper(),
            compat.rng_runtime().upper(),
        )
        return
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    engine,
    save_dir: str,
    iteration: int,
    client_state: dict,
    *,
    keep_last: int = 0,
    exclude_frozen: bool = False,
    rank_state: dict | None = None,
    tensor_layout: TensorLayout | None = None,
) -> None:
    """Save on every rank (collective); mark it complete and publish ``latest`` when every file
    of every rank is on disk. A failed write on any rank (a full disk) stops every rank with one
    ``CheckpointError`` naming the file and the cause; the previous checkpoint stays ``latest``.

    ``exclude_frozen``: leave out the parameters that do not train. ``rank_state``: this rank's
    own state, saved with its RNG states. ``keep_last``: then delete all but the newest N complete
    checkpoints. ``tensor_layout``: the model's, for the layout-free copy (None: no ``portable/``).
    """
    tag, rank = tag_for(iteration), dist.get_rank()
    directory = os.path.join(save_dir, tag)
    if rank == 0:
        _clear_for_save(save_dir, tag)
    dist.barrier()
    writer = engine.checkpoint_engine.writer
    writer.failure = None
    try:
        engine.save_checkpoint(
            save_dir,
            tag=tag,
            client_state=dict(client_state, iteration=iteration),
            save_latest=False,
            exclude_frozen_parameters=exclude_frozen,
        )
    except OSError as e:  # a write outside the checkpoint engine: this rank alone knows
        raise CheckpointError(
            f"saving {directory} failed: {describe_error(directory, e)}"
        ) from None
    writer.save({**_rng_state(), "rank_state": rank_state}, _rank_file(directory, rank))
    if tensor_layout is not None:
        save_portable_state(
            engine,
            directory,
            writer=writer,
            tensor_layout=tensor_layout,
            exclude_frozen=exclude_frozen,
            iteration=iteration,
            data=client_state.get("data"),
            config=client_state.get("config"),
        )
    if exclude_frozen and rank == 0:
        writer.write_text(os.path.join(directory, FROZEN_LM_EXCLUDED), _FROZEN_NOTE)
    _agree(writer.failure, save_dir, directory)
    _agree(_complete(save_dir, tag, keep_last), save_dir, directory, published=True)
    log_rank0("saved checkpoint %s", directory)


def _clear_for_save(save_dir: str, tag: str) -> None:
    """Remove what an earlier save of ``tag`` left (an interrupted save, or a checkpoint newer
    than the one resumed from); never the one ``latest`` names."""
    directory = os.path.join(save_dir, tag)
    if not os.path.exists(directory):
        return
    if latest_tag(save_dir) == tag:
        raise CheckpointError(
            f"--save {save_dir}: {tag} is the checkpoint 'latest' names: it is not overwritten"
        )
    why = "complete, not named by 'latest'" if is_complete(directory) else "an interrupted save"
    log_rank0("removing %s (%s) before saving it again", directory, why)
    _remove_checkpoint(directory)


def _remove_checkpoint(directory: str) -> None:
    """Marker first: a deletion cut short leaves an incomplete directory, never a complete one
    with files missing."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, COMPLETE))
    shutil.rmtree(directory, ignore_errors=True)


def _complete(save_dir: str, tag: str, keep_last: int) -> str | None:
    """Every file's checksum (the ranks share the reading, each flushing its files to disk),
    then on rank 0 the marker, ``latest`` and the pruning; the failure, if any (collective)."""
    directory = os.path.join(save_dir, tag)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [checkpoint_files(directory) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    digests, failure = {}, None
    for name in names[0][rank::world]:
        path = os.path.join(directory, name)
        try:
            digests[name] = file_digest(path, fsync=True)
        except OSError as e:
            failure = failure or describe_error(path, e)
    gathered = [None] * world
    dist.all_gather_object(gathered, (digests, failure))
    failure = next((f for _, f in gathered if f is not None), None)
    if rank == 0 and failure is None:
        try:
            write_complete(directory, {k: v for d, _ in gathered for k, v in d.items()})
            publish_latest(save_dir, tag)
        except OSError as e:
            failure = describe_error(directory, e)
        if failure is None and keep_last:
            _prune(save_dir, keep_last)
    result = [failure]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _agree(failure: str | None, save_dir: str, directory: str, published: bool = False) -> None:
    """Stop every rank when any rank's part of the save failed (collective unless published,
    where rank 0's outcome is everyone's already)."""
    if not published:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, failure)
        failure = next((f for f in gathered if f is not None), None)
    if failure is None:
        return
    previous = latest_tag(save_dir)
    if dist.get_rank() == 0:
        _remove_checkpoint(directory)
    kept = f"'latest' still names {previous}" if previous else "no checkpoint was published"
    raise CheckpointError(
        f"saving {directory} failed: {failure}; {kept} and the incomplete directory was removed"
    )


def _prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (after the new one is
    complete and published: the one ``latest`` names is never among them)."""
    latest = latest_tag(save_dir)
    complete = [t for t in checkpoint_tags(save_dir) if is_complete(os.path.join(save_dir, t))]
    for old in complete[:-keep_last]:
        if old != latest:
            _remove_checkpoint(os.path.join(save_dir, old))


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rng_rank{rank}.pt")


def load_checkpoint(
    engine,
    load_dir: str,
    *,
    weights_only: bool,
    load_optimizer: bool,
    optional: dict[str, str] | None = None,
    flag: str | None = None,
    frozen_loaded: bool = False,
    tensor_layout: TensorLayout | None = None,
    weights_reader: Callable | None = None,
    global_batch_size: int | None = None,
    fallback: bool = False,
    load_rng: bool = True,
    require: bool = False,
) -> dict | None:
    """Restore the newest checkpoint; returns its client state (None: nothing to resume).

    ``weights_only`` (--finetune, --pretrained-checkpoint) loads the model and nothing else: the
    caller starts at iteration 0 with a fresh data position and optimizer; the parameters under
    an ``optional`` prefix may be missing and then keep their initialisation. ``flag`` names the
    directory's flag in errors. ``frozen_loaded``: the frozen parameters are in place already,
    so a checkpoint without them (``FROZEN_LM_EXCLUDED``) may be resumed. A checkpoint marked
    ``WEIGHTS_ONLY`` (a conversion) always loads as weights only.

    At another layout than the one that saved, the state is resharded (``tensor_layout``: the
    model's) from the checkpoint's ``portable/`` copy, or for weights only from its module files
    (``weights_reader(directory)``: the task's reader, None where it has none); the global batch
    size must then be ``global_batch_size``'s, and the returned state carries every saved rank's
    task state (``rank_states``) instead of this rank's.

    The checkpoint's files are checked against its ``COMPLETE`` record first (the ranks share
    the reading); ``fallback`` (--load-fallback) loads the newest older valid one when the newest
    fails, otherwise the error names the damaged file.

    ``load_rng`` False (--no-load-rng): the RNG states stay as the run's seeds made them.
    ``require`` (--exit-on-missing-checkpoint): no checkpoint is an error, not a fresh start.
    """
    source = f"{flag or ('--finetune --load' if weights_only else '--load')} {load_dir}"
    optional = optional or {}
    if not os.path.isdir(load_dir):
        if weights_only or require:
            raise CheckpointError(f"{source}: no such directory" + _REQUIRED * require)
        log_rank0("no checkpoint in %s: starting from scratch", load_dir)
        return None
    check = functools.partial(_check_on_every_rank, source=source)
    tag = choose_checkpoint(load_dir, source, fallback=fallback, check=check)
    if tag is None:
        if weights_only or require:
            raise CheckpointError(
                f"{source}: no checkpoint there (no 'latest')" + _REQUIRED * require
            )
        log_rank0("no checkpoint in %s: starting from scratch", load_dir)
        return None
    directory = os.path.join(load_dir, tag)
    if not weights_only and has_marker(directory, WEIGHTS_ONLY):
        log_rank0(
            "%s: %s holds weights only (no training state): starting at iteration 0 from its "
            "weights, as with --finetune",
            source,
            tag,
        )
        weights_only = True
    frozen_excluded = has_marker(directory, FROZEN_LM_EXCLUDED)
    if frozen_excluded and not frozen_loaded:  # the task names what to add, before this
        raise CheckpointError(
            f"{source}: {tag} holds the trained parameters without the frozen ones: resume it "
            "as the run that saved it (with its --pretrained-checkpoint)"
        )
    other = _other_layout_source(
        engine,
        directory,
        weights_only,
        weights_reader,
        label=source,
        tensor_layout=tensor_layout,
        optional=optional,
        skip_frozen=frozen_loaded,
    )
    if other is not None:
        return _load_resharded(
            engine,
            other,
            directory,
            source,
            weights_only=weights_only,
            load_optimizer=load_optimizer,
            optional=optional,
            frozen_loaded=frozen_loaded,
            tensor_layout=tensor_layout,
            global_batch_size=global_batch_size,
        )
    _check_layout(engine, directory, source)
    if weights_only:
        _check_weights_source(engine, directory, source, optional)
    if _is_pipeline(engine.module):
        engine.module.weights_only_load = weights_only
    path, client_state = engine.load_checkpoint(
        load_dir,
        tag=tag,
        # a weights-only checkpoint may lack the optional parts, a frozen-LM one the frozen ones
        load_module_strict=not (weights_only or frozen_excluded),
        load_module_only=weights_only,
        load_optimizer_states=load_optimizer and not weights_only,
        load_lr_scheduler_states=False,
    )
    if path is None:
        raise CheckpointError(f"{source}: checkpoint {tag} could not be read")
    if weights_only:
        log_rank0("loaded weights from %s (--finetune)", path)
        return None
    rng_file = _rank_file(directory, dist.get_rank())
    if os.path.isfile(rng_file):
        rank_file = load_file(rng_file)
        if load_rng:
            _set_rng_state(rank_file)
        else:
            log_rank0("--no-load-rng: the RNG streams start from the run's seeds")
        client_state["rank_state"] = rank_file.get("rank_state")
    log_rank0("resumed from %s at iteration %d", path, client_state["iteration"])
    return client_state


def _check_on_every_rank(directory: str, *, source: str) -> None:
    """``check_checkpoint`` with the checksums shared among the ranks, then each rank's share
    of the ``.pt`` files opened without code execution (``load_file``, tensors mapped, not
    read): a file any rank would refuse later stops every rank now, with the same error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        check_checkpoint(directory, source, part=(rank, world))
        for name in [f for f in checkpoint_files(directory) if f.endswith(".pt")][rank::world]:
            try:
                load_file(os.path.join(directory, name), mmap=True)
            except CheckpointError as e:
                raise CheckpointError(f"{source}: {e}") from None
        error = None
    except CheckpointError as e:
        error = str(e)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    error = next((e for e in gathered if e is not None), None)
    if error is not None:
        raise CheckpointError(error)


def _other_layout_source(engine, directory: str, weights_only: bool, weights_reader, **check):
    """What to reshard from when the checkpoint was saved at another layout; None: load it
    with DeepSpeed (the same layout, or a checkpoint that can say nothing about its own).
    A checkpoint's ``portable/`` state is checked against the model first (``check``: the
    arguments of ``resharding.check_shapes``), at any layout."""
    if has_portable_state(directory):
        state = PortableState(directory)
        if check["tensor_layout"] is not None:
            check_shapes(engine, state, whole=not weights_only, **check)
        return state if state.layout != current_layout(engine) else None
    if weights_only and weights_reader is not None:
        from megatron.core import parallel_state as ps

        reader = weights_reader(directory)
        now = (ps.get_tensor_model_parallel_world_size(), _is_pipeline(engine.module))
        return reader if (reader.tensor_parallel, reader.pipeline) != now else None
    return None


def _load_resharded(
    engine,
    state,
    directory: str,
    source: str,
    *,
    weights_only: bool,
    load_optimizer: bool,
    optional: dict[str, str],
    frozen_loaded: bool,
    tensor_layout: TensorLayout | None,
    global_batch_size: int | None,
) -> dict | None:
    """Restore from a checkpoint of another layout (``state``: its ``PortableState``, or the
    module files' reader for weights only)."""
    now = current_layout(engine)
    if isinstance(state, PortableState):
        saved = str(state.layout)
    else:
        saved = f"TP {state.tensor_parallel}" + (" with pipeline parallelism" * state.pipeline)
    if tensor_layout is None:
        raise CheckpointError(
            f"{source}: saved at {saved}, this run is {now}, and this model cannot be resharded: "
            "resume it at the layout it was saved with"
        )
    log_rank0("%s: resharding from %s to %s", source, saved, now)
    common = dict(label=source, tensor_layout=tensor_layout, optional=optional)
    if weights_only:
        restore(engine, state, step=None, skip_frozen=frozen_loaded, **common)
        log_rank0("loaded weights from %s (--finetune)", directory)
        return None
    index = state.index
    saved_batch = index["config"]["training"]["global_batch_size"]
    if global_batch_size is not None and saved_batch != global_batch_size:
        raise CheckpointError(
            f"{source}: saved with --global-batch-size {saved_batch}, this run has "
            f"{global_batch_size}: a resume at another layout keeps the global batch size (the "
            f"data position and the schedule count its samples): set --global-batch-size "
            f"{saved_batch}"
        )
    step = state.step if load_optimizer else None
    restore(engine, state, step=step, skip_frozen=frozen_loaded, **common)
    iteration = int(index["iteration"])
    engine.global_steps, engine.global_samples = iteration, iteration * saved_batch
    log_rank0(
        "RNG streams are not carried across a layout change: random draws (dropout) from "
        "iteration %d on differ from an uninterrupted run's; everything else is exact",
        iteration + 1,
    )
    log_rank0("resumed from %s at iteration %d", directory, iteration)
    return {
        "iteration": iteration,
        "data": index["data"],
        "config": index["config"],
        "rank_states": _rank_states(directory),
    }


def _rank_states(directory: str) -> list[dict]:
    """Every saved rank's task state (CLIP's per-sample state shards), in rank order."""
    files = glob.glob(os.path.join(directory, "rng_rank*.pt"))
    files.sort(key=lambda f: int(os.path.basename(f)[len("rng_rank") : -len(".pt")]))
    states = [load_file(f).get("rank_state") for f in files]
    return [s for s in states if s is not None]


def _check_layout(engine, directory: str, source: str) -> None:
    """A pipeline checkpoint (one file per layer) loads into a pipeline run only, and back."""
    saved_pipeline = bool(glob.glob(os.path.join(directory, "layer_*-model_states.pt")))
    running_pipeline = _is_pipeline(engine.module)
    if saved_pipeline != running_pipeline:
        saved = "with" if saved_pipeline else "without"
        flag = "1" if not running_pipeline else "> 1"
        raise CheckpointError(
            f"{source}: {os.path.basename(directory)} was saved {saved} pipeline parallelism and "
            f"this run has --pipeline-model-parallel-size {flag}: load it with the layout it was "
            "saved with"
        )


def _is_pipeline(module) -> bool:
    """A pipeline stage (the trainer's ``Pipeline``, DeepSpeed's ``PipelineModule``)."""
    from deepspeed.pipe import PipelineModule

    return isinstance(module, PipelineModule)


def _is_optional(name: str, optional: dict[str, str]) -> bool:
    return any(name.startswith(prefix) for prefix in optional)


def _check_weights_source(engine, directory: str, source: str, optional: dict[str, str]) -> None:
    """A weights-only load may start the optional parts fresh, never the rest of the model."""
    from megatron.core import parallel_state

    if _is_pipeline(engine.module):
        return _check_pipeline_source(engine.module, directory, source, optional)
    rank = parallel_state.get_tensor_model_parallel_rank()
    path = os.path.join(directory, f"mp_rank_{rank:02d}_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{source}: {path} is missing")
    saved = load_file(path, mmap=True).get("module") or {}
    if not saved:  # ZeRO-3 keeps the weights in its partition files: nothing to compare here
        return
    missing = sorted(set(engine.module.state_dict()) - set(saved))
    required = [k for k in missing if not _is_optional(k, optional)]
    if required:
        raise CheckpointError(
            f"{source}: {path} lacks {len(required)} of the model's tensors (e.g. "
            f"{required[0]}): a checkpoint of another architecture?"
        )
    for prefix, what in optional.items():
        if any(k.startswith(prefix) for k in missing):
            log_rank0("%s starts from its initialisation: %s has no %s", what, path, what)


def _check_pipeline_source(module, directory: str, source: str, optional: dict[str, str]) -> None:
    """Every piece of this stage but the optional ones has its layer file in the checkpoint."""
    first = compat.pipeline_first_index(module)
    for local, piece in enumerate(compat.pipeline_pieces(module)):
        if not hasattr(piece, "state_dict"):
            continue
        names = [name for name, _ in piece.named_parameters()]
        if names and all(_is_optional(n, optional) for n in names):
            continue
        if not compat.pipeline_layer_files(module, directory, local):
            raise CheckpointError(
                f"{source}: {os.path.basename(directory)} has no file for pipeline layer "
                f"{local + first}: a checkpoint of another --pipeline-model-parallel-size or "
                "architecture?"
            )
