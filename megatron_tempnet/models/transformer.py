"""What every model family builds its transformers from: megatron-core's layers on the local spec.

``TransformerShape`` is a transformer stack's architecture (Megatron-LM's flag names) and
``TransformerImpl`` how its layers compute (the attention backend, megatron-core's fusions);
``transformer_config`` turns both into megatron-core's ``TransformerConfig`` and ``layer_spec``
(``models.attention``) gives the layers. ``TransformerPiece`` is one ``TransformerLayer`` and
``FinalNorm`` the norm after the last one; ``models.rope.Rope`` is its rotary embedding (with
LLaMA-3.1's frequency scaling). Every piece of a model is built right after
``seed_rngs(base_seed + its index)``, so the weights do not depend on the parallel layout (on
CPU), whatever stage or process builds it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from megatron_tempnet.models.attention import ATTENTION_BACKENDS
from megatron_tempnet.models.fusions import fusion_problem, warn_fusions_off
from megatron_tempnet.models.rope import Rope
from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.flags import derived, option

ATTENTION_SPELLINGS = {"flash": "auto", "fused": "auto", "local": "unfused"}
"""Megatron-LM's --attention-backend values and the backend here that computes each."""


class ModelConfigError(UserError, ValueError):
    """Model flags that do not fit together; names the flags and their values."""


@dataclass
class TransformerImpl:
    """How the layers compute; none of it changes the model's function (checked for parity)."""

    attention_backend: str = option("auto", choices=(*ATTENTION_BACKENDS, *ATTENTION_SPELLINGS))
    """Core attention: auto = PyTorch's fused scaled_dot_product_attention (flash /
    memory-efficient kernels on a GPU, the fused CPU kernel on a CPU; no [b, heads, s, s]
    softmax kept for the backward pass); unfused = megatron-core's DotProductAttention.
    Megatron-LM's flash and fused are computed by auto, its local by unfused."""
    bias_swiglu_fusion: bool = option(True, name="--no-bias-swiglu-fusion")
    """The flag turns off megatron-core's fused bias + SwiGLU (torch.compile'd)."""
    bias_gelu_fusion: bool = option(True, name="--no-bias-gelu-fusion")
    """The flag turns off megatron-core's fused bias + GELU (torch.compile'd; it computes GELU's
    tanh approximation, so it is used with --openai-gelu only)."""
    bias_dropout_fusion: bool = option(True, name="--no-bias-dropout-fusion")
    """The flag turns off megatron-core's fused bias + dropout + residual add
    (torch.compile'd)."""

    def __post_init__(self):
        self.attention_backend = ATTENTION_SPELLINGS.get(
            self.attention_backend, self.attention_backend
        )


@dataclass
class TransformerShape(TransformerImpl):
    """A stack of transformer layers (the architecture flags every family shares)."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Width of the hidden states."""
    num_attention_heads: int = 4
    """Attention heads (divisible by the tensor-parallel size)."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention, with --group-query-attention (which
    alone gives 1, Megatron-LM's default); without it, one per attention head."""
    ffn_hidden_size: int | None = None
    """Width of the MLP (default, Megatron-LM's: 4 x --hidden-size; with --swiglu
    int(8 x --hidden-size / 3 / 64) x 64)."""
    normalization: str = option("LayerNorm", choices=("LayerNorm", "RMSNorm"))
    """The layers' norm."""
    swiglu: bool = False
    """SwiGLU MLP (LLaMA) instead of GELU."""
    openai_gelu: bool = False
    """GELU's tanh approximation (GPT-2 as released, Hugging Face's gelu_new)."""
    quick_gelu: bool = derived(False)
    """``x sigmoid(1.702 x)`` (OpenAI CLIP's QuickGELU; CLIP's --quick-gelu)."""
    add_bias_linear: bool = option(True, name="--disable-bias-linear")
    """The flag removes the biases of every linear layer (LLaMA); GPT-2 has them."""
    norm_epsilon: float = 1e-5
    """Epsilon of the norms."""
    init_method_std: float = 0.02
    """Standard deviation of the initial weights."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.1
    """Dropout of the attention probabilities."""
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights: the norms start at weight 0 and multiply by 1 + weight
    (Megatron-LM's LayerNorm-1p; here for LayerNorm and RMSNorm); exports write 1 + weight."""

    def ffn_size(self) -> int:
        """The MLP's width: --ffn-hidden-size, else Megatron-LM's default for the shape."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return swiglu_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size

    def validate(self, tensor_parallel_size: int = 1) -> None:
        """Raise ``ModelConfigError`` naming the flags when the stack cannot be built."""
        tp = tensor_parallel_size
        heads = self.num_attention_heads
        groups = self.num_query_groups or heads
        ffn = self.ffn_size()
        checks = [
            (
                self.hidden_size % heads == 0,
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({heads})",
            ),
            (
                heads % tp == 0,
                f"--num-attention-heads ({heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})",
            ),
            (
                heads % groups == 0,
                f"--num-attention-heads ({heads}) must be divisible by --num-query-groups "
                f"({groups})",
            ),
            (
                groups % tp == 0,
                f"--num-query-groups ({groups}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})",
            ),
            (
                ffn > 0,
                f"--ffn-hidden-size: the default for --hidden-size {self.hidden_size} with "
                "--swiglu, int(8 x hidden / 3 / 64) x 64, is 0: give --ffn-hidden-size",
            ),
            (
                ffn % tp == 0,
                f"--ffn-hidden-size ({ffn}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})",
            ),
            (
                self.normalization in ("LayerNorm", "RMSNorm"),
                f"--normalization {self.normalization!r}: expected LayerNorm or RMSNorm",
            ),
            (
                self.attention_backend in ATTENTION_BACKENDS,
                f"--attention-backend {self.attention_backend!r}: expected "
                + " or ".join(ATTENTION_BACKENDS),
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ModelConfigError(message)


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron-LM's MLP width for SwiGLU when none is given: 2/3 of 4 x hidden (the two input
    projections keep the parameter count), rounded down to a multiple of 64."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


def preset_fields(presets: dict[str, dict], name: str, overrides: dict) -> dict:
    """A ``--model`` preset's fields, the given values (None: the preset's) taking precedence."""
    if name not in presets:
        raise ModelConfigError(f"--model {name!r} is not one of {', '.join(presets)}")
    return {**presets[name], **{k: v for k, v in overrides.items() if v is not None}}


def padded_vocab_size(vocab_size: int | None, divisible_by: int, tensor_parallel_size: int) -> int:
    """The vocabulary rounded up to a multiple of ``divisible_by`` x TP (Megatron-LM's padding)."""
    if vocab_size is None:
        raise ModelConfigError("the vocabulary size is unknown: give a tokenizer")
    multiple = divisible_by * tensor_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def transformer_config(
    shape: TransformerShape,
    *,
    tensor_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    selective_recompute: bool = False,
):
    """megatron-core's ``TransformerConfig`` for ``shape``.

    ``selective_recompute``: megatron-core's selective recomputation of the core attention
    (``models.recompute``).

    ``sequence_parallel`` (with TP > 1): the layers' norm, dropout and residual regions run on
    sequence shards ``[s/tp, b, h]`` (megatron-core's column-parallel linears all-gather their
    input, the row-parallel ones reduce-scatter their output); the layer spec then needs
    ``own_norm`` (``models.attention.layer_spec``), as ``--apply-layernorm-1p`` does.

    The config has no pipeline split: pipeline stages are DeepSpeed's, and every layer gets its
    global layer number directly. The fusions that need neither apex nor Transformer Engine are
    on as ``shape`` asks (bias + SwiGLU, bias + tanh-GELU, bias + dropout + add; each computes
    the unfused function); the masked-softmax, RoPE, persistent-LayerNorm and
    gradient-accumulation fusions need apex or Transformer Engine and stay off.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape.validate(tensor_parallel_size)
    fused_swiglu = shape.swiglu and shape.bias_swiglu_fusion
    # megatron-core's fused bias-GELU is the tanh approximation: it stands in for
    # ``--openai-gelu`` (and needs the bias), never for the exact erf GELU
    fused_gelu = (
        shape.openai_gelu and not shape.swiglu and shape.add_bias_linear and shape.bias_gelu_fusion
    )
    fused_dropout = shape.bias_dropout_fusion
    if fused_swiglu or fused_gelu or fused_dropout:
        problem = fusion_problem(torch.cuda.is_available())  # compiles a probe, once
        if problem is not None:
            warn_fusions_off(problem)
            fused_swiglu = fused_gelu = fused_dropout = False
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_size(),
        normalization=shape.normalization,
        layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=shape.swiglu,
        activation_func=torch.nn.functional.gelu if fused_gelu else _activation(shape),
        add_bias_linear=shape.add_bias_linear,
        init_method_std=shape.init_method_std,
        hidden_dropout=shape.hidden_dropout,
        attention_dropout=shape.attention_dropout,
        tensor_model_parallel_size=tensor_parallel_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # on CPU the full weights are drawn then split, so every TP layout starts from the same
        # model; on GPU each rank initialises its own shard in place (Megatron-LM's behaviour)
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=fused_swiglu or fused_gelu,
        bias_dropout_fusion=fused_dropout,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=sequence_parallel and tensor_parallel_size > 1,
        layernorm_zero_centered_gamma=shape.apply_layernorm_1p,
        recompute_granularity="selective" if selective_recompute else None,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (``--openai-gelu``)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's GELU approximation, ``x sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


def _activation(shape: TransformerShape):
    if shape.swiglu:
        return torch.nn.functional.silu
    if shape.quick_gelu:
        return quick_gelu
    return gelu_tanh if shape.openai_gelu else torch.nn.functional.gelu


def seed_rngs(seed: int) -> None:
    """The default generator and megatron-core's model-parallel RNG tracker, from one seed."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = int(seed)  # DeepSpeed's stage offsets are numpy integers
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


class TransformerPiece(nn.Module):
    """One megatron-core ``TransformerLayer`` (the spec's attention mask; ``Rope`` when given).

    ``layer_number`` is the global 1-based index (the config has no pipeline split, so
    megatron-core adds no stage offset). ``recompute_with`` makes it recompute its activations
    (and those of the layers after it) in the backward pass (``models.recompute``).
    ``forward``: ``[s, b, h]`` -> ``[s, b, h]``; with sequence parallelism ``[s/tp, b, h]`` ->
    ``[s/tp, b, h]``, run in megatron-core's model-parallel RNG stream (each rank's shard draws
    its own dropout, as megatron-core's ``TransformerBlock`` does).
    """

    def __init__(self, config, layer_spec, layer_number: int, rope: Rope | None):
        super().__init__()
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self.layer = TransformerLayer(config, layer_spec.submodules, layer_number=layer_number)
        self.rotary = None if rope is None else rope.build(config)
        self._unit: list[TransformerPiece] = []  # recomputed together: this layer and the next
        self._in_unit = False  # run by the first layer of its unit

    def recompute_with(self, followers: list[TransformerPiece]) -> None:
        """In training, keep only this layer's input and rerun it and ``followers`` (the next
        layers of its stack, on its stage) as one unit in the backward pass; the followers then
        pass their input through."""
        self._unit = [self, *followers]  # a list: the followers stay their own modules
        for layer in followers:
            layer._in_unit = True

    def _run_unit(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self._unit:
            hidden = layer._run(hidden)
        return hidden

    def _run(self, hidden: torch.Tensor) -> torch.Tensor:
        config = self.layer.config
        rotary = None
        if self.rotary is not None:  # angles for the whole sequence, also from a shard of it
            shards = config.tensor_model_parallel_size if config.sequence_parallel else 1
            rotary = self.rotary(hidden.shape[0] * shards)
        with sequence_parallel_rng(config):
            out, _ = self.layer(hidden, attention_mask=None, rotary_pos_emb=rotary)
        return out

    def rotary_at(self, position_ids: torch.Tensor, length: int) -> torch.Tensor | None:
        """RoPE's angles at ``position_ids`` (``[b, s]``, each below ``length``):
        ``[s, b, 1, d]``, the same numbers ``forward`` uses at those positions."""
        if self.rotary is None:
            return None
        table = self.rotary(length)[:, 0, 0]  # [length, d]
        return table[position_ids.t()].unsqueeze(2)

    def generation_forward(self, hidden: torch.Tensor, rotary, cache) -> torch.Tensor:
        """``forward`` with a ``models.attention.KVCache`` (the core attention reads and writes
        it) and RoPE at given positions (``rotary_at``)."""
        out, _ = self.layer(hidden, attention_mask=cache, rotary_pos_emb=rotary)
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not (self._unit or self._in_unit) or not (self.training and torch.is_grad_enabled()):
            return self._run(hidden)
        if self._in_unit:  # its unit's first layer ran it
            return hidden
        from megatron.core import tensor_parallel

        return tensor_parallel.checkpoint(self._run_unit, False, hidden)


def sequence_parallel_rng(config):
    """megatron-core's model-parallel RNG stream with sequence parallelism (each TP rank's
    sequence shard draws its own dropout), else nothing."""
    if not config.sequence_parallel:
        return contextlib.nullcontext()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().fork()


def vocab_parallel_embedding(config, vocab_size: int):
    """megatron-core's ``VocabParallelEmbedding`` of ``vocab_size`` (padded) rows over TP."""
    from megatron.core import tensor_parallel

    return tensor_parallel.VocabParallelEmbedding(
        vocab_size,
        config.hidden_size,
        init_method=config.embedding_init_method,
        config=config,
    )


class FinalNorm(nn.Module):
    """The norm after the last layer (the spec's LayerNorm or RMSNorm implementation)."""

    def __init__(self, config, layer_spec):
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        self.norm = build_module(
            layer_spec.submodules.input_layernorm,
            config=config,
            hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)
