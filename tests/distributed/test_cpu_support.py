"""The CPU runtime: megatron-core's GPTModel at TP = 2 on gloo equals TP = 1, and upstream
changes to what the runtime patches fail loudly."""

import pytest
import torch
import torch.distributed as dist

from megatron_tempnet import compat
from tests.helpers.distributed import run_distributed

VOCAB, SEQ, BATCH = 128, 16, 2


def _gpt_forward_backward():
    assert compat.apply_cpu_support() is True
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(1234)
    assert torch.cuda.current_device() == torch.device("cpu")
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    loss = model(tokens, position_ids, causal, labels=labels)  # [b, s] per-token CE
    loss.mean().backward()

    # The model-parallel RNG differs across TP ranks, the default one does not.
    with get_cuda_rng_tracker().fork():
        in_fork = torch.rand(3)
    outside = torch.rand(3)
    embedding_grad = model.embedding.word_embeddings.weight.grad  # [V/tp, h], sharded
    return {
        "loss": loss.detach(),
        "embedding_grad": gather_from_tensor_model_parallel_region(embedding_grad.t()).t(),
        "norm_grad": model.decoder.final_layernorm.weight.grad.clone(),
        "in_fork": in_fork,
        "outside": outside,
    }


def test_gpt_model_tp2_equals_tp1_forward_and_backward():
    tp1 = run_distributed(_gpt_forward_backward, 1)[0]
    tp2 = run_distributed(_gpt_forward_backward, 2)
    assert float(tp1["loss"].mean()) == pytest.approx(4.9, abs=0.3)  # ~log(128) at init
    for rank, res in enumerate(tp2):
        torch.testing.assert_close(res["loss"], tp1["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            res["embedding_grad"], tp1["embedding_grad"], rtol=1e-4, atol=1e-7
        )
        torch.testing.assert_close(res["norm_grad"], tp1["norm_grad"], rtol=1e-4, atol=1e-7)
        assert float(res["embedding_grad"].abs().sum()) > 0, rank
    assert not torch.equal(tp2[0]["in_fork"], tp2[1]["in_fork"])
    assert torch.equal(tp2[0]["outside"], tp2[1]["outside"])


def test_upstream_symbols_are_checked():
    compat.check_upstream()  # the pinned megatron-core has everything


@pytest.mark.parametrize("symbol", ["_get_cuda_rng_state", "CudaRNGStatesTracker"])
def test_a_missing_upstream_symbol_fails_loudly(monkeypatch, symbol):
    from megatron.core.tensor_parallel import random as mc_random

    monkeypatch.delattr(mc_random, symbol)
    with pytest.raises(compat.UpstreamError, match=f"{symbol} no longer exists"):
        compat.check_upstream()


def test_a_changed_signature_fails_loudly(monkeypatch):
    from megatron.core.tensor_parallel import random as mc_random

    monkeypatch.setattr(mc_random, "_set_cuda_rng_state", lambda state: None)
    with pytest.raises(compat.UpstreamError, match="lost parameter"):
        compat.check_upstream()


def test_an_unpinned_version_fails_loudly(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(compat.UpstreamError, match="0.17.0 is installed"):
        compat.check_upstream()


def test_a_missing_causal_mask_helper_fails_loudly(monkeypatch):
    from megatron.core.fusions import fused_softmax

    monkeypatch.delattr(fused_softmax, "get_default_causal_mask")
    with pytest.raises(compat.UpstreamError, match="get_default_causal_mask no longer"):
        compat.check_upstream()


def _rng_streams_across_runtimes() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_tempnet.checkpoint.rng_state import rng_state, set_rng_state
    from megatron_tempnet.models.transformer import seed_rngs

    compat.apply_cpu_support()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    tracker = get_cuda_rng_tracker()
    seed_rngs(3)
    saved = rng_state()
    with tracker.fork():
        first = torch.rand(4)
    set_rng_state(saved)  # the same runtime: the streams continue exactly
    with tracker.fork():
        again = torch.rand(4)
    seed_rngs(3)
    # a GPU run's file (before the runtime was recorded): Philox seed and offset, 16 bytes
    philox = torch.zeros(16, dtype=torch.uint8)
    gpu_file = {
        "torch": saved["torch"],
        "tracker": dict.fromkeys(saved["tracker"], philox),
        "cuda": philox,
    }
    set_rng_state(gpu_file)
    with tracker.fork():  # set_rng_state refused a CUDA state here before
        fresh = torch.rand(4)
    return {
        "runtime": saved["runtime"],
        "again": torch.equal(first, again),
        "from the seed": torch.equal(first, fresh),
    }


def test_a_gpu_checkpoints_rng_streams_restart_on_cpu():
    """A CPU generator state is no CUDA one: a checkpoint moves between CPU and GPU with its
    dropout streams started again from the seeds (and exactly continued on the same runtime)."""
    (out,) = run_distributed(_rng_streams_across_runtimes, world_size=1)
    assert out == {"runtime": "cpu", "again": True, "from the seed": True}
