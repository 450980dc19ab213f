"""--use-checkpoint-args: the architecture saved with the newest checkpoint of --load, as
Megatron-LM applies it (sizes fill the flags not given, the structure always comes from the
checkpoint), read from the checkpoint's ``train_state.json``."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.models.gpt.checkpoint_args import model_args_from_checkpoint
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.utils.flags import flag_name

SAVED = ModelConfig.from_preset(
    "llama2-7b",
    num_layers=3,
    hidden_size=96,
    num_attention_heads=6,
    num_query_groups=2,
    ffn_hidden_size=160,
    seq_length=64,
    max_position_embeddings=128,
    vocab_size=500,
)


def _write_train_state(directory: str, config: dict | None) -> None:
    state = {"format": 2, "iteration": 4} | ({"config": config} if config is not None else {})
    with open(os.path.join(directory, "train_state.json"), "w") as f:
        json.dump(state, f)


def _checkpoint(load_dir, tag: str = "iter_0000004") -> str:
    directory = os.path.join(load_dir, tag)
    os.makedirs(directory)
    config = {"model": dataclasses.asdict(SAVED), "training": {"train_iters": 9}}
    _write_train_state(directory, config)
    open(os.path.join(directory, "COMPLETE"), "w").close()
    with open(os.path.join(load_dir, "latest"), "w") as f:
        f.write(tag)
    return directory


def _given(**values) -> dict:
    """A command line's ModelConfig values (None: not given), as ``flags.flag_values`` gives."""
    fields = [f.name for f in dataclasses.fields(ModelConfig) if flag_name(f) is not None]
    return {name: values.get(name) for name in fields}


def test_the_checkpoint_gives_the_architecture(tmp_path):
    directory = _checkpoint(str(tmp_path))
    # a command line of GPT-2's structure, with its own sequence length and layer count
    given = _given(
        seq_length=256,
        num_layers=3,
        normalization="LayerNorm",
        swiglu=False,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
    )
    values, lines = model_args_from_checkpoint(str(tmp_path), given)
    model = ModelConfig(**{k: v for k, v in values.items() if v is not None})
    expected = dataclasses.replace(SAVED, seq_length=256)  # the given size stands
    for name in ("attention_backend", "init_method_std", "hidden_dropout", "attention_dropout"):
        setattr(expected, name, getattr(model, name))  # not architecture: the command line's
    assert model == expected
    assert (model.normalization, model.swiglu, model.add_bias_linear) == ("RMSNorm", True, False)
    assert (model.vocab_size, model.num_query_groups, model.hidden_size) == (500, 2, 96)
    assert lines == [
        f"--use-checkpoint-args: the architecture of {directory}",
        "--seq-length 256: the command line's (checkpoint: 64)",
    ]


def test_no_checkpoint_keeps_the_command_line_unless_told_to_stop(tmp_path):
    given = _given(num_layers=5)
    values, lines = model_args_from_checkpoint(str(tmp_path), given)
    assert values == given
    assert lines == [
        f"--use-checkpoint-args: no checkpoint in --load {tmp_path}: the architecture is the "
        "command line's"
    ]
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint stops the run"):
        model_args_from_checkpoint(str(tmp_path), given, require=True)


def test_a_checkpoint_without_a_config_is_an_error(tmp_path):
    directory = _checkpoint(str(tmp_path))
    _write_train_state(directory, None)
    with pytest.raises(CheckpointError) as e:
        model_args_from_checkpoint(str(tmp_path), _given())
    assert "carries no model config: --use-checkpoint-args cannot read its architecture" in str(
        e.value
    )
    os.remove(os.path.join(directory, "COMPLETE"))
    with pytest.raises(CheckpointError, match="iter_0000004, which 'latest' names, is incomplete"):
        model_args_from_checkpoint(str(tmp_path), _given())
