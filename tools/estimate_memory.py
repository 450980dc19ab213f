"""Will it fit? Per-GPU memory of a pretrain_gpt.py or pretrain_clip.py run, without a GPU.

    python tools/estimate_memory.py --model llama2-70b --tp 8 --pp 2 --dp 4 --zero 1 \\
        --micro-batch-size 1 --global-batch-size 16 --seq-length 4096 --bf16 --freeze-lm
    python tools/estimate_memory.py --clip --model vit-b-16 --dp 64 --micro-batch-size 256 \\
        --clip-loss isogclr --num-samples 12000000 --bf16

CLIP (``--clip``): both towers, the temperature, the [b, B] similarity rows and the loss's
buffers, the per-sample state shard of a rank (models/clip/memory.py).

Prints the breakdown for the fullest pipeline stage (weights, gradients, optimizer states per
ZeRO stage, activations, the logits shard, the loss's and TempNet's buffers) and a verdict against
--gpu-memory-gb. The accounting is in megatron_tempnet/models/gpt/memory.py. Not counted:
the CUDA context, NCCL buffers and allocator fragmentation (plan a few GiB for them).

--async-save adds the host memory a rank's background saves hold (pinned, outside the GPU
total): its checkpoint share, for the stage with the largest one. --frozen-lm-cache (with
--freeze-lm; --cache-tokens N) adds what pretrain_gpt.py --frozen-lm-cache stores on disk and
what an iteration that reads it costs.
"""

from __future__ import annotations

import argparse
import sys

from megatron_tempnet.models.attention import ATTENTION_BACKENDS
from megatron_tempnet.models.clip import memory as clip_memory
from megatron_tempnet.models.clip.config import CLIP_LOSSES, CLIP_PRESETS, CLIPModelConfig
from megatron_tempnet.models.gpt.config import PRESETS, ModelConfig
from megatron_tempnet.models.gpt.flops import flops_per_token, output_stage_flops_per_token
from megatron_tempnet.models.gpt.memory import (
    GIB,
    PRECISIONS,
    EstimateError,
    Layout,
    checkpoint_bytes_per_param,
    estimate,
    largest,
    stage_params,
)
from megatron_tempnet.tempnet.config import TempNetConfig
from megatron_tempnet.utils.cli import run_tool

GPT2_VOCAB = 50257  # GPT-2's BPE, for presets without a vocabulary (LLaMA's have 32000)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clip", action="store_true", help="a pretrain_clip.py run (--model: CLIP's)")
    p.add_argument("--model", choices=sorted(PRESETS | CLIP_PRESETS), help="default: llama2-70b "
                   "(--clip: vit-b-16)")  # fmt: skip
    p.add_argument("--clip-loss", choices=CLIP_LOSSES, default="tempnet", help="with --clip")
    p.add_argument("--num-samples", type=int, default=0,
                   help="with --clip: training pairs (the per-sample state)")  # fmt: skip
    for flag in (
        "num-layers",
        "hidden-size",
        "num-attention-heads",
        "num-query-groups",
        "ffn-hidden-size",
        "seq-length",
        "vocab-size",
    ):
        p.add_argument(f"--{flag}", type=int, help="overrides the preset")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=1)
    p.add_argument("--zero", "--zero-stage", dest="zero", type=int, default=0)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, help="default: micro-batch-size x dp")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    p.add_argument("--freeze-lm", action="store_true", help="TempNet only (the LM is frozen)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="the layers' norm, dropout and residual regions on [s/tp, b, h] shards",
    )
    p.add_argument(
        "--recompute-activations",
        action="store_true",
        help="selective recomputation (--recompute-granularity selective)",
    )
    p.add_argument("--recompute-granularity", choices=("full", "selective"))
    p.add_argument("--recompute-method", choices=("uniform", "block"))
    p.add_argument("--recompute-num-layers", type=int)
    _add_computation_flags(p)
    return p


def _add_computation_flags(p: argparse.ArgumentParser) -> None:
    """How the run computes and saves: attention, the output stage, TempNet, the GPU's memory,
    asynchronous saves and the frozen LM's cache."""
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="the run's core attention (default: %(default)s, fused; unfused keeps the "
        "[b, heads, s, s] softmax)",
    )
    p.add_argument(
        "--no-fused-output-stage",
        dest="fused_output_stage",
        action="store_false",
        help="the run forms the whole [tokens, V/tp] logits (default: the fused output stage)",
    )
    p.add_argument(
        "--output-stage-chunk-size",
        type=int,
        default=0,
        help="tokens per chunk of the fused output stage (0: its default)",
    )
    p.add_argument("--no-tempnet", action="store_true", help="--loss ce / a fixed tau")
    p.add_argument("--tempnet-hidden-size", type=int, default=TempNetConfig.tempnet_hidden_size)
    p.add_argument("--tempnet-proj-size", type=int, default=TempNetConfig.tempnet_proj_size)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="per GPU (default 80)")
    p.add_argument(
        "--async-save",
        action="store_true",
        help="the run saves in the background: also print the host memory per rank its copies "
        "hold (the rank's checkpoint share, pinned)",
    )
    p.add_argument(
        "--frozen-lm-cache",
        action="store_true",
        help="with --freeze-lm: also print what pretrain_gpt.py --frozen-lm-cache stores per "
        "token and what a pass that reads it costs",
    )
    p.add_argument(
        "--cache-tokens",
        type=float,
        help="with --frozen-lm-cache: the distinct training tokens stored (e.g. 1e8)",
    )


def cache_lines(model: ModelConfig, layout: Layout, tokens: float | None) -> list[str]:
    """--frozen-lm-cache: the store's size per token (and for ``tokens``), and the FLOPs of an
    iteration that reads it against one that computes the hidden states."""
    if not layout.freeze_lm:
        raise EstimateError("--frozen-lm-cache stores a frozen LM's hidden states: add --freeze-lm")
    tp = layout.tensor_parallel
    tempnet = (layout.tempnet_hidden_size, layout.tempnet_proj_size) if layout.tempnet else None
    per_token = model.hidden_size * PRECISIONS[layout.precision]
    folders = 1 if layout.sequence_parallel else tp  # each TP rank stores its part, or all of it
    full = flops_per_token(model, tempnet, tp, frozen_lm=True)
    stage = output_stage_flops_per_token(model, tempnet, tp)
    whole = f" x TP {tp}: each TP rank stores all of it without --sequence-parallel"
    lines = [
        f"--frozen-lm-cache: {_decimal_bytes(per_token * folders)} per token stored (hidden "
        f"{model.hidden_size} x {PRECISIONS[layout.precision]} B{whole if folders > 1 else ''})",
        f"  a pass that reads it: {stage / full:.2%} of the FLOPs of one that computes it "
        f"({stage / 1e9:.3g} of {full / 1e9:.3g} GFLOP per token); it pays from the second pass "
        "over a sample (other runs on the same samples: a rho sweep, other losses)",
    ]
    if tokens:
        lines.append(f"  {tokens:.3g} tokens: {_decimal_bytes(tokens * per_token * folders)} "
                     "on disk")  # fmt: skip
    return lines


def _model(args) -> ModelConfig:
    vocab = args.vocab_size or PRESETS[args.model].get("vocab_size") or GPT2_VOCAB
    overrides = {
        k: getattr(args, k)
        for k in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "seq_length",
        )
    }
    model = ModelConfig.from_preset(
        args.model, **overrides, vocab_size=vocab, attention_backend=args.attention_backend
    )
    model.max_position_embeddings = max(model.max_position_embeddings, model.seq_length)
    return model


def _layout(args) -> Layout:
    return Layout(
        **Layout.flags(args),
        freeze_lm=args.freeze_lm,
        sequence_parallel=args.sequence_parallel and args.tp > 1,
        recompute_granularity="selective"
        if args.recompute_activations
        else args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        tempnet=not args.no_tempnet,
        tempnet_hidden_size=args.tempnet_hidden_size,
        tempnet_proj_size=args.tempnet_proj_size,
        fused_output_stage=args.fused_output_stage,
        output_stage_chunk_size=args.output_stage_chunk_size,
    )


def _recompute_flags(lay: Layout) -> str:
    flags = f"--recompute-granularity {lay.recompute_granularity}"
    if lay.recompute_method:
        flags += f" --recompute-method {lay.recompute_method}"
    if lay.recompute_num_layers:
        flags += f" --recompute-num-layers {lay.recompute_num_layers}"
    return flags


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


def _decimal_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def host_line(share: int, saved: int, layout, stage: int) -> str:
    """--async-save's host memory per rank: ``share`` bytes, ``saved`` parameters of the TP
    shard of ``stage`` (0-based) before the data-parallel split; how it is computed."""
    per = checkpoint_bytes_per_param(layout.precision)
    what = "16-bit weight 2, float32 master 4, moments 8" if per == 14 else "weight 4, moments 8"
    return (
        f"host, per rank, with --async-save (pinned, not in the total): {share / GIB:.2f} GiB "
        f"({_decimal_bytes(share)}) = {per} B ({what}) x {_count(saved)} saved parameters / DP "
        f"{layout.data_parallel}, stage {stage + 1} of {layout.pipeline_parallel}"
    )


def report(model: ModelConfig, layout: Layout, gpu_gb: float, async_save: bool = False) -> str:
    stages = estimate(model, layout)
    fullest = largest(stages)
    lay, p = layout, fullest.params
    gpus = lay.tensor_parallel * lay.pipeline_parallel * lay.data_parallel
    tokens = f"{lay.micro_batch_size} x {model.seq_length} tokens"
    options = (
        ("--freeze-lm", lay.freeze_lm),
        ("--sequence-parallel", lay.sequence_parallel),
        (_recompute_flags(lay), lay.recompute_granularity is not None),
        ("--attention-backend unfused", model.attention_backend == "unfused"),
        ("--no-fused-output-stage", not lay.fused_output_stage),
    )
    flags = [flag for flag, on in options if on]
    sizes = {
        "tempnet_hidden_size": lay.tempnet_hidden_size,
        "tempnet_proj_size": lay.tempnet_proj_size,
    }
    whole = stage_params(model, Layout(tempnet=lay.tempnet, **sizes))[0]  # one GPU holds it all
    trainable = p.tempnet + (0 if lay.freeze_lm else p.lm)
    holds = (
        [f"{p.layers} layers"]
        + (["embeddings"] if p.first else [])
        + (["final norm, output layer, TempNet, loss"] if p.last else [])
    )
    lines = [
        f"{model_name(model)}: TP {lay.tensor_parallel} x PP {lay.pipeline_parallel} x DP "
        f"{lay.data_parallel} ({gpus} GPUs), ZeRO-{lay.zero_stage}, {lay.precision}, micro-batch "
        f"{tokens}, {lay.micro_batches} micro-batch(es) per step {' '.join(flags)}".rstrip(),
        f"parameters: LM {_count(whole.lm)}, TempNet {_count(whole.tempnet)}",
        f"per GPU, fullest stage ({fullest.stage + 1} of {lay.pipeline_parallel}: "
        f"{', '.join(holds)}; {_count(p.lm + p.tempnet)} parameters, {_count(trainable)} "
        "trained):",
    ]
    for name, value in fullest.parts.items():
        lines.append(f"  {name:<22} {value / GIB:9.2f} GiB")
    total = fullest.total / GIB
    verdict = "fits" if total <= gpu_gb else "does NOT fit"
    lines.append(
        f"  {'total':<22} {total:9.2f} GiB of {gpu_gb:g} GiB: {verdict} "
        f"({gpu_gb - total:+.2f} GiB headroom)"
    )
    lines.append("  (not counted: CUDA context, NCCL buffers, allocator fragmentation)")
    if async_save:
        top = max(stages, key=lambda e: e.checkpoint_share)
        lines.append(host_line(top.checkpoint_share, top.saved_params, layout, top.stage))
    return "\n".join(lines)


def model_name(model: ModelConfig) -> str:
    kind = "LLaMA" if model.swiglu else "GPT"
    return (
        f"{kind} {model.num_layers} layers x {model.hidden_size} hidden, vocabulary "
        f"{model.vocab_size}"
    )


def clip_report(args) -> str:
    name = args.model or "vit-b-16"
    if name not in CLIP_PRESETS:
        raise EstimateError(f"--clip --model {name}: one of {', '.join(sorted(CLIP_PRESETS))}")
    model = CLIPModelConfig.from_preset(name, vocab_size=args.vocab_size or 49408)
    layout = clip_memory.CLIPLayout(
        **clip_memory.CLIPLayout.flags(args),
        clip_loss=args.clip_loss,
        num_samples=args.num_samples,
        tempnet_proj_size=args.tempnet_proj_size,
    )
    stages = clip_memory.estimate(model, layout)
    stage = clip_memory.largest(stages)
    lines = [
        f"CLIP {name} ({args.clip_loss}): TP {args.tp} x PP {args.pp} x DP {args.dp}, ZeRO-"
        f"{args.zero}, {layout.precision}, {args.micro_batch_size} pairs per micro-batch, "
        f"contrastive batch {args.micro_batch_size * args.dp}",
        f"per GPU, fullest stage ({stage.stage + 1} of {args.pp}: {stage.vision_layers} vision "
        f"and {stage.text_layers} text layers; {_count(stage.params)} parameters):",
    ]
    lines += [f"  {k:<22} {v / GIB:9.2f} GiB" for k, v in stage.parts.items()]
    total = stage.total / GIB
    verdict = "fits" if total <= args.gpu_memory_gb else "does NOT fit"
    lines.append(f"  {'total':<22} {total:9.2f} GiB of {args.gpu_memory_gb:g} GiB: {verdict}")
    if args.async_save:
        top = max(stages, key=lambda s: s.checkpoint_share)
        lines.append(host_line(top.checkpoint_share, top.params, layout, top.stage))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clip:
        print(clip_report(args))
        return 0
    args.model = args.model or "llama2-70b"
    if args.model not in PRESETS:
        raise EstimateError(f"--model {args.model} is a CLIP model: add --clip")
    if args.cache_tokens is not None and not args.frozen_lm_cache:
        raise EstimateError("--cache-tokens is for --frozen-lm-cache")
    model, layout = _model(args), _layout(args)
    print(report(model, layout, args.gpu_memory_gb, args.async_save))
    if args.frozen_lm_cache:
        print("\n".join(cache_lines(model, layout, args.cache_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
