"""LLaMA-2-70B and GPT-2 125M at full size, built on PyTorch's ``meta`` device (shapes without
memory) by the project's own builders on real process groups: TP 8 x PP 1 and TP 8 x PP 2 (every
rank builds its stage) for LLaMA-2-70B, TP 2 x PP 2 for GPT-2 125M. Every rank's parameters are
checked against the Hugging Face layout the converter reads (``from_hf`` + ``shard`` on the
Hugging Face model's own shapes), TempNet's for float32, and each rank's parameter count against
the planner (``models/gpt/memory.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.models.gpt import ModelConfig
from megatron_tempnet.models.gpt.memory import Layout, stage_params
from megatron_tempnet.models.recompute import Recompute
from tests.helpers.distributed import run_distributed

TEMPNET = dict(hidden_size=256, proj_size=256)


class _MetaHF:
    """What ``from_hf`` reads from a Hugging Face directory, as meta tensors of its shapes."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes

    def get(self, *names: str) -> torch.Tensor:
        name = next(n for n in names if n in self.shapes)
        return torch.empty(self.shapes[name], device="meta")


def _hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face model's tensor shapes, from its own classes (built on meta)."""
    import transformers

    from megatron_tempnet.inference.hf_weights import hf_config

    config = hf_config(model, torch.bfloat16)
    hf_cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return {name: tuple(t.shape) for name, t in hf.state_dict().items()}


def _our_name(name: str) -> str:
    """A pipeline stage's parameter name -> the one-process model's (``pieces.{i}.…``)."""
    if name.startswith("tied_modules.embedding."):
        return "pieces.0." + name.removeprefix("tied_modules.embedding.")
    return name if name.startswith("pieces.") else "pieces." + name


def _build_stage(model: ModelConfig, tp: int, pp: int, hf_shapes: dict) -> dict:
    """This rank's stage on the meta device: its shape mismatches against the converter's
    layout of the Hugging Face tensors, and its LM / TempNet parameter counts."""
    import deepspeed
    from deepspeed.runtime.pipe.module import PipelineModule

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.distributed.sharding import shard
    from megatron_tempnet.inference.hf_weights import from_hf
    from megatron_tempnet.models.gpt import build_gpt_model
    from megatron_tempnet.models.gpt.objective import LossConfig
    from megatron_tempnet.models.gpt.pipeline import build_pipeline
    from megatron_tempnet.tempnet import TempNetLM

    apply_cpu_support()
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # read by DeepSpeed's PipelineModule
    deepspeed.init_distributed("gloo")  # DeepSpeed's view of the process group (pipeline)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    tp_group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    padded = model.padded_vocab_size(tp)
    tempnet_kwargs = dict(
        vocab_size=model.vocab_size, padded_vocab_size=padded, tp_group=tp_group, **TEMPNET
    )
    with torch.device("meta"):
        if pp == 1:
            lm = build_gpt_model(model, tensor_parallel_size=tp, params_dtype=torch.bfloat16)
            tempnet = TempNetLM(**tempnet_kwargs)
            params = {n: p for n, p in lm.named_parameters()}
            params.update({f"tempnet.{n}": p for n, p in tempnet.named_parameters()})
        else:
            # a meta stage cannot move to the CPU, which PipelineModule does once built
            with mock.patch.object(PipelineModule, "to", lambda self, *a, **k: self):
                stage = build_pipeline(
                    model,
                    LossConfig(),
                    tensor_parallel=tp,
                    pipeline_parallel=pp,
                    dtype=torch.bfloat16,
                    recompute=Recompute(),
                    freeze_lm=False,
                    seed=0,
                    tempnet_kwargs=tempnet_kwargs,
                    tp_group=tp_group,
                )
            params = dict(stage.named_parameters())
    full = from_hf(model, _MetaHF(hf_shapes))
    mismatches, lm_count, tempnet_count = [], 0, 0
    for name, p in params.items():
        assert p.is_meta, name
        if ".tempnet." in name or name.startswith("tempnet."):
            tempnet_count += p.numel()
            assert p.dtype == torch.float32, name  # the float32 island
            continue
        lm_count += p.numel()
        expected = shard(
            _our_name(name),
            full(_our_name(name)),
            rank,
            tp,
            swiglu=model.swiglu,
            padded_vocab=padded,
        ).shape
        if tuple(p.shape) != tuple(expected):
            mismatches.append((name, tuple(p.shape), tuple(expected)))
    stage_index = parallel_state.get_pipeline_model_parallel_rank()
    return {
        "stage": stage_index,
        "tp_rank": rank,
        "lm": lm_count,
        "tempnet": tempnet_count,
        "tensors": len(params),
        "mismatches": mismatches,
    }


def _check(model: ModelConfig, tp: int, pp: int) -> list[dict]:
    ranks = run_distributed(
        _build_stage, tp * pp, args=(model, tp, pp, _hf_shapes(model)), timeout=300
    )
    planned = stage_params(
        model,
        Layout(
            tensor_parallel=tp,
            pipeline_parallel=pp,
            tempnet_hidden_size=TEMPNET["hidden_size"],
            tempnet_proj_size=TEMPNET["proj_size"],
        ),
    )
    assert sorted((r["stage"], r["tp_rank"]) for r in ranks) == [
        (s, t) for s in range(pp) for t in range(tp)
    ]
    for r in ranks:
        assert r["tensors"] > 0 and r["mismatches"] == [], r["mismatches"][:5]
        assert r["lm"] == planned[r["stage"]].lm, (r["stage"], r["lm"], planned[r["stage"]].lm)
        if r["tp_rank"] == 0:  # the fullest TP rank holds TempNet's planned W1 columns
            assert r["tempnet"] == planned[r["stage"]].tempnet
    return ranks


LLAMA2_70B = ModelConfig.from_preset("llama2-70b")


@pytest.mark.parametrize("pp", [1, 2])
def test_llama2_70b_stages_at_tp8(pp):
    ranks = _check(LLAMA2_70B, 8, pp)
    last = [r for r in ranks if r["stage"] == pp - 1]
    assert all(r["tempnet"] > 0 for r in last)
    assert all(r["tempnet"] == 0 for r in ranks if r["stage"] != pp - 1)
    # the whole model on one GPU (32000 tokens need no padding at TP 1): LLaMA-2-70B's 68.98 B
    hf_total = sum(math.prod(shape) for shape in _hf_shapes(LLAMA2_70B).values())
    assert hf_total == 68_976_648_192
    (whole,) = stage_params(LLAMA2_70B, Layout())
    assert whole.lm == hf_total


def test_gpt2_125m_stages_at_tp2_pp2():
    model = ModelConfig.from_preset("gpt2-125m", vocab_size=50257)
    ranks = _check(model, 2, 2)
    stages = {s: sum(r["lm"] for r in ranks if r["stage"] == s) for s in (0, 1)}
    embedding = 50432 * 768  # padded vocabulary x hidden, split over the TP ranks
    assert stages[0] > embedding and stages[1] > embedding  # the tied copy on the last stage


def test_a_wrong_shape_is_caught():
    """A model whose builder and converter disagree (the MLP 1 column wider than the Hugging
    Face layout) fails the check."""
    model = ModelConfig.from_preset("gpt2-125m", vocab_size=50257)
    wrong = dataclasses.replace(model, ffn_hidden_size=3072 + 2)
    shapes = _hf_shapes(model)
    (rank,) = run_distributed(_build_stage, 1, args=(wrong, 1, 1, shapes))
    assert {m[0].split(".")[-2] for m in rank["mismatches"]} == {"linear_fc1", "linear_fc2"}
    assert len(rank["mismatches"]) == 12 * 3  # fc1 weight and bias, fc2 weight, 12 layers
