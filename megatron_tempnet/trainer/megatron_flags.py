"""Megatron-LM's (and Megatron-DeepSpeed's) flags that every entry point accepts under their names.

Three kinds, each declared once:

- ``RunSpellings``: flags whose effect is what the project computes anyway or maps to one of its
  own flags. Each field's docstring reads ``<Megatron-LM's meaning>. Here: <what it maps to>``;
  when a command line gives one, its start-up line says what it maps to (``notes``).
- ``REFUSED`` / ``REFUSED_PREFIXES``: features that are not built (mixture of experts, FP8 and
  Transformer Engine, interleaved pipeline stages, ...): a command line naming any of them stops
  before anything starts, with one error naming them all (``utils.flag_parser``).
- values of accepted flags that are not built (``--context-parallel-size 2``): ``problems``.

The "from Megatron-LM" table of the docs is generated from these (``tools/flag_table.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from megatron_tempnet.utils.flags import field_docs, flag_name, option

_MOE = "mixture of experts is not built (dense models only)"
_FP8 = "FP8 training (Transformer Engine) is not built: use --bf16"
_TE = "Transformer Engine is not used: the layers are megatron-core's local ones"
_VPP = "interleaved (virtual) pipeline stages are not built: one pipeline stage per rank"
_MLA = "multi-latent attention is not built"

_DATA_EFFICIENCY = "DeepSpeed's data-efficiency library (curriculum, random-LTD) is not built"
_TOKENS = "token-based lengths and schedules are not built: use --train-samples, --lr-*-samples"
_FIXED_INDEX = (
    "fixed dataset index files are not read: the indices are built from --data-path and --seed"
)
REFUSED: dict[str, str] = {
    "--expert-tensor-parallel-size": _MOE,
    "--fp8": _FP8,
    "--tp-comm-overlap": "Transformer Engine's TP communication overlap is not built",
    "--num-layers-per-virtual-pipeline-stage": _VPP,
    "--virtual-pipeline-model-parallel-size": _VPP,
    "--multi-latent-attention": _MLA,
    "--q-lora-rank": _MLA,
    "--kv-lora-rank": _MLA,
    "--rotary-interleaved": "interleaved RoPE is not built (rotary over halves, LLaMA's)",
    "--use-legacy-models": "the layers are megatron-core's (Megatron-LM's legacy models are not)",
    "--step-batch-size-schedule": "batch-size schedules: use --rampup-batch-size",
    "--spec": "custom layer specs are not loaded from the command line",
    "--activations-checkpoint-method": "Megatron-LM's name before 2022: --recompute-method",
    "--cpu-optimizer": "the optimizer on the CPU (ZeRO-Offload) is not built",
    "--data-efficiency-curriculum-learning": _DATA_EFFICIENCY,
    "--random-ltd": _DATA_EFFICIENCY,
    "--train-tokens": _TOKENS,
    "--lr-decay-tokens": _TOKENS,
    "--lr-warmup-tokens": _TOKENS,
    "--train-doc-idx-path": _FIXED_INDEX,
    "--train-sample-idx-path": _FIXED_INDEX,
    "--train-shuffle-idx-path": _FIXED_INDEX,
    "--universal-checkpoint": "DeepSpeed's universal checkpoints are not read",
}
"""Flags of features that are not built, with the reason."""

REFUSED_PREFIXES: dict[str, str] = {
    "--moe-": _MOE,
    "--fp8-": _FP8,
    "--te-": _TE,
    "--ds-sequence-parallel-": "DeepSpeed-Ulysses sequence parallelism is not built (Megatron's "
    "--sequence-parallel is)",
    "--enable-zbh1-": "the zero-bubble pipeline schedule is not built (DeepSpeed's 1F1B is used)",
}
"""Flag families of features that are not built."""

_DECOUPLED = "a learning rate for an LM's input embedding and output layer (pretrain_gpt.py)"
_NO_FUSION = "CLIP's MLPs have neither SwiGLU nor the tanh GELU this fusion computes"
CLIP_REFUSED: dict[str, str] = {
    "--decoupled-lr": _DECOUPLED,
    "--decoupled-min-lr": _DECOUPLED,
    "--sequence-parallel": "built for pretrain_gpt.py only: CLIP's towers keep whole sequences "
    "on every tensor-parallel rank (the ViT's 1 + patches tokens, the pooled class and "
    "end-of-text tokens)",
    "--rampup-batch-size": "not built for CLIP: its epochs are cut into whole global batches (no "
    "pair twice in a batch), which a growing batch would break",
    "--eval-iters": "pretrain_clip.py evaluates on the whole --valid-data every --eval-interval "
    "iterations",
    "--no-bias-swiglu-fusion": _NO_FUSION,
    "--no-bias-gelu-fusion": _NO_FUSION,
}
"""Megatron-LM's flags that pretrain_clip.py refuses besides ``REFUSED``: a language model's,
or a feature not built for CLIP."""


@dataclass
class RunSpellings:
    """Megatron-LM's and Megatron-DeepSpeed's flags for what the project does anyway."""

    deepspeed: bool = False
    """Megatron-DeepSpeed: train with DeepSpeed. Here: always; DeepSpeed is the engine (and,
    as in Megatron-DeepSpeed, --recompute-num-layers defaults to 1)."""
    distributed_backend: str = option("nccl", choices=("nccl", "gloo"))
    """Megatron-LM: the torch.distributed backend. Here: the compute device's (NCCL on GPUs;
    gloo on CPU, whatever is given)."""
    use_distributed_optimizer: bool = False
    """Megatron-LM: shard the optimizer states over the data-parallel ranks. Here: --zero-stage
    1 (DeepSpeed ZeRO 1) unless a higher --zero-stage is given."""
    optimizer: str = option("adam", choices=("adam",))
    """Megatron-LM: the optimizer (adam = Adam with decoupled weight decay). Here: AdamW, the
    same; sgd is not built."""
    use_mcore_models: bool = False
    """Megatron-LM: build the model from megatron-core's layers. Here: always."""
    data_impl: str = option("mmap", choices=("mmap",))
    """Megatron-DeepSpeed: how indexed datasets are read. Here: mmap, always."""
    context_parallel_size: int = 1
    """Megatron-LM: ranks that split the sequence in attention. Here: 1 only (context
    parallelism is not built)."""
    transformer_impl: str = option("local", choices=("local", "transformer_engine"))
    """Megatron-LM: the layers' implementation (its default: transformer_engine). Here: local,
    megatron-core's own layers (Transformer Engine is not used)."""
    expert_model_parallel_size: int = 1
    """Megatron-LM: expert-parallel ranks. Here: 1 only (mixture of experts is not built)."""
    num_experts: tuple[int, ...] | None = option(None, metavar="N")
    """Megatron-LM: experts per MoE layer (Megatron-DeepSpeed: per layer group, 1 = dense).
    Here: 1 only, a dense model (mixture of experts is not built)."""
    create_moe_param_group: bool = False
    """Megatron-DeepSpeed: a separate optimizer group for the experts' parameters. Here: no
    effect (no experts)."""
    moe_token_dropping: bool = option(True, name="--disable-moe-token-dropping")
    """Megatron-DeepSpeed: keep every token routed to an expert. Here: no effect (no
    experts)."""
    gradient_accumulation_fusion: bool = option(True, name="--no-gradient-accumulation-fusion")
    """Megatron-LM: turn off apex's fused weight-gradient accumulation. Here: no effect (the
    weight gradients are accumulated by autograd, never by that fusion)."""
    calculate_per_token_loss: bool = False
    """Megatron-LM: normalise the loss by the number of tokens in the global batch rather than
    per micro-batch. Here: always (one division by the global token count)."""
    create_attention_mask_in_dataloader: bool = option(
        True, name="--no-create-attention-mask-in-dataloader"
    )
    """Megatron-LM: do not build attention masks in the data loader. Here: never built (causal
    attention needs none)."""
    mmap_bin_files: bool = option(True, name="--no-mmap-bin-files")
    """Megatron-LM: read the .bin files without mmap. Here: no effect (they are read through
    mmap)."""
    tiktoken_pattern: str | None = None
    """Megatron-LM: TikTokenizer's split pattern. Here: no effect (TikTokenizer is not built;
    NullTokenizer ignores it as in Megatron-LM)."""
    ckpt_fully_parallel_save: bool = option(True, name="--no-ckpt-fully-parallel-save")
    """Megatron-LM: write the checkpoint from the first data-parallel rank only. Here: no effect
    (every rank writes its own share, in parallel, always)."""
    ckpt_fully_parallel_load: bool = False
    """Megatron-LM: share the reading of a checkpoint over the data-parallel ranks. Here: always
    (each rank reads only what it holds)."""
    use_persistent_ckpt_worker: bool = False
    """Megatron-LM: a persistent worker for --async-save. Here: no effect (each rank's
    background write runs in a thread of its own process)."""
    ckpt_assume_constant_structure: bool = False
    """Megatron-LM: reuse the save plan of the previous save. Here: no effect (a save plan
    is made for every save)."""
    deepspeed_activation_checkpointing: bool = False
    """Megatron-DeepSpeed: recompute through DeepSpeed's activation checkpointing (with its
    partitioning, CPU and contiguous-buffer options) instead of Megatron's. Here: megatron-core's
    checkpoint function recomputes what --recompute-granularity (or --checkpoint-activations)
    asks for, with the same gradients."""
    checkpoint_activations: bool = False
    """Megatron-DeepSpeed: recompute the transformer layers in the backward pass (the older
    spelling). Here: --recompute-granularity full --recompute-method uniform, in chunks of
    --recompute-num-layers (default: --checkpoint-num-layers)."""
    checkpoint_num_layers: int = 1
    """Megatron-DeepSpeed: the layers per recomputed chunk of --checkpoint-activations. Here:
    --recompute-num-layers, when that is not given."""
    partition_activations: bool = False
    """Megatron-DeepSpeed: split the recomputed layers' saved inputs over the tensor-parallel
    ranks. Here: not built; every tensor-parallel rank keeps the whole input (more activation
    memory than Megatron-DeepSpeed, the same training)."""
    contigious_checkpointing: bool = False
    """Megatron-DeepSpeed: copy the recomputed layers' saved inputs into one buffer. Here: no
    effect (they are the autograd graph's own tensors)."""
    synchronize_each_layer: bool = False
    """Megatron-DeepSpeed: wait for the device before and after each recomputed layer (for
    profiling). Here: no effect (no per-layer host waits)."""
    checkpoint_in_cpu: bool = False
    """Megatron-DeepSpeed: keep the recomputed layers' saved inputs in host memory. Here: not
    built; they stay on the device (more device memory than Megatron-DeepSpeed, the same
    training)."""
    ddp_impl: str = option("local", name="--DDP-impl", choices=("local", "torch"))
    """Megatron-LM (older) and Megatron-DeepSpeed: the data-parallel wrapper. Here: no effect
    (DeepSpeed's engine reduces the gradients)."""
    async_tensor_model_parallel_allreduce: bool = option(
        True, name="--no-async-tensor-model-parallel-allreduce"
    )
    """Megatron-DeepSpeed: do not overlap the tensor-parallel all-reduce of a column-parallel
    layer's input gradient with its weight gradient. Here: no effect on the results
    (megatron-core's layers schedule that all-reduce)."""
    log_batch_size_to_tensorboard: bool = False
    """Megatron-LM: write the global batch size to TensorBoard. Here: always
    (global_batch_size, with --tensorboard-dir)."""
    log_validation_ppl_to_tensorboard: bool = False
    """Megatron-LM: write the validation perplexity to TensorBoard. Here: always (val_ppl and
    the T-LLM val_tllm_ppl, with --tensorboard-dir)."""
    log_timers_to_tensorboard: bool = False
    """Megatron-LM: write its per-phase timers to TensorBoard. Here: no effect (no per-phase
    timers; the throughput of each logging interval is written)."""
    log_optimizer_states_to_tensorboard: bool = False
    """Megatron-DeepSpeed: write statistics of the optimizer's moments to TensorBoard. Here: no
    effect (the learning rates and the gradient norm are written)."""
    tensorboard_queue_size: int = 1000
    """Megatron-LM: TensorBoard's queue of pending events. Here: no effect (the writer is
    flushed at every logging interval)."""
    timing_log_level: int = option(0, choices=(0, 1, 2))
    """Megatron-LM: how many phases to time. Here: no effect (no per-phase timers; the
    throughput of each logging interval is logged, as at Megatron-LM's level 0)."""
    no_pipeline_parallel: bool = False
    """Megatron-DeepSpeed: build the model without DeepSpeed's pipeline module. Here: one
    pipeline stage, as --pipeline-model-parallel-size 1 is (a larger one is refused)."""


def notes(args: argparse.Namespace, given: set[str]) -> list[str]:
    """One start-up line per ``RunSpellings`` flag the command line gives, and for a
    Megatron-LM --ckpt-format."""
    lines = spelling_notes(RunSpellings, args, given)
    fmt = getattr(args, "ckpt_format", None)
    if fmt in ("torch_dist", "torch"):
        lines.append(
            f"--ckpt-format {fmt}: this run saves its checkpoints as tempnet_dist (this "
            "project's format: TempNet, per-sample state and the training state have no place "
            f"in Megatron-LM's {fmt}); Megatron-LM's checkpoints are read by --load, --finetune "
            "and --pretrained-checkpoint, and tools/checkpoint/export_megatron_lm.py writes "
            "torch_dist"
        )
    return lines


def spelling_notes(cls: type, args: argparse.Namespace, given: set[str]) -> list[str]:
    """``--flag value: <what it maps to>`` for each field of ``cls`` the command line gives
    (the part of its docstring after ``Here:``)."""
    docs = field_docs(cls)
    lines = []
    for name in given_fields(cls, given):
        _, _, here = docs[name].partition(" Here: ")
        lines.append(f"{shown(cls, name, args)}: {here}")
    return lines


def problems(args: argparse.Namespace) -> list[str]:
    """The values of ``RunSpellings`` flags that ask for what is not built."""
    out = []
    if args.context_parallel_size != 1:
        out.append(
            f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
            "built (1 only)"
        )
    if args.transformer_impl != "local":
        out.append(f"--transformer-impl {args.transformer_impl}: {_TE}")
    if args.expert_model_parallel_size != 1:
        out.append(f"--expert-model-parallel-size {args.expert_model_parallel_size}: {_MOE}")
    if any(n != 1 for n in args.num_experts or ()):
        out.append(f"--num-experts {' '.join(map(str, args.num_experts))}: {_MOE}")
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if args.no_pipeline_parallel and pp != 1:
        out.append(f"--no-pipeline-parallel: contradicts --pipeline-model-parallel-size {pp}")
    return out


def apply(args: argparse.Namespace) -> None:
    """Set the project's flags that ``RunSpellings`` flags map to."""
    if args.use_distributed_optimizer and args.zero_stage == 0:
        args.zero_stage = 1
    if args.deepspeed and args.recompute_num_layers is None and args.recompute_method:
        args.recompute_num_layers = 1  # Megatron-DeepSpeed's default (Megatron-LM has none)
    if args.checkpoint_activations:  # as Megatron-DeepSpeed, whatever the recompute flags say
        args.recompute_granularity, args.recompute_method = "full", "uniform"
        if args.recompute_num_layers is None:
            args.recompute_num_layers = args.checkpoint_num_layers


def given_fields(cls: type, given: set[str]) -> list[str]:
    """The fields of ``cls`` whose flags are among the ``given`` destinations."""
    return [
        f.name
        for f in dataclasses.fields(cls)
        if flag_name(f) and flag_name(f).lstrip("-").replace("-", "_") in given
    ]


def shown(cls: type, name: str, args: argparse.Namespace) -> str:
    """``--flag`` or ``--flag value`` as the command line gave it."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    flag = flag_name(f)
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if isinstance(value, bool):
        return flag
    if isinstance(value, (tuple, list)):
        return f"{flag} {' '.join(map(str, value))}"
    return f"{flag} {value}"
