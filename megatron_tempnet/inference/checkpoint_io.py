"""Reading and writing this project's checkpoints without building the model or a process group.

A checkpoint directory ``DIR`` has ``DIR/latest`` naming ``DIR/iter_XXXXXXX/``
(``checkpoint.checkpoint_format``): layout-free global tensors (``weight/{name}``, and for a
training checkpoint ``master/…`` and the AdamW moments) in ``shards/``, and the run's config in
``train_state.json``. ``CheckpointReader`` gives the full tensors under ``GPTStack``'s names
one at a time, whatever layout saved them (a training run's float32 master where one was
saved); ``write_checkpoint`` writes a weights-only checkpoint (marked ``WEIGHTS_ONLY``) from one
process, one tensor at a time, which ``pretrain_gpt.py`` loads with ``--load``, ``--finetune``
or ``--pretrained-checkpoint`` at any layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import torch

from megatron_tempnet.checkpoint.checkpoint_format import (
    FORMAT,
    FROZEN_LM_EXCLUDED,
    TRAIN_STATE,
    WEIGHTS_ONLY,
    CheckpointError,
    checkpoint_dir,
    latest_tag,
    mark_complete,
    publish_latest,
    read_train_state,
    tag_for,
)
from megatron_tempnet.checkpoint.shard_reading import load_full, saved_tensors
from megatron_tempnet.checkpoint.shard_storage import write_full_tensors
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.state_names import WORD_EMBEDDINGS, lm_names
from megatron_tempnet.tempnet.config import saved_loss_settings
from megatron_tempnet.utils.progress import progress

TEMPNET_PREFIX = "tempnet."


class CheckpointReader:
    """The full tensors of a checkpoint, whatever layout saved it.

    ``model`` is the saved ``ModelConfig``, ``config`` the saved run config (a dict).
    ``path``: the checkpoint's own directory (``load_dir``'s newest by default).
    """

    def __init__(self, load_dir: str, flag: str = "--load", *, path: str | None = None):
        self.path = path or checkpoint_dir(load_dir, flag)
        self.flag = f"{flag} {load_dir}"
        self.lm_excluded = os.path.exists(os.path.join(self.path, FROZEN_LM_EXCLUDED))
        self.config = read_config(self.path, self.flag)
        if "model" not in self.config:
            raise CheckpointError(f"{self.flag}: {self.path} carries no model config")
        self.model = ModelConfig(**self.config["model"])
        try:
            self._saved = saved_tensors(self.path)
        except CheckpointError as e:
            raise CheckpointError(f"{self.flag}: {e}") from None
        self._names = [
            _inner(f.removeprefix("weight/")) for f in self._saved if f.startswith("weight/")
        ]

    def names(self) -> list[str]:
        return list(self._names)

    def has_lm(self) -> bool:
        return WORD_EMBEDDINGS in self._names

    def has_tempnet(self) -> bool:
        return any(k.startswith(TEMPNET_PREFIX) for k in self._names)

    def full(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (vocabulary unpadded): the float32 master where the
        checkpoint has one, else the weight as saved."""
        if name not in self._names:
            raise CheckpointError(f"{self.flag}: {self.path} has no tensor {name!r}")
        master = f"master/{_outer(name)}"
        fqn = master if master in self._saved else f"weight/{_outer(name)}"
        return load_full(self.path, fqn, self._saved[fqn])

    def tempnet_state(self) -> dict[str, torch.Tensor]:
        """TempNet's parameters (keys without the ``tempnet.`` prefix)."""
        return {
            k.removeprefix(TEMPNET_PREFIX): self.full(k)
            for k in self._names
            if k.startswith(TEMPNET_PREFIX)
        }


def open_reader(load_dir: str, flag: str = "--load", *, vocab_size: int | None = None):
    """A reader of ``load_dir``'s newest checkpoint: this project's (``CheckpointReader``), or
    Megatron-LM's (``models.gpt.megatron_lm``: torch_dist or legacy torch; ``vocab_size``, the
    tokenizer's, default the one its args name), with the same methods."""
    if os.path.isdir(load_dir) and latest_tag(load_dir) is None:
        from megatron_tempnet.models.gpt import megatron_lm

        found = megatron_lm.open_checkpoint(load_dir, f"{flag} {load_dir}", vocab_size)
        if found is not None:
            return found
    return CheckpointReader(load_dir, flag)


def export_reader_tempnet(reader: CheckpointReader, directory: str) -> dict:
    """Export the TempNet of ``reader``'s checkpoint to ``directory`` (``tempnet.export``,
    with the run's loss settings); returns its config."""
    from megatron_tempnet.tempnet.export import export_tempnet

    settings = saved_loss_settings(reader.config.get("loss", {}))
    keys = ("loss", "rho", "tau_min", "tau_max", "stop_grad")
    trained_with = {k: settings.get(k) for k in keys}
    trained_with["checkpoint"] = reader.path
    return export_tempnet(
        reader.tempnet_state(),
        directory,
        tau_min=settings["tau_min"],
        tau_max=settings["tau_max"],
        trained_with=trained_with,
    )


def read_config(directory: str, source: str) -> dict:
    """The run config a checkpoint directory was saved with (``train_state.json``)."""
    return read_train_state(directory, source).get("config") or {}


def _outer(name: str) -> str:
    """A ``GPTStack``/TempNet key as the training module names it (``lm.pieces.…``)."""
    return name if name.startswith(TEMPNET_PREFIX) else "lm." + name


def _inner(name: str) -> str:
    return name.removeprefix("lm.")


def write_checkpoint(
    save_dir: str,
    model: ModelConfig,
    full: Callable[[str], torch.Tensor],
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    config: dict | None = None,
    note: str = "",
) -> str:
    """Write the LM (``full(name)`` gives each full tensor) as a weights-only checkpoint, one
    tensor at a time. It loads at any layout; ``tensor_parallel`` and ``pipeline_parallel``
    are checked against the model (the layout the caller means to train at). Returns the
    checkpoint's directory."""
    model.validate(tensor_parallel)
    if model.num_layers % pipeline_parallel:
        raise CheckpointError(
            f"--target-pp ({pipeline_parallel}) must divide the model's {model.num_layers} layers"
        )
    names = [n for n in lm_names(model) if not n.endswith("_extra_state")]
    run_config = dict(config or {}, model=model.__dict__.copy())
    return write_weights(
        save_dir, ((_outer(n), lambda n=n: full(n)) for n in names), len(names), run_config, note
    )


def write_weights(
    save_dir: str,
    tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
    count: int,
    config: dict,
    note: str = "",
) -> str:
    """A weights-only checkpoint of a one-process model: ``(name, load)`` per parameter
    (the training module's names, full tensors), written one at a time; ``latest`` last.
    Returns its directory."""
    tag = tag_for(0)
    out = os.path.join(save_dir, tag)
    os.makedirs(out, exist_ok=True)
    with progress(f"writing {save_dir}", count, unit="tensor") as bar:

        def each():
            for name, load in tensors:
                yield f"weight/{name}", load
                bar.update(1)

        write_full_tensors(out, each())
    state = {"format": FORMAT, "iteration": 0, "config": config}
    with open(os.path.join(out, TRAIN_STATE), "w") as f:
        json.dump(state, f, indent=1)
    with open(os.path.join(out, WEIGHTS_ONLY), "w") as f:
        f.write(note or "Weights only: no optimizer, RNG or data position.\n")
    mark_complete(out)
    publish_latest(save_dir, tag)
    return out


def write_model_flags(save_dir: str, flags: list[str]) -> str:
    """``DIR/model_flags.txt``: the model flags that build a converted checkpoint's model."""
    line = " ".join(flags)
    with open(os.path.join(save_dir, "model_flags.txt"), "w") as f:
        f.write(line + "\n")
    return line
