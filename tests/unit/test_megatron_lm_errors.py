"""What a Megatron-LM checkpoint directory holds and the model its saved args describe: a model
this project does not build, a damaged or foreign directory and model flags that differ from the
checkpoint's each stop with one error naming the setting (no Megatron-LM needed: the args are
an ``argparse.Namespace`` as Megatron-LM saves it)."""

from __future__ import annotations

import argparse
import json
import os
import re

import pytest
import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.models.gpt import ModelConfig
from megatron_tempnet.models.gpt.megatron_lm import check_same_model, locate, model_fields
from tests.helpers.shapes import LLAMA_SHAPE

SOURCE = "--load M"


def _args(**changes) -> argparse.Namespace:
    from tests.helpers.megatron_lm import megatron_args

    model = ModelConfig.from_preset("tiny", **LLAMA_SHAPE, vocab_size=101)
    args = megatron_args(model, tp=1, pp=1, vocab_size=100)
    vars(args).update(changes)
    return args


def test_the_args_give_the_model():
    fields = model_fields(_args(rotary_base=500000, norm_epsilon=1e-6), SOURCE)
    model = ModelConfig(**fields, vocab_size=101)
    assert (model.rotary_base, model.norm_epsilon, model.num_query_groups) == (500000, 1e-6, 2)
    assert model.swiglu and model.normalization == "RMSNorm" and not model.add_bias_linear
    assert "num_query_groups" not in model_fields(_args(group_query_attention=False), SOURCE)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(num_experts=8), "mixture of experts (--num-experts) (num_experts = 8)"),
        (dict(multi_latent_attention=True), "multi-latent attention"),
        (dict(qk_layernorm=True), "QK layer norm (--qk-layernorm)"),
        (dict(spec=["my.module", "spec"]), "a custom layer spec (--spec)"),
        (dict(rotary_percent=0.5), "partial RoPE (--rotary-percent)"),
        (dict(add_qkv_bias=True, add_bias_linear=False), "a bias on q/k/v only"),
        (dict(kv_channels=32), "head size (--kv-channels 32)"),
        (dict(position_embedding_type="mrope"), "position embedding 'mrope'"),
        (dict(transformer_impl="inference_optimized"), "--transformer-impl 'inference_optimized'"),
    ],
)
def test_a_model_not_built_here_is_refused_by_name(change, named):
    with pytest.raises(CheckpointError) as e:
        model_fields(_args(**change), SOURCE)
    assert str(e.value).startswith(f"{SOURCE}: ") and named in str(e.value)


def test_model_flags_that_differ_from_the_checkpoints_stop_the_run():
    saved = ModelConfig(**model_fields(_args(rotary_base=500000), SOURCE), vocab_size=101)
    check_same_model(saved, saved, SOURCE)
    run = ModelConfig.from_preset("tiny", **LLAMA_SHAPE, vocab_size=101)
    with pytest.raises(CheckpointError, match=r"--rotary-base 500000, this run 10000: give "
                       r"--rotary-base 500000, or --use-checkpoint-args"):  # fmt: skip
        check_same_model(saved, run, SOURCE)


def test_directories_that_are_not_readable_checkpoints(tmp_path):
    assert locate(str(tmp_path), SOURCE) is None  # nothing of Megatron-LM's: not one
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("latest\n")
    with pytest.raises(CheckpointError, match="holds 'latest', not an iteration"):
        locate(str(tmp_path), SOURCE)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40\n")
    with pytest.raises(CheckpointError, match="names iter_0000040, which is not there"):
        locate(str(tmp_path), SOURCE)
    os.makedirs(tmp_path / "iter_0000040")
    with pytest.raises(CheckpointError, match="holds neither a torch_dist checkpoint"):
        locate(str(tmp_path), SOURCE)
    meta = {"sharded_backend": "zarr", "sharded_backend_version": 1}
    (tmp_path / "iter_0000040" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="sharded backend 'zarr'"):
        locate(str(tmp_path), SOURCE)
    (tmp_path / "iter_0000040" / "metadata.json").unlink()
    os.makedirs(tmp_path / "iter_0000040" / "mp_rank_00")
    found = locate(str(tmp_path), SOURCE)
    assert (found.format, found.iteration) == ("torch", "40")


def test_a_legacy_file_that_would_run_code_runs_none(tmp_path):
    """Megatron-LM's files are pickles: their args load, anything that would call code becomes
    an inert placeholder."""
    from megatron_tempnet.checkpoint.file_io import Opaque, load_foreign_file

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": _args(), "model": {"w": torch.ones(2)}, "x": Planted()}, path)
    loaded = load_foreign_file(str(path))
    assert isinstance(loaded["x"], Opaque) and not (tmp_path / "ran").exists()
    assert loaded["args"].num_layers == 2 and torch.equal(loaded["model"]["w"], torch.ones(2))


def test_megatron_deepspeeds_args_give_the_same_model():
    """Megatron-DeepSpeed saves the model under its own names (--layernorm-epsilon,
    --num-key-value-heads, --use-rotary-position-embeddings, --rotary-position-embeddings-theta,
    lower-case norms, experts per layer group)."""
    from tests.helpers.megatron_lm import deepspeed_args

    model = ModelConfig.from_preset("tiny", **LLAMA_SHAPE, vocab_size=101, rotary_base=500000)
    ds = deepspeed_args(model, tp=1, pp=1, vocab_size=100)
    assert not hasattr(ds, "num_query_groups") and ds.normalization == "rmsnorm"
    assert ModelConfig(**model_fields(ds, SOURCE), vocab_size=101) == model
    for change, named in [
        (dict(add_position_embedding=True), "adds learned positions to RoPE"),
        (dict(apply_residual_connection_post_layernorm=True), "the residual taken after the norm"),
        (dict(num_experts=[1, 8]), "mixture of experts (--num-experts) (num_experts = 8)"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(named)):
            model_fields(argparse.Namespace(**{**vars(ds), **change}), SOURCE)


def test_a_megatron_deepspeed_save_directory_is_found_by_deepspeeds_latest(tmp_path):
    from megatron_tempnet.checkpoint.checkpoint_format import latest_tag

    (tmp_path / "latest").write_text("global_step40")
    with pytest.raises(CheckpointError, match="names global_step40, which holds no mp_rank_XX"):
        locate(str(tmp_path), SOURCE)
    os.makedirs(tmp_path / "global_step40")
    (tmp_path / "global_step40" / "mp_rank_00_model_states.pt").write_bytes(b"")
    found = locate(str(tmp_path), SOURCE)
    assert (found.format, found.iteration) == ("deepspeed", "40")
    assert latest_tag(str(tmp_path)) is None  # not a checkpoint of this project
