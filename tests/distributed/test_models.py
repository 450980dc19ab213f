"""GPT-2 and LLaMA models from megatron-core layers: presets, flag checks, the same function as
megatron-core's own GPTModel (LLaMA-3.1's RoPE scaling included), TP = 2 equals TP = 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.models.gpt import PRESETS, ModelConfig, ModelConfigError
from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import LLAMA_SHAPE

SEQ, BATCH = 16, 2


def _llama_tiny(**kw) -> ModelConfig:
    return ModelConfig.from_preset("tiny", **LLAMA_SHAPE, **kw)


def _forward_backward(model_cfg: ModelConfig):
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
    )

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import build_gpt_model

    apply_cpu_support()
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = build_gpt_model(model_cfg, tensor_parallel_size=tp, seed=3)
    tokens, position_ids = _inputs(model_cfg)
    logits = model(tokens, position_ids)  # [b, s, V_pad / tp]; causal attention
    # sum over the shard / full size: the ranks' parts add up to the TP = 1 loss
    ((logits.float() ** 2).sum() / (logits.numel() * tp)).backward()
    full = gather_from_tensor_model_parallel_region(logits.detach())
    n_params = sum(p.numel() for p in model.parameters())
    dist.all_reduce(t := torch.tensor([n_params]))
    return {
        "logits": full,
        "norm_grad": model.final_norm.norm.weight.grad.clone(),
        "params": int(t),
        "shard": tuple(logits.shape),
    }


def _inputs(model_cfg: ModelConfig):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ)[None].expand(BATCH, SEQ)


def _against_megatron_gpt_model(model_cfg: ModelConfig):
    """Our pieces with megatron-core GPTModel's weights give GPTModel's logits."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import build_gpt_model, transformer_config

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    reference = GPTModel(
        config=transformer_config(model_cfg),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=model_cfg.normalization),
        vocab_size=model_cfg.padded_vocab_size(1),
        max_sequence_length=model_cfg.max_position_embeddings,
        share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
        position_embedding_type=model_cfg.position_embedding_type,
        rotary_base=model_cfg.rotary_base,
        rope_scaling=model_cfg.use_rope_scaling,
        rope_scaling_factor=model_cfg.rope_scaling_factor,
    )
    ours = build_gpt_model(model_cfg, seed=1)
    n = model_cfg.num_layers
    renames = {
        "embedding.word_embeddings.": "pieces.0.word_embeddings.",
        "embedding.position_embeddings.": "pieces.1.position_embeddings.",
        "decoder.final_layernorm.": f"pieces.{n + 2}.norm.",
        "output_layer.": f"pieces.{n + 3}.output_layer.",
    }
    renames.update({f"decoder.layers.{i}.": f"pieces.{i + 2}.layer." for i in range(n)})
    state = {}
    for key, value in reference.state_dict().items():
        if "_extra_state" in key:
            continue
        prefix = next(p for p in renames if key.startswith(p))
        state[renames[prefix] + key[len(prefix) :]] = value
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)
    tokens, position_ids = _inputs(model_cfg)
    with torch.no_grad():
        return reference(tokens, position_ids, None), ours(tokens, position_ids)


# megatron-core's LLaMA-3.1 scaling takes the factor only (low/high frequency factors 1 and 4,
# original context 8192 fixed): at those values ours must compute the same. Base 500000 and
# head_dim 16 put frequencies in all three of its bands (kept, blended, divided by 8).
_LLAMA31 = dict(rotary_base=500000, use_rope_scaling=True, rope_scaling_factor=8.0)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "llama3.1"])
def test_the_pieces_compute_megatron_cores_gpt_model(arch):
    cfg = (
        ModelConfig.from_preset("tiny", vocab_size=200)
        if arch == "gpt2"
        else _llama_tiny(vocab_size=200, **(_LLAMA31 if arch == "llama3.1" else {}))
    )
    cfg.max_position_embeddings = cfg.seq_length = SEQ
    expected, got = run_distributed(_against_megatron_gpt_model, 1, args=(cfg,))[0]
    assert got.shape == expected.shape == (BATCH, SEQ, 256)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_tp2_equals_tp1(arch):
    cfg = (
        ModelConfig.from_preset("tiny", vocab_size=200)
        if arch == "gpt2"
        else _llama_tiny(vocab_size=200)
    )
    cfg.max_position_embeddings = cfg.seq_length = SEQ
    tp1 = run_distributed(_forward_backward, 1, args=(cfg,))[0]
    tp2 = run_distributed(_forward_backward, 2, args=(cfg,))
    assert tp1["shard"] == (BATCH, SEQ, 256)  # 200 padded to a multiple of 128 x TP
    for res in tp2:
        assert res["shard"] == (BATCH, SEQ, 128)
        torch.testing.assert_close(res["logits"], tp1["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["norm_grad"], tp1["norm_grad"], rtol=1e-4, atol=1e-6)


def test_presets_and_flag_checks():
    llama70 = ModelConfig.from_preset("llama2-70b")
    assert (llama70.num_layers, llama70.hidden_size, llama70.num_attention_heads) == (80, 8192, 64)
    assert (llama70.num_query_groups, llama70.ffn_hidden_size, llama70.vocab_size) == (
        8,
        28672,
        32000,
    )
    assert (
        llama70.normalization == "RMSNorm"
        and llama70.swiglu
        and llama70.position_embedding_type == "rope"
    )
    assert llama70.untie_embeddings_and_output_weights and not llama70.add_bias_linear
    llama70.validate(tensor_parallel_size=8)
    gpt2 = ModelConfig.from_preset("gpt2-125m", vocab_size=50257)
    assert gpt2.padded_vocab_size(1) == 50304 and gpt2.padded_vocab_size(8) == 51200
    assert not gpt2.untie_embeddings_and_output_weights and gpt2.normalization == "LayerNorm"
    assert ModelConfig.from_preset("gpt2-125m", num_layers=3).num_layers == 3  # flags win
    assert set(PRESETS) == {
        "tiny",
        "gpt2-125m",
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "llama3-8b",
        "llama3-70b",
        "llama3.1-8b",
        "llama3.1-70b",
        "llama3.1-405b",
        "llama3.2-1b",
        "llama3.2-3b",
        "mistral-7b",
    }
    with pytest.raises(ModelConfigError, match=r"--num-query-groups \(8\) must be divisible by"):
        llama70.validate(tensor_parallel_size=16)
    with pytest.raises(
        ModelConfigError, match=r"--num-attention-heads \(12\) must be divisible by"
    ):
        gpt2.validate(tensor_parallel_size=8)
    with pytest.raises(ModelConfigError, match="--model 'gpt5'"):
        ModelConfig.from_preset("gpt5")
    with pytest.raises(ModelConfigError, match=r"--seq-length \(256\) exceeds"):
        ModelConfig.from_preset("tiny", seq_length=256).validate()


def _shape(m: ModelConfig) -> tuple:
    return (
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.num_query_groups,
        m.ffn_hidden_size,
        m.vocab_size,
        m.rotary_base,
        m.max_position_embeddings,
    )


def test_llama3_and_mistral_presets():
    """The Hub's config.json numbers (tests/e2e/test_hf_interop.py imports those configs)."""
    shapes = {
        "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 500000, 8192),
        "llama3.1-70b": (80, 8192, 64, 8, 28672, 128256, 500000, 131072),
        "llama3.1-405b": (126, 16384, 128, 8, 53248, 128256, 500000, 131072),
        "llama3.2-3b": (28, 3072, 24, 8, 8192, 128256, 500000, 131072),
        "mistral-7b": (32, 4096, 32, 8, 14336, 32768, 1000000, 32768),
    }
    assert {name: _shape(ModelConfig.from_preset(name)) for name in shapes} == shapes
    for name, factor, tied in [("llama3.1-8b", 8.0, False), ("llama3.2-1b", 32.0, True)]:
        m = ModelConfig.from_preset(name)
        scaling = m.rope().scaling
        assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor) == (factor, 1, 4)
        assert scaling.original_max_position_embeddings == 8192 and m.seq_length == 8192
        assert m.untie_embeddings_and_output_weights is not tied
    assert ModelConfig.from_preset("llama3-70b").rope().scaling is None
    assert ModelConfig.from_preset("mistral-7b").hf_model_type == "mistral"
    llama3 = ModelConfig.from_preset("llama3.1-8b")
    # 128256 = 2^8 x 501: no padding at TP 1 and 2, 256 padded rows at TP 4, 768 at TP 8
    assert [llama3.padded_vocab_size(tp) for tp in (1, 2, 4, 8)] == [128256, 128256, 128512, 129024]
    for name in PRESETS:
        if name.startswith(("llama", "mistral")):
            ModelConfig.from_preset(name).validate(tensor_parallel_size=8)


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(rope_scaling_low_freq_factor=4.0), r"--rope-scaling-low-freq-factor \(4.0\) must"),
        (dict(rope_scaling_factor=0.5), r"--rope-scaling-factor \(0.5\) must be >= 1"),
        (dict(rope_scaling_original_max_position_embeddings=0), r"embeddings \(0\) must be >= 1"),
        (dict(position_embedding_type="learned_absolute"), "--use-rope-scaling needs"),
    ],
)
def test_rope_scaling_flag_checks(flags, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_preset("llama3.1-8b", **flags).validate()


def test_model_flags_rebuild_a_scaled_rope_model():
    """A conversion's model_flags.txt, parsed by pretrain_gpt.py, gives the same model."""
    from megatron_tempnet.models.gpt import model_flags
    from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args

    model = ModelConfig.from_preset(
        "llama3.2-1b",
        rope_scaling_factor=16.0,
        rope_scaling_low_freq_factor=0.5,
        rope_scaling_high_freq_factor=3.0,
        rope_scaling_original_max_position_embeddings=24,
    )
    required = [
        "--data-path",
        "d",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--train-iters",
        "1",
        "--lr",
        "1e-4",
        "--seq-length",
        str(model.seq_length),
    ]
    # no --model: the flags alone build the model (Megatron-LM's defaults for the rest)
    rebuilt = config_from_args(build_parser().parse_args(model_flags(model) + required)).model
    rebuilt.vocab_size = model.vocab_size
    assert rebuilt == model
    assert rebuilt.rope() == model.rope() and _shape(rebuilt) == _shape(model)
    assert rebuilt.rope().scaling.factor == 16.0
    assert not rebuilt.untie_embeddings_and_output_weights
