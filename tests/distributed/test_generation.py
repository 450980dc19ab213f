"""The generation engine: the KV-cached batched path against the recompute path (today's
algorithm: every prompt alone, the whole sequence every step), for GPT-2 (learned positions,
tied output) and LLaMA (RoPE, grouped-query attention, untied) shapes, at TP = 1 and 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.models.gpt import ModelConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import LLAMA_SHAPE

VOCAB = 97
PROMPTS = [[5, 17, 33], [2, 9, 41, 70, 12, 8, 3, 60, 61, 11, 4], [90], [7, 7, 7, 7, 7, 7], [1, 2]]
NEW = 10

# without the compiled fusions, as load_inference_model builds the model
NO_FUSIONS = dict(bias_dropout_fusion=False, bias_swiglu_fusion=False, bias_gelu_fusion=False)
SHAPES = {
    "gpt2": dict(init_method_std=0.3),
    "llama": dict(LLAMA_SHAPE, init_method_std=0.3),
}


def build(shape: str):
    """A random tiny model and TempNet as an ``InferenceModel`` at this job's TP size."""
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.inference.model import InferenceModel
    from megatron_tempnet.models.gpt import build_gpt_model
    from megatron_tempnet.tempnet import TempNetLM

    apply_cpu_support()
    tp = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = ModelConfig.from_preset(
        "tiny",
        vocab_size=VOCAB,
        max_position_embeddings=48,
        seq_length=48,
        **NO_FUSIONS,
        **SHAPES[shape],
    )
    lm = build_gpt_model(config, tensor_parallel_size=tp, seed=5).eval()
    group = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(11)
    tempnet = TempNetLM(
        VOCAB,
        hidden_size=16,
        proj_size=16,
        tau_min=0.05,
        tau_max=2.0,
        tp_group=group,
        padded_vocab_size=config.padded_vocab_size(tp),
    ).eval()
    return InferenceModel(lm, tempnet, config, {}, group)


def _runs(shape: str):
    from megatron_tempnet.inference.generation import generate
    from megatron_tempnet.inference.token_sampling import SamplingConfig

    model = build(shape)
    greedy = SamplingConfig(greedy=True)
    sampled = SamplingConfig(greedy=False, top_p=0.9, seed=3)
    out = {}
    for name, kw in {
        "cached": dict(micro_batch_size=8),
        "cached alone": dict(micro_batch_size=1),
        "cached pairs": dict(micro_batch_size=2),
        "recompute": dict(micro_batch_size=1, kv_cache=False),
        "recompute batched": dict(micro_batch_size=8, kv_cache=False),
    }.items():
        out[name] = generate(model, PROMPTS, max_new_tokens=NEW, sampling=greedy, **kw)
    for name, kw in {"sampled": {}, "sampled alone": dict(micro_batch_size=1)}.items():
        out[name] = generate(model, PROMPTS, max_new_tokens=NEW, sampling=sampled, **kw)
    out["recompute sampled"] = generate(
        model, PROMPTS, max_new_tokens=NEW, sampling=sampled, kv_cache=False, micro_batch_size=1
    )
    # an end-of-document token that the second prompt's greedy continuation reaches
    eod = out["cached"][1].token_ids[4]
    out["eod"] = (eod, generate(model, PROMPTS, max_new_tokens=NEW, sampling=greedy, eod=eod))
    return out


def _tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def _taus(results) -> torch.Tensor:
    return torch.tensor([r.tau for r in results], dtype=torch.float64)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def runs(request):
    shape = request.param
    return {tp: run_distributed(_runs, world_size=tp, args=(shape,))[0] for tp in (1, 2)}


def test_cached_batches_equal_the_recompute_path_token_for_token(runs):
    reference = runs[1]["recompute"]
    assert all(len(r.token_ids) == NEW for r in reference)
    assert len({tuple(t) for t in _tokens(reference)}) == len(PROMPTS)  # not one degenerate output
    for tp, out in runs.items():
        for name in ("cached", "cached alone", "cached pairs", "recompute", "recompute batched"):
            assert _tokens(out[name]) == _tokens(reference), (tp, name)
            # tau is TempNet's function of each new position's logits: the cached logits are
            # the recomputed ones
            torch.testing.assert_close(_taus(out[name]), _taus(reference), rtol=0, atol=2e-5)


def test_samples_do_not_depend_on_the_batch_the_cache_or_tp(runs):
    sampled = _tokens(runs[1]["sampled"])
    assert sampled != _tokens(runs[1]["cached"])
    for tp, out in runs.items():
        for name in ("sampled", "sampled alone", "recompute sampled"):
            assert _tokens(out[name]) == sampled, (tp, name)


def test_each_sequence_stops_at_its_own_end_of_document(runs):
    for out in runs.values():
        eod, stopped = out["eod"]
        full = _tokens(out["cached"])
        for got, want in zip(stopped, full):
            cut = want.index(eod) + 1 if eod in want else len(want)
            assert got.token_ids == want[:cut]
            assert got.stopped_at_eod == (eod in want)
        assert stopped[1].stopped_at_eod and len(stopped[1].token_ids) <= 5
        assert any(not r.stopped_at_eod for r in stopped)
