"""Memory arithmetic every model family's planner shares: a transformer layer's parameters and
the activations it keeps for backward, and model states per ZeRO stage (the accounting is
explained in ``models/gpt/memory.py``).

``shape`` is a ``TransformerShape`` (a GPT model, or one CLIP tower); ``layout`` anything with
``tensor_parallel``, ``data_parallel``, ``zero_stage``, ``precision`` and ``micro_batch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tempnet.models.transformer import TransformerShape

GIB = 2**30
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class BatchLayout:
    """The parallel layout and batch of a run (each family's planner adds its own fields)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """None: one micro-batch per data-parallel rank (no accumulation)."""
    precision: str = "fp32"

    @property
    def micro_batches(self) -> int:
        gbs = self.global_batch_size or self.micro_batch_size * self.data_parallel
        return gbs // (self.micro_batch_size * self.data_parallel)

    @classmethod
    def flags(cls, args) -> dict:
        """The fields from the planner's flags (``--tp --pp --dp --zero --micro-batch-size
        --global-batch-size --bf16 --fp16``)."""
        return dict(
            tensor_parallel=args.tp,
            pipeline_parallel=args.pp,
            data_parallel=args.dp,
            zero_stage=args.zero,
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        )


def layer_params(model: TransformerShape, tp: int) -> int:
    """One transformer layer's parameters on one TP rank."""
    h, heads = model.hidden_size, model.num_attention_heads
    d = h // heads
    groups = model.num_query_groups or heads
    ffn = model.ffn_size()
    up = 2 * ffn if model.swiglu else ffn
    bias = model.add_bias_linear
    qkv = h * (heads + 2 * groups) * d // tp + (bias and (heads + 2 * groups) * d // tp)
    proj = heads * d * h // tp + (bias and h)
    mlp = h * up // tp + (bias and up // tp) + ffn * h // tp + (bias and h)
    norms = 2 * norm_params(model)
    return qkv + proj + mlp + norms


def norm_params(model: TransformerShape) -> int:
    return model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)


def model_state_bytes(trainable: int, frozen: int, largest: int, layout) -> dict:
    """Weights, gradients and optimizer states per GPU (DeepSpeed's accounting, see above)."""
    n, z = layout.data_parallel, layout.zero_stage
    shard = lambda stage, x: x / n if z >= stage else x  # noqa: E731  (partitioned from `stage`)
    if PRECISIONS[layout.precision] == 2:
        weights = shard(3, 2 * (trainable + frozen)) + (4 * largest if z == 3 else 0)
        grads = (0 if z == 3 else shard(2, 2 * trainable)) + shard(1, 4 * trainable)
        optim = shard(1, 12 * trainable)
    else:
        weights = shard(3, 4 * (trainable + frozen)) + (4 * largest if z == 3 else 0)
        grads = shard(2, 4 * trainable)
        optim = shard(1, 8 * trainable)
    return {"weights": int(weights), "gradients": int(grads), "optimizer states": int(optim)}


def checkpoint_bytes_per_param(precision: str) -> int:
    """Bytes a checkpoint holds per trained parameter: the 16-bit weight (2), its float32
    master (4) and AdamW's two float32 moments (8) = 14; in float32 the weight is the master:
    4 + 8 = 12."""
    return 14 if PRECISIONS[precision] == 2 else 12


def checkpoint_share_bytes(saved_params: int, layout) -> int:
    """One rank's share of a checkpoint, in bytes: what a save writes and what --async-save
    copies to host memory (``checkpoint.host_buffers``). Each value of a saved parameter is
    written by one data-parallel rank (ZeRO 1-2 by its fragment's owner, ZeRO 0 and 3 by an
    even split), so a rank holds ``bytes_per_param x saved_params / DP``. ``saved_params``:
    the trained parameters of the rank's TP shard of its stage."""
    per = checkpoint_bytes_per_param(layout.precision)
    return -(-per * saved_params // layout.data_parallel)


def layer_activation_bytes(model: TransformerShape, layout, seq_length: int) -> int:
    """What one transformer layer keeps for backward, one micro-batch (formula above)."""
    e, t, b, s = (
        PRECISIONS[layout.precision],
        layout.tensor_parallel,
        layout.micro_batch_size,
        seq_length,
    )
    h, a = model.hidden_size, model.num_attention_heads
    ffn = model.ffn_size()
    up = 2 * ffn if model.swiglu else ffn
    if model.attention_backend == "unfused":
        qkv = 3 * h
    else:
        qkv = h + 2 * (model.num_query_groups or a) * (h // a)
    # the inputs of the two norms and of linear_qkv / linear_fc1 (which keeps its input as
    # given: the shard under sequence parallelism, all-gathered again in backward)
    norm_regions = 4 * h // t if getattr(layout, "sequence_parallel", False) else 4 * h
    return s * b * e * (norm_regions + (qkv + h + ffn + up) // t) + core_attention_bytes(
        model, layout, seq_length
    )


def core_attention_bytes(model: TransformerShape, layout, seq_length: int) -> int:
    """What the core attention alone keeps for backward (selective recomputation drops it):
    the unfused softmax ``[b, a/t, s, s]``, or the fused kernels' float32 log-sum-exp per
    query."""
    e, t, b, s = (
        PRECISIONS[layout.precision],
        layout.tensor_parallel,
        layout.micro_batch_size,
        seq_length,
    )
    a = model.num_attention_heads
    if model.attention_backend == "unfused":
        return e * b * a * s * s // t
    return 4 * b * a * s // t
