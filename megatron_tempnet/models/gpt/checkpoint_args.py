"""--use-checkpoint-args: the model's architecture from the checkpoint in --load (Megatron-LM's
meaning), read from the run config saved with every checkpoint.

Megatron-LM's rule, in this project's fields (``config.SHAPE`` and ``config.STRUCTURE``):

- ``SHAPE``: the sizes (layers, hidden size, MLP size, attention heads, sequence length, position
  range). The checkpoint's values fill the flags the command line does not give; a given flag
  stands (a longer --seq-length for a finetune, say).
- ``STRUCTURE``: what makes the weights fit at all (query groups, positions and RoPE, norm and
  its epsilon, biases, activation, tied embeddings, the vocabulary and its padding). Always the
  checkpoint's.

The config is the checkpoint's own (its ``train_state.json``), taken from the newest complete
checkpoint that ``latest`` names; a Megatron-LM checkpoint's is its saved ``args``
(``megatron_lm.model_fields``). Without a checkpoint in --load the command line's
architecture is used and a line says so (Megatron-LM's rule), unless
--exit-on-missing-checkpoint makes it an error.
"""

from __future__ import annotations

import dataclasses
import os

from megatron_tempnet.checkpoint.checkpoint_format import (
    CheckpointError,
    is_complete,
    latest_tag,
    read_train_state,
)
from megatron_tempnet.models.gpt.config import SHAPE, STRUCTURE, ModelConfig


def saved_run_config(load_dir: str) -> tuple[str, dict] | None:
    """(tag, run config) of the newest checkpoint in ``load_dir``; None when it holds none."""
    tag = latest_tag(load_dir) if os.path.isdir(load_dir) else None
    if tag is None and os.path.isdir(load_dir):
        return _megatron_lm_config(load_dir)
    if tag is None:
        return None
    directory = os.path.join(load_dir, tag)
    if not is_complete(directory):
        raise CheckpointError(f"--load {load_dir}: {tag}, which 'latest' names, is incomplete")
    config = read_train_state(directory, f"--load {load_dir}").get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(
            f"--load {load_dir}: {tag} carries no model config: --use-checkpoint-args cannot read "
            "its architecture; give the architecture flags instead"
        )
    return tag, config


def _megatron_lm_config(load_dir: str) -> tuple[str, dict] | None:
    """A Megatron-LM checkpoint's model, from the args it saved (None: not one)."""
    from megatron_tempnet.models.gpt import megatron_lm

    source = f"--load {load_dir}"
    located = megatron_lm.locate(load_dir, source)
    if located is None:
        return None
    fields = megatron_lm.model_fields(megatron_lm.saved_args(located, source), source)
    return os.path.relpath(located.directory, load_dir), {"model": fields}


def model_args_from_checkpoint(
    load_dir: str, given: dict, *, require: bool = False
) -> tuple[dict, list[str]]:
    """The model's field values for --use-checkpoint-args and the start-up lines saying where
    they come from.

    ``given``: the command line's ``ModelConfig`` values by field name, None for a flag not
    given (``flags.flag_values``). Returns ``given`` with the checkpoint's ``SHAPE`` values
    where it has None and its ``STRUCTURE`` values everywhere (fields the saved config lacks are
    left as given). ``require`` (--exit-on-missing-checkpoint): no checkpoint is an error.
    """
    saved = saved_run_config(load_dir)
    if saved is None:
        if require:
            raise CheckpointError(
                f"--load {load_dir}: no checkpoint there (no 'latest') to read the architecture "
                "from, and --exit-on-missing-checkpoint stops the run"
            )
        return dict(given), [
            f"--use-checkpoint-args: no checkpoint in --load {load_dir}: the architecture is "
            "the command line's"
        ]
    tag, config = saved
    model = config["model"]
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    out, lines = dict(given), []
    for name in (*SHAPE, *STRUCTURE):
        if name not in model or name not in known:
            continue
        if name in SHAPE and given.get(name) is not None:
            if given[name] != model[name]:
                lines.append(
                    f"{_flag(name)} {given[name]}: the command line's (checkpoint: {model[name]})"
                )
            continue
        out[name] = model[name]
    lines.insert(0, f"--use-checkpoint-args: the architecture of {os.path.join(load_dir, tag)}")
    return out, lines


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
