"""Checkpoints: DeepSpeed's engine state plus what makes a resume exact.

A checkpoint ``SAVE/iter_0000010/`` holds the engine's files (LM and TempNet weights, optimizer,
per model-parallel rank), and ``client_state`` with the iteration, the data position and the
resolved config; every rank adds its own RNG states and task state, e.g. its shard of CLIP's
per-sample state (``rng_rank{r}.pt``). The learning rate is a
function of the iteration, so it needs no state. ``SAVE/latest`` names the newest complete
checkpoint: it is replaced atomically only after every rank has finished writing, so a crash
during a save leaves the previous checkpoint as ``latest``.

A frozen-LM run seeded by ``--pretrained-checkpoint`` saves what it trains only (TempNet, its
optimizer, RNG and data position; ``exclude_frozen``): the LM is read again from the pretrained
checkpoint on resume. Such a checkpoint carries a ``FROZEN_LM_EXCLUDED`` file saying so.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch
import torch.distributed as dist

from megatron_tempnet.utils.logging import log_rank0

LATEST = "latest"
FROZEN_LM_EXCLUDED = "FROZEN_LM_EXCLUDED"
WEIGHTS_ONLY = "WEIGHTS_ONLY"  # a converted checkpoint: weights, no training state


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; names the directory and what is wrong."""


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    engine, save_dir: str, iteration: int, client_state: dict, keep_last: int,
    exclude_frozen: bool = False, rank_state: dict | None = None,
):  # fmt: skip
    """Save on every rank (collective); publish ``latest`` when all ranks are done.

    ``exclude_frozen``: leave out parameters that do not train (the frozen LM).
    ``rank_state``: this rank's own state (CLIP's per-sample state shard), saved with its RNG.
    """
    tag = tag_for(iteration)
    state = dict(client_state, iteration=iteration)
    engine.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False,
                           exclude_frozen_parameters=exclude_frozen)  # fmt: skip
    torch.save({**_rng_state(), "rank_state": rank_state},
               os.path.join(save_dir, tag, f"rng_rank{dist.get_rank()}.pt"))  # fmt: skip
    if exclude_frozen and dist.get_rank() == 0:
        with open(os.path.join(save_dir, tag, FROZEN_LM_EXCLUDED), "w") as f:
            f.write("This checkpoint holds TempNet, not the frozen LM: resume it with "
                    "--freeze-lm --pretrained-checkpoint <the LM's checkpoint>.\n")  # fmt: skip
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(save_dir, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST))
        if keep_last:
            _prune(save_dir, keep_last)
    dist.barrier()
    log_rank0("saved checkpoint %s", os.path.join(save_dir, tag))


def _prune(save_dir: str, keep_last: int) -> None:
    tags = sorted(d for d in os.listdir(save_dir) if d.startswith("iter_"))
    for old in tags[:-keep_last]:
        shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)


def latest_tag(load_dir: str) -> str | None:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def load_checkpoint(
    engine, load_dir: str, *, weights_only: bool, load_optimizer: bool, flag: str | None = None,
    lm_loaded: bool = False,
):  # fmt: skip
    """Restore the newest checkpoint; returns its client state (None when there is none).

    ``weights_only`` (--finetune, --pretrained-checkpoint) loads the model and nothing else: the
    caller starts at iteration 0 with fresh data position and optimizer. ``flag`` names the
    directory's flag in errors. ``lm_loaded``: the frozen LM is already in place, so a
    checkpoint without it (``FROZEN_LM_EXCLUDED``) may be resumed. A checkpoint marked
    ``WEIGHTS_ONLY`` (converted from Hugging Face) always loads as weights only.
    """
    source = f"{flag or ('--finetune --load' if weights_only else '--load')} {load_dir}"
    tag = latest_tag(load_dir)
    if tag is None:
        if weights_only:
            raise CheckpointError(f"{source}: no checkpoint there (no 'latest')")
        log_rank0("no checkpoint in %s: starting from scratch", load_dir)
        return None
    if not weights_only and os.path.exists(os.path.join(load_dir, tag, WEIGHTS_ONLY)):
        log_rank0("%s: %s holds weights only (no training state): starting at iteration 0 "
                  "from its weights, as with --finetune", source, tag)  # fmt: skip
        weights_only = True
    _check_layout(engine, load_dir, tag, source)
    lm_excluded = os.path.exists(os.path.join(load_dir, tag, FROZEN_LM_EXCLUDED))
    if lm_excluded and not lm_loaded:
        raise CheckpointError(
            f"{source}: {tag} holds TempNet without the frozen LM: resume it with --freeze-lm "
            "--pretrained-checkpoint <the LM's checkpoint> (as the run that saved it)"
        )
    if weights_only:
        _check_finetune_source(engine, load_dir, tag, source)
    if hasattr(engine.module, "allow_missing_tempnet"):  # a pipeline stage
        engine.module.allow_missing_tempnet = weights_only
    path, client_state = engine.load_checkpoint(
        load_dir,
        tag=tag,
        # an LM-only checkpoint may lack TempNet, a frozen-LM one the LM
        load_module_strict=not (weights_only or lm_excluded),
        load_module_only=weights_only,
        load_optimizer_states=load_optimizer and not weights_only,
        load_lr_scheduler_states=False,
    )
    if path is None:
        raise CheckpointError(f"{source}: checkpoint {tag} could not be read")
    if weights_only:
        log_rank0("loaded weights from %s (--finetune)", path)
        return None
    rng_file = os.path.join(load_dir, tag, f"rng_rank{dist.get_rank()}.pt")
    if os.path.isfile(rng_file):
        rank_file = torch.load(rng_file, weights_only=False)
        _set_rng_state(rank_file)
        client_state["rank_state"] = rank_file.get("rank_state")
    log_rank0("resumed from %s at iteration %d", path, client_state["iteration"])
    return client_state


def _check_layout(engine, load_dir: str, tag: str, source: str) -> None:
    """A pipeline checkpoint (one file per layer) loads into a pipeline run only, and back."""
    saved_pipeline = bool(glob.glob(os.path.join(load_dir, tag, "layer_*-model_states.pt")))
    running_pipeline = hasattr(engine.module, "ckpt_layer_path_list")
    if saved_pipeline != running_pipeline:
        saved = "with" if saved_pipeline else "without"
        flag = "1" if not running_pipeline else "> 1"
        raise CheckpointError(
            f"{source}: {tag} was saved {saved} pipeline parallelism and this run has "
            f"--pipeline-model-parallel-size {flag}: load it with the layout it was saved with"
        )


def _check_finetune_source(engine, load_dir: str, tag: str, source: str) -> None:
    """--finetune may start TempNet fresh (an LM-only checkpoint), but never the LM."""
    from megatron.core import parallel_state

    if hasattr(engine.module, "ckpt_layer_path_list"):
        return _check_pipeline_source(engine.module, load_dir, tag, source)

    rank = parallel_state.get_tensor_model_parallel_rank()
    path = os.path.join(load_dir, tag, f"mp_rank_{rank:02d}_model_states.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{source}: {path} is missing")
    saved = torch.load(path, map_location="cpu", weights_only=False).get("module") or {}
    if not saved:  # ZeRO-3 keeps the weights in its partition files: nothing to compare here
        return
    missing = sorted(set(engine.module.state_dict()) - set(saved))
    lm_missing = [k for k in missing if not k.startswith("tempnet.")]
    if lm_missing:
        raise CheckpointError(
            f"{source}: {path} lacks {len(lm_missing)} language-model "
            f"tensors (e.g. {lm_missing[0]}): a checkpoint of another architecture?"
        )
    if missing:
        log_rank0("TempNet starts from its initialisation: %s has no TempNet", path)


def _check_pipeline_source(module, load_dir: str, tag: str, source: str) -> None:
    """Every language-model piece of this stage has its layer file in the checkpoint."""
    from megatron_tempnet.training.pipeline import TempNetPiece

    directory = os.path.join(load_dir, tag)
    for local, piece in enumerate(module.forward_funcs):
        if isinstance(piece, TempNetPiece) or not hasattr(piece, "state_dict"):
            continue
        if not module.ckpt_layer_path_list(directory, local):
            raise CheckpointError(
                f"{source}: {tag} has no file for pipeline layer "
                f"{local + module._local_start}: a checkpoint of another "
                "--pipeline-model-parallel-size or architecture?"
            )
