"""tools/estimate_memory.py: model states against DeepSpeed's own estimators, parameter counts
against the built model, and the total against the peak tensor memory of a real training step
measured on CPU (TP = 1 and 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from megatron.core import parallel_state

from megatron_tempnet.models.gpt import ModelConfig
from megatron_tempnet.models.gpt.memory import (
    Layout,
    estimate,
    largest,
    model_state_bytes,
    stage_params,
)
from megatron_tempnet.models.recompute import Recompute
from tests.helpers.distributed import run_distributed
from tests.helpers.entry_points import run_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("preset,vocab", [("gpt2-125m", 50257), ("llama2-7b", 32000)])
@pytest.mark.parametrize("dp", [1, 4, 64])
def test_model_states_match_deepspeeds_estimators(preset, vocab, dp):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = ModelConfig.from_preset(preset, vocab_size=vocab)
    p = stage_params(model, Layout())[0]
    total = p.lm + p.tempnet
    for zero in (2, 3):
        layout = Layout(data_parallel=dp, zero_stage=zero, precision="bf16")
        ours = sum(model_state_bytes(total, 0, p.largest_layer, layout).values())
        if zero == 2:
            _, theirs = estimate_zero2_model_states_mem_needs(
                total, num_gpus_per_node=dp, cpu_offload=False
            )
        else:
            _, theirs, _ = estimate_zero3_model_states_mem_needs(
                total, p.largest_layer, num_gpus_per_node=dp, cpu_offload=False
            )
        assert ours == pytest.approx(theirs, rel=0.05), (zero, ours, theirs)


def _measure(tp: int, seq: int, mbs: int, vocab: int, recompute, llama: bool, fused: bool):
    """One training step of model + TempNet + DRO loss after a warm-up step; the peak of live
    tensor bytes (parameters, gradients, optimizer states, activations) from megatron-core's
    pieces through torch's MemTracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from torch.distributed._tools.mem_tracker import MemTracker

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import build_gpt_model
    from megatron_tempnet.models.gpt.objective import LossConfig, TrainModule
    from megatron_tempnet.tempnet import TempNetLM

    apply_cpu_support()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = _config(seq, vocab, llama)
    lm = build_gpt_model(cfg, tensor_parallel_size=tp, recompute=recompute)
    group = parallel_state.get_tensor_model_parallel_group()
    tempnet = TempNetLM(vocab, padded_vocab_size=cfg.padded_vocab_size(tp), tp_group=group)
    loss = LossConfig(rho=10.0, fused_output_stage=fused, output_stage_chunk_size=CHUNK)
    module = TrainModule(lm, tempnet, loss, vocab, freeze_lm=False, tp_group=group)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
    positions = torch.arange(seq)[None].expand(mbs, seq)

    def step():
        module(tokens[:, :-1], positions, tokens[:, 1:]).loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer states exist from here on, as in every later step
    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {
        "peak": peak,
        "lm": sum(p.numel() for p in lm.parameters()),
        "tempnet": sum(p.numel() for p in tempnet.parameters()),
    }


def _config(seq: int, vocab: int, llama: bool) -> ModelConfig:
    shape = (
        {
            "normalization": "RMSNorm",
            "swiglu": True,
            "add_bias_linear": False,
            "untie_embeddings_and_output_weights": True,
            "position_embedding_type": "rope",
            "num_query_groups": 2,
        }
        if llama
        else {}
    )
    return ModelConfig.from_preset(
        "tiny", vocab_size=vocab, seq_length=seq, max_position_embeddings=seq, **shape
    )


CHUNK = 256  # tokens: the fused output stage in 4 chunks


NO_RECOMPUTE = Recompute()


@pytest.mark.parametrize(
    "tp,recompute,llama,fused",
    [
        (1, NO_RECOMPUTE, False, True),
        (2, NO_RECOMPUTE, False, True),
        (1, Recompute("full", "uniform", 1), False, True),
        (2, NO_RECOMPUTE, True, True),
        (1, NO_RECOMPUTE, False, False),
        (1, Recompute("full", "uniform", 2), False, True),
        (1, Recompute("full", "block", 1), False, True),
        (2, Recompute("selective"), True, True),
    ],
    ids=[
        "tp1",
        "tp2",
        "tp1-recompute",
        "tp2-llama",
        "tp1-unfused-output-stage",
        "tp1-uniform-2",
        "tp1-block-1",
        "tp2-llama-selective",
    ],
)
def test_total_is_within_20_percent_of_the_measured_peak(tp, recompute, llama, fused):
    seq, mbs, vocab = 256, 4, 4096  # activations, logits and the loss's buffers dominate
    args = (tp, seq, mbs, vocab, recompute, llama, fused)
    results = run_distributed(_measure, world_size=tp, args=args, timeout=300)
    cfg = _config(seq, vocab, llama)
    layout = Layout(
        tensor_parallel=tp,
        micro_batch_size=mbs,
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
        fused_output_stage=fused,
        output_stage_chunk_size=CHUNK,
    )
    planned = largest(estimate(cfg, layout))
    for rank, got in enumerate(results):
        assert (planned.params.lm, planned.params.tempnet) == (got["lm"], got["tempnet"]), rank
        assert planned.total == pytest.approx(got["peak"], rel=0.2), (rank, planned.parts, got)


def _tool(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(REPO, "tools", "estimate_memory.py"), *args]
    return run_command(cmd, timeout=120)


def test_the_70b_recipe_and_flag_errors():
    recipe = [
        "--model",
        "llama2-70b",
        "--tp",
        "8",
        "--pp",
        "2",
        "--dp",
        "4",
        "--zero",
        "1",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "16",
        "--seq-length",
        "4096",
        "--bf16",
    ]
    frozen = _tool(*recipe, "--freeze-lm")
    assert frozen.returncode == 0, frozen.stderr
    assert "parameters: LM 68.98 B, TempNet 8.26 M" in frozen.stdout
    assert "of 80 GiB: fits" in frozen.stdout
    # --frozen-lm-cache: hidden 8192 in bf16 per token; a reading pass costs the output layer
    # forward over the vocabulary padded to 32768 at TP 8 and TempNet's W1 (256 x 32000) and W2
    # (256 x 256) forward and backward, against the frozen LLaMA-2-70B's forward pass: 80 layers
    # of QKV (8192 x (64 + 2 x 8) x 128), output projection (8192^2) and SwiGLU MLP
    # (3 x 8192 x 28672), causal attention 80 x 4096 x 8192, the output layer, and TempNet
    cache = _tool(*recipe, "--freeze-lm", "--sequence-parallel", "--frozen-lm-cache",
                  "--cache-tokens", "1e8")  # fmt: skip
    stage = 2 * 8192 * 32768 + 6 * (256 * 32000 + 256 * 256)
    layer = 8192 * 80 * 128 + 8192**2 + 3 * 8192 * 28672
    whole = 2 * (80 * layer + 80 * 4096 * 8192 + 8192 * 32768) + 6 * (256 * 32000 + 256 * 256)
    assert cache.returncode == 0, cache.stderr
    assert "--frozen-lm-cache: 16.4 kB per token stored (hidden 8192 x 2 B)" in cache.stdout
    assert f"{stage / whole:.2%} of the FLOPs" in cache.stdout and stage / whole < 0.0042
    assert "1e+08 tokens: 1638.4 GB on disk" in cache.stdout  # 1e8 x 16384 B
    whole_states = _tool(*recipe, "--freeze-lm", "--frozen-lm-cache")  # each TP rank: all of it
    assert "131.1 kB per token stored (hidden 8192 x 2 B x TP 8" in whole_states.stdout
    refused = _tool(*recipe, "--frozen-lm-cache")
    assert refused.returncode == 1 and "add --freeze-lm" in refused.stderr
    full = _tool(*recipe)  # the fused attention keeps no [b, heads, s, s] softmax
    assert full.returncode == 0 and "of 80 GiB: fits" in full.stdout
    unfused = _tool(*recipe, "--attention-backend", "unfused")
    assert unfused.returncode == 0 and "of 80 GiB: does NOT fit" in unfused.stdout
    activations = {
        name: float(line.split()[1])
        for name, out in (("fused", full), ("unfused", unfused))
        for line in out.stdout.splitlines()
        if line.split()[:1] == ["activations"]
    }
    # first stage: 40 layers x 2 micro-batches in flight x the softmax [64/8 heads, 4096, 4096]
    # in bf16 (20 GiB) and the keys and values expanded to every head (1.1 GiB)
    assert activations["unfused"] - activations["fused"] == pytest.approx(21.08, abs=0.01)
    recompute = _tool(*recipe, "--attention-backend", "unfused", "--recompute-activations")
    assert "of 80 GiB: fits" in recompute.stdout
    clip = _tool(
        "--clip",
        "--model",
        "vit-b-16",
        "--dp",
        "64",
        "--micro-batch-size",
        "256",
        "--clip-loss",
        "sogclr",
        "--num-samples",
        "12000000",
        "--bf16",
    )
    # OpenAI's ViT-B/16 CLIP: 149,620,737 parameters with its logit scale (sogclr has none)
    assert clip.returncode == 0 and "149.62 M parameters" in clip.stdout, clip.stderr
    assert "contrastive batch 16384" in clip.stdout and "of 80 GiB: fits" in clip.stdout
    bad = _tool(*recipe[:8], "--zero", "2")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "--zero-stage 2 does not work with --pipeline-model-parallel-size > 1" in bad.stderr
    heads = _tool("--model", "llama2-7b", "--tp", "3")
    assert heads.returncode == 1 and "--num-attention-heads (32)" in heads.stderr


def _measure_clip(loss: str, mbs: int, image_size: int, layers: int, hidden: int):
    """One CLIP training step (towers, temperature, loss) after a warm-up step: the peak of
    live tensor bytes, as for GPT above."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.clip.config import CLIPLossConfig, CLIPTempNetConfig
    from megatron_tempnet.models.clip.objective import CLIPTrainModule
    from megatron_tempnet.models.clip.towers import CLIPModel

    apply_cpu_support()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    cfg = _clip_config(image_size, layers, hidden)
    objective = CLIPLossConfig(clip_loss=loss, tempnet=CLIPTempNetConfig(tempnet_proj_size=32))
    module = CLIPTrainModule(CLIPModel(cfg, seed=1), objective)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(mbs, 3, image_size, image_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (mbs, cfg.context_length), generator=g)
    lengths = torch.full((mbs,), 20)
    k = len(objective.state_fields)
    state, seen = torch.zeros(mbs, k), torch.zeros(mbs, dtype=torch.bool)

    def step():
        module(images, tokens, lengths, state, seen).loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _clip_config(image_size: int, layers: int, hidden: int):
    from megatron_tempnet.models.clip.config import CLIPModelConfig

    return CLIPModelConfig.from_preset(
        "clip-tiny",
        vocab_size=500,
        image_size=image_size,
        image_channels=3,
        embed_dim=64,
        vision_layers=layers,
        text_layers=layers,
        vision_hidden_size=hidden,
        text_hidden_size=hidden,
        context_length=32,
    )


@pytest.mark.parametrize(
    "loss,mbs,image_size,layers,hidden",
    [("tempnet", 1024, 8, 1, 32), ("clip", 1024, 8, 1, 32), ("isogclr", 32, 64, 4, 256)],
    ids=["tempnet-rows", "infonce-rows", "isogclr-towers"],
)
def test_clip_total_is_within_20_percent_of_the_measured_peak(
    loss, mbs, image_size, layers, hidden
):
    """The [b, B] similarity rows and the loss's buffers dominate the first two, the towers'
    activations the third."""
    from megatron_tempnet.models.clip.memory import CLIPLayout, estimate, largest
    from megatron_tempnet.models.clip.sample_state import ShardedSampleState

    peak = run_distributed(_measure_clip, 1, args=(loss, mbs, image_size, layers, hidden))[0]
    layout = CLIPLayout(micro_batch_size=mbs, clip_loss=loss, tempnet_proj_size=32)
    planned = largest(estimate(_clip_config(image_size, layers, hidden), layout))
    assert planned.total == pytest.approx(peak, rel=0.2), (planned.parts, peak)
    # the per-sample state: this rank's shard as ShardedSampleState holds it (1M pairs, DP 8)
    layout = CLIPLayout(micro_batch_size=mbs, clip_loss=loss, num_samples=10**6, data_parallel=8)
    planned = largest(estimate(_clip_config(image_size, layers, hidden), layout))
    shard = ShardedSampleState(10**6 // 8, ("x",) * (8 if loss == "isogclr" else 4))
    expected = shard.values.nbytes + shard.seen.nbytes if loss != "clip" else 0
    assert planned.parts["per-sample state"] == expected
