"""Per-GPU memory of a GPT/LLaMA + TempNet training run, before it is queued.

Arithmetic only (no torch, no process group): parameter counts per pipeline stage from the model's
pieces (models/gpt/layers.py), model states per ZeRO stage, activations of megatron-core's local
transformer layer, the vocabulary-parallel logits and the DRO loss's buffers, TempNet's buffers.

Model states follow DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``:
``2P + 18P/N`` bytes; ``estimate_zero3_model_states_mem_needs``: ``4 x largest layer + 18P/N``),
split into what each byte is: 16-bit weights (2), 16-bit gradients (2), float32 gradients (4),
float32 master weights (4), Adam's two moments (8). Those are conservative (ZeRO-2 counts the
16-bit gradients whole and partitioned). Stage 0 and 1 use the same parts with what DeepSpeed
does not partition at that stage. In float32 (no mixed precision) the parts are weights (4),
gradients (4) and Adam's moments (8). Frozen parameters (``--freeze-lm``) hold weights only.

Activations (bytes, ``e`` the element size, ``t`` TP, micro-batch ``b``, sequence ``s``, hidden
``h``, ``a`` heads of size ``d``, ``g`` key/value groups, FFN ``f``; f' = 2f with SwiGLU): what
one layer keeps for backward, ``s*b*e*(4h + (qkv + h + f + f')/t) + attention``: the inputs of
its two norms and four linear layers, query, key and value, the attention context, and what the
attention keeps. With ``--sequence-parallel`` the norms and the column-parallel linears keep this
rank's sequence shard, ``4h`` becomes ``4h/t`` (and a layer's input ``s*b*e*h/t``), and
megatron-core's all-gather buffer ``[s, b, h]`` (one, reused by every layer) is added. The
attention is what ``--attention-backend`` builds (``models/attention.py``):

* ``unfused`` (megatron-core's ``DotProductAttention``): key and value expanded to every head
  (``qkv = 3h``) and the softmax ``[b, a/t, s, s]`` (``e*b*a*s^2/t``); while it runs, its two
  transient score tensors (``2*e*b*a*s^2/t``);
* ``auto`` (``scaled_dot_product_attention``'s flash / memory-efficient kernels): key and value
  per group (``qkv = h + 2gd``) and the kernel's float32 log-sum-exp per query (``4*b*a*s/t``),
  nothing of size ``s^2``: the kernels work block by block.

Times layers times micro-batches in flight (DeepSpeed's pipeline keeps ``min(PP - stage,
micro-batches)``). Recomputation (``models.recompute``) changes what the stage's ``L`` layers
keep: selective, every layer all of it but the core attention's part (the softmax, or the
log-sum-exp), rebuilt one attention at a time; full + uniform, the input ``s*b*e*h`` of each of
the ``ceil(L / n)`` chunks, a whole chunk (``min(n, L)`` layers) rebuilt at a time; full + block,
the input of the first ``min(n, L)`` layers and everything of the others, one layer rebuilt at a
time. A frozen LM keeps nothing: one layer's working set at a time. The last stage adds, with
the fused output stage (default), one chunk of ``c`` tokens' logits ``[c, V/t]`` in float32 (and
the GEMM's ``e``-byte output under bf16/fp16), the per-token statistics the backward pass reuses
and, under bf16/fp16, the output weight's float32 gradient accumulator and the hidden states'
float32 gradient (the stage computes both in its forward pass); with
``--no-fused-output-stage`` the whole logits ``[s*b, V/t]`` (``e`` bytes) and the loss's float32
buffer (``exp(z)``, then the gradient, in place; the reported cross-entropy's transient float32
buffer comes and goes before it). Both add TempNet's activations.
While a layer runs it adds a working set (the unfused attention's transient scores; the whole
layer when it is recomputed or frozen); the output buffers exist only after the last layer, so
only the larger of the two counts.

Host memory (not in the GPU total): with --async-save a rank copies its checkpoint share to host
memory, one buffer of its size (``checkpoint.host_buffers``): ``14 B`` per saved parameter under
bf16/fp16 (weight 2, float32 master 4, two moments 8), ``12 B`` in float32 (weight 4, moments 8),
over the data-parallel ranks (each value is written by one of them); a frozen-LM run saves what
it trains only (``saved_params``).

The optimizer is PyTorch's fused AdamW: one kernel over all tensors, whose only buffers are its
state (the two moments counted above and a step counter per tensor); its multi-tensor
(``foreach``) fallback would add a transient copy of the float32 gradients during the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_tempnet.losses.output_stage import default_chunk_size
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.memory import (  # noqa: F401  (the planner's and tests' names)
    GIB,
    PRECISIONS,
    BatchLayout,
    checkpoint_bytes_per_param,
    checkpoint_share_bytes,
    core_attention_bytes,
    layer_activation_bytes,
    layer_params,
    model_state_bytes,
    norm_params,
)
from megatron_tempnet.models.transformer import ModelConfigError
from megatron_tempnet.tempnet.config import TempNetConfig
from megatron_tempnet.utils.cli import UserError


class EstimateError(UserError, ValueError):
    """A layout that cannot be built; names the flags."""


@dataclass
class Layout(BatchLayout):
    freeze_lm: bool = False
    recompute_granularity: str | None = None
    """None, full or selective (--recompute-granularity; --recompute-activations: selective)."""
    recompute_method: str | None = None
    """With full: uniform or block."""
    recompute_num_layers: int | None = None
    """With full: layers per chunk (uniform) or recomputed layers per stage (block)."""
    tempnet: bool = True
    tempnet_hidden_size: int = TempNetConfig.tempnet_hidden_size
    tempnet_proj_size: int = TempNetConfig.tempnet_proj_size
    sequence_parallel: bool = False
    """--sequence-parallel: the norm, dropout and residual regions keep ``[s/t, b, h]`` (the
    layers' ``4h`` and their inputs / t; with TP 1 nothing changes)."""
    fused_output_stage: bool = True
    output_stage_chunk_size: int = 0
    """Tokens per chunk of the fused output stage (0: its default)."""


@dataclass
class StageParams:
    """Parameters one GPU of a pipeline stage holds (its TP shard)."""

    lm: int = 0
    tempnet: int = 0
    largest_layer: int = 0
    layers: int = 0
    first: bool = False
    last: bool = False


@dataclass
class Estimate:
    stage: int
    params: StageParams
    parts: dict[str, int] = field(default_factory=dict)
    """Bytes per GPU by part (weights, gradients, optimizer states, activations, ...)."""
    saved_params: int = 0
    """The parameters a rank of this stage saves, before the data-parallel split
    (``saved_params``)."""
    checkpoint_share: int = 0
    """Bytes of a rank's checkpoint share: host memory with --async-save, not GPU memory."""

    @property
    def model_states(self) -> int:
        return sum(self.parts[k] for k in ("weights", "gradients", "optimizer states"))

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def check_layout(model: ModelConfig, layout: Layout) -> None:
    """The trainer's own checks (heads/groups vs TP, layers vs PP, ZeRO with PP, batches)."""
    try:
        model.validate(layout.tensor_parallel)
    except ModelConfigError as e:
        raise EstimateError(str(e)) from None
    lay = layout
    if model.num_layers % lay.pipeline_parallel:
        raise EstimateError(
            f"--num-layers ({model.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({lay.pipeline_parallel})"
        )
    if lay.pipeline_parallel > 1 and lay.zero_stage > 1:
        raise EstimateError(
            f"--zero-stage {lay.zero_stage} does not work with "
            "--pipeline-model-parallel-size > 1 (DeepSpeed: ZeRO 0-1 only)"
        )
    if lay.zero_stage not in (0, 1, 2, 3):
        raise EstimateError(f"--zero-stage ({lay.zero_stage}) must be 0, 1, 2 or 3")
    if lay.precision not in PRECISIONS:
        raise EstimateError(f"precision {lay.precision!r} is not one of {', '.join(PRECISIONS)}")
    _check_recompute(lay)
    if lay.sequence_parallel and model.seq_length % lay.tensor_parallel:
        raise EstimateError(
            f"--sequence-parallel: --seq-length ({model.seq_length}) must be divisible by "
            f"--tensor-model-parallel-size ({lay.tensor_parallel})"
        )
    if lay.output_stage_chunk_size < 0:
        raise EstimateError(
            f"--output-stage-chunk-size ({lay.output_stage_chunk_size}) must be >= 1, or 0 for "
            "the default"
        )
    per_step = lay.micro_batch_size * lay.data_parallel
    if min(lay.tensor_parallel, lay.pipeline_parallel, lay.data_parallel, lay.micro_batch_size) < 1:
        raise EstimateError("--tp, --pp, --dp and --micro-batch-size must be >= 1")
    if lay.global_batch_size is not None and lay.global_batch_size % per_step:
        raise EstimateError(
            f"--global-batch-size ({lay.global_batch_size}) must be a multiple "
            f"of --micro-batch-size x --dp ({per_step})"
        )


def _check_recompute(lay: Layout) -> None:
    full = lay.recompute_granularity == "full"
    if lay.recompute_granularity not in (None, "full", "selective"):
        raise EstimateError(
            f"--recompute-granularity {lay.recompute_granularity!r}: expected full or selective"
        )
    if full and (lay.recompute_method not in ("uniform", "block") or not lay.recompute_num_layers):
        raise EstimateError(
            "--recompute-granularity full needs --recompute-method uniform or block and "
            "--recompute-num-layers >= 1"
        )
    if not full and (lay.recompute_method or lay.recompute_num_layers):
        raise EstimateError(
            "--recompute-method and --recompute-num-layers go with --recompute-granularity full"
        )


def tempnet_params(model: ModelConfig, layout: Layout) -> int:
    """TempNetLM on the fullest TP rank: W1 over its true vocabulary columns (the first ranks
    hold a whole shard, the last one the rest), then replicated layers."""
    d1, d2 = layout.tempnet_hidden_size, layout.tempnet_proj_size
    tp = layout.tensor_parallel
    local_vocab = min(model.padded_vocab_size(tp) // tp, model.vocab_size)
    return d1 * local_vocab + d1 + d2 * d1 + d2 + 2


def stage_params(model: ModelConfig, layout: Layout) -> list[StageParams]:
    """Per pipeline stage: embeddings on the first, final norm, output layer, TempNet on the last
    (a tied output layer is a second copy of the embedding there when PP > 1)."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    vocab = model.padded_vocab_size(tp) // tp * model.hidden_size
    positions = (
        model.max_position_embeddings * model.hidden_size
        if model.position_embedding_type == "learned_absolute"
        else 0
    )
    per_layer = layer_params(model, tp)
    tied = not model.untie_embeddings_and_output_weights
    stages = []
    for i in range(pp):
        s = StageParams(layers=model.num_layers // pp, first=i == 0, last=i == pp - 1)
        s.lm = s.layers * per_layer
        s.largest_layer = per_layer
        if s.first:
            s.lm += vocab + positions
            s.largest_layer = max(per_layer, vocab)
        if s.last:
            s.lm += norm_params(model) + (0 if tied and pp == 1 else vocab)
            s.largest_layer = max(s.largest_layer, vocab)
            s.tempnet = tempnet_params(model, layout) if layout.tempnet else 0
        stages.append(s)
    return stages


def _attention_transient(model: ModelConfig, layout: Layout, seq_length: int) -> int:
    """The unfused attention's two score tensors while it runs (the fused kernels: none)."""
    if model.attention_backend != "unfused":
        return 0
    e, t, b = PRECISIONS[layout.precision], layout.tensor_parallel, layout.micro_batch_size
    return 2 * e * b * model.num_attention_heads * seq_length**2 // t


def output_bytes(model: ModelConfig, layout: Layout, seq_length: int) -> dict:
    """The last stage's buffers: the whole logits shard and the loss's, or the fused stage's."""
    e, t = PRECISIONS[layout.precision], layout.tensor_parallel
    tokens = seq_length * layout.micro_batch_size
    local_vocab = model.padded_vocab_size(t) // t
    d1, d2 = layout.tempnet_hidden_size, layout.tempnet_proj_size
    tempnet = e * tokens * (3 * d1 + 3 * d2) if layout.tempnet else 0
    if layout.fused_output_stage:
        return _fused_output_bytes(model, layout, tokens, local_vocab) | {
            "TempNet activations": tempnet
        }
    logits = e * tokens * local_vocab
    # the loss's float32 exp(z) buffer, then its gradient in place; the reported cross-entropy's
    # transient buffer is freed before the loss allocates it
    loss = 4 * tokens * local_vocab
    return {"logits shard": logits, "loss buffers": loss, "TempNet activations": tempnet}


def _fused_output_bytes(model: ModelConfig, layout: Layout, tokens: int, local_vocab: int):
    """One chunk of logits at a time (float32; with 16-bit weights also the GEMM's 16-bit
    output, then the 16-bit gradient), the per-token statistics kept for the backward pass, and
    with 16-bit weights the float32 accumulator of the output weight's gradient and the hidden
    states' gradient in float32 until the backward pass (both computed in the forward pass).
    (The row-block temporaries of its sums, at most 32 MiB, are left out.)"""
    e = PRECISIONS[layout.precision]
    chunk = min(tokens, layout.output_stage_chunk_size or default_chunk_size(local_vocab))
    per_value = 4 + (e if e != 4 else 0)
    per_token = 4 * tokens * (8 + (layout.tempnet_hidden_size if layout.tempnet else 0))
    # a frozen LM's weight gets no gradient
    accumulator = 0
    if e != 4 and not layout.freeze_lm:
        h = model.hidden_size
        own = tokens // layout.tensor_parallel if layout.sequence_parallel else tokens
        accumulator = 4 * local_vocab * h + (4 - e) * own * h  # float32 beyond the 16-bit
    return {
        "output-stage chunk": chunk * local_vocab * per_value,
        "output-stage state": per_token + accumulator,
    }


def estimate(model: ModelConfig, layout: Layout, seq_length: int | None = None) -> list[Estimate]:
    """Per-GPU estimate of every pipeline stage (the caller picks the largest)."""
    check_layout(model, layout)
    s = seq_length or model.seq_length
    out = []
    for i, p in enumerate(stage_params(model, layout)):
        trainable = p.tempnet + (0 if layout.freeze_lm else p.lm)
        frozen = p.lm if layout.freeze_lm else 0
        parts = model_state_bytes(trainable, frozen, p.largest_layer, layout)
        in_flight = min(layout.pipeline_parallel - i, layout.micro_batches)
        kept, working = layer_activations(model, layout, p.layers, s)
        parts["activations"] = in_flight * kept
        if layout.sequence_parallel and layout.tensor_parallel > 1:
            parts["SP gather buffer"] = _gather_buffer(model, layout, s)
        outputs = output_bytes(model, layout, s) if p.last else {}
        parts.update(outputs)
        # a layer's working set and the output buffers never coexist: the larger one counts
        parts["layer working set"] = max(0, working - sum(outputs.values()))
        saved = saved_params(model, layout, p)
        share = checkpoint_share_bytes(saved, layout)
        out.append(Estimate(i, p, parts, saved_params=saved, checkpoint_share=share))
    return out


def saved_params(model: ModelConfig, layout: Layout, p: StageParams) -> int:
    """The parameters a rank of a stage writes into a checkpoint (its TP shard, before the
    data-parallel split): the trained ones, as a frozen-LM run reads its LM from
    --pretrained-checkpoint instead of saving it; a tied output layer's second pipeline copy
    is not written. (A replicated parameter, a norm, is split over the TP ranks in the file
    and counted whole here: a few thousand parameters per layer.)"""
    trained = p.tempnet + (0 if layout.freeze_lm else p.lm)
    tied = not model.untie_embeddings_and_output_weights
    if p.last and tied and layout.pipeline_parallel > 1 and not layout.freeze_lm:
        tp = layout.tensor_parallel
        trained -= model.padded_vocab_size(tp) // tp * model.hidden_size
    return trained


def layer_activations(model: ModelConfig, layout: Layout, layers: int, seq_length: int):
    """(What a stage's ``layers`` keep for one micro-batch, the largest working set while one
    of them runs or is rebuilt) under --recompute-* (module docstring)."""
    s = seq_length
    per_layer = layer_activation_bytes(model, layout, s)
    transient = _attention_transient(model, layout, s)
    layer_input = s * layout.micro_batch_size * PRECISIONS[layout.precision] * model.hidden_size
    if layout.sequence_parallel:  # each rank keeps its shard of the sequence
        layer_input //= layout.tensor_parallel
    n = layout.recompute_num_layers
    if layout.freeze_lm:  # no graph through the LM: one layer's working set at a time
        return 0, per_layer + transient
    if layout.recompute_granularity == "selective":
        core = core_attention_bytes(model, layout, s)
        return layers * (per_layer - core), transient + core
    if layout.recompute_granularity == "full" and layout.recompute_method == "uniform":
        return -(-layers // n) * layer_input, min(n, layers) * per_layer
    if layout.recompute_granularity == "full":  # block
        recomputed = min(n, layers)
        kept = recomputed * layer_input + (layers - recomputed) * per_layer
        return kept, per_layer if recomputed else transient
    return layers * per_layer, transient


def _gather_buffer(model: ModelConfig, layout: Layout, seq_length: int) -> int:
    """megatron-core's buffer for the column-parallel linears' all-gather of the sequence
    ``[s, b, h]`` (one, kept and reused by every layer, forward and backward)."""
    e = PRECISIONS[layout.precision]
    return seq_length * layout.micro_batch_size * e * model.hidden_size


def largest(estimates: list[Estimate]) -> Estimate:
    return max(estimates, key=lambda x: x.total)
