"""GPT-2 and LLaMA models from megatron-core specs: presets, flag checks, TP = 2 equals TP = 1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_tempnet.models import PRESETS, ModelConfig, ModelConfigError
from tests.helpers.distributed import run_distributed

SEQ, BATCH = 16, 2


def _llama_tiny(**kw) -> ModelConfig:
    return ModelConfig.from_preset(
        "tiny", normalization="RMSNorm", swiglu=True, untie_embeddings_and_output_weights=True,
        position_embedding_type="rope", add_bias_linear=False, num_query_groups=2, **kw,
    )  # fmt: skip


def _forward_backward(model_cfg: ModelConfig):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        model_parallel_cuda_manual_seed,
    )

    from megatron_tempnet.distributed import apply_cpu_support
    from megatron_tempnet.models import build_gpt_model

    apply_cpu_support()
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    model = build_gpt_model(model_cfg, tensor_parallel_size=tp)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    logits = model(tokens, position_ids, None)  # [b, s, V_pad / tp]; default causal mask
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    with torch.no_grad():
        assert torch.equal(model(tokens, position_ids, causal), logits)
    # sum over the shard / full size: the ranks' parts add up to the TP = 1 loss
    ((logits.float() ** 2).sum() / (logits.numel() * tp)).backward()
    full = gather_from_tensor_model_parallel_region(logits.detach())
    n_params = sum(p.numel() for p in model.parameters())
    dist.all_reduce(t := torch.tensor([n_params]))
    return {
        "logits": full,
        "norm_grad": model.decoder.final_layernorm.weight.grad.clone(),
        "params": int(t),
        "shard": tuple(logits.shape),
    }


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
    assert set(PRESETS) == {"tiny", "gpt2-125m", "llama2-7b", "llama2-13b", "llama2-70b"}
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
