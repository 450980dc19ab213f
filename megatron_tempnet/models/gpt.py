"""GPT-2 and LLaMA-1/2 language models from megatron-core layer specs.

GPT-2: learned absolute positions, LayerNorm, GELU MLP with biases, input and output embeddings
tied. LLaMA: RoPE, RMSNorm, SwiGLU MLP without biases, untied embeddings, grouped-query
attention (``num_query_groups`` key/value heads). Both are built from megatron-core's layers on
the "local" (pure PyTorch) layer spec (``gpt_layers``), so they run on CPU as well as GPU; tensor
parallelism splits attention heads, MLP columns and the vocabulary as in Megatron-LM.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

PRESETS: dict[str, dict] = {
    "tiny": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        seq_length=128, max_position_embeddings=128,
    ),
    "gpt2-125m": dict(
        num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
        seq_length=1024, max_position_embeddings=1024, openai_gelu=True,
    ),
    "llama2-7b": dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
        seq_length=4096, max_position_embeddings=4096, vocab_size=32000, **{"llama": True},
    ),
    "llama2-13b": dict(
        num_layers=40, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=13824,
        seq_length=4096, max_position_embeddings=4096, vocab_size=32000, **{"llama": True},
    ),
    "llama2-70b": dict(
        num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
        ffn_hidden_size=28672, seq_length=4096, max_position_embeddings=4096, vocab_size=32000,
        **{"llama": True},
    ),
}  # fmt: skip
_LLAMA_ARCH = dict(
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    norm_epsilon=1e-5,
)


class ModelConfigError(ValueError):
    """Model flags that do not fit together; names the flags and their values."""


@dataclass
class ModelConfig:
    """The language model's architecture (Megatron-LM flag names)."""

    num_layers: int = 2
    """--num-layers"""
    hidden_size: int = 64
    """--hidden-size"""
    num_attention_heads: int = 4
    """--num-attention-heads"""
    num_query_groups: int | None = None
    """--num-query-groups: key/value heads for grouped-query attention (None = one per head)."""
    ffn_hidden_size: int | None = None
    """--ffn-hidden-size (None = 4 x hidden size)."""
    seq_length: int = 128
    """--seq-length: tokens per training sample."""
    max_position_embeddings: int = 128
    """--max-position-embeddings: positions the model supports."""
    normalization: str = "LayerNorm"
    """--normalization: LayerNorm or RMSNorm."""
    swiglu: bool = False
    """--swiglu: SwiGLU MLP instead of GELU."""
    openai_gelu: bool = False
    """--openai-gelu: GELU's tanh approximation (OpenAI GPT-2, HF's ``gelu_new``)."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights"""
    position_embedding_type: str = "learned_absolute"
    """--position-embedding-type: learned_absolute or rope."""
    rotary_base: int = 10000
    """--rotary-base"""
    add_bias_linear: bool = True
    """Biases in linear layers (GPT-2: yes; LLaMA: --disable-bias-linear)."""
    norm_epsilon: float = 1e-5
    """--norm-epsilon"""
    init_method_std: float = 0.02
    """--init-method-std"""
    hidden_dropout: float = 0.0
    """--hidden-dropout"""
    attention_dropout: float = 0.0
    """--attention-dropout"""
    vocab_size: int | None = None
    """True vocabulary size (from the tokenizer when None)."""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by: the padded vocabulary is a multiple of this x TP."""

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        """A preset (``--model``) with explicit flags taking precedence."""
        if name not in PRESETS:
            raise ModelConfigError(f"--model {name!r} is not one of {', '.join(PRESETS)}")
        fields = dict(PRESETS[name])
        if fields.pop("llama", False):
            fields.update(_LLAMA_ARCH)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        if self.vocab_size is None:
            raise ModelConfigError("the vocabulary size is unknown: give a tokenizer")
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate(self, tensor_parallel_size: int = 1) -> None:
        """Raise ``ModelConfigError`` naming the flags when the architecture cannot be built."""
        tp = tensor_parallel_size
        groups = self.num_query_groups or self.num_attention_heads
        checks = [
            (self.hidden_size % self.num_attention_heads == 0,
             f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
             f"({self.num_attention_heads})"),
            (self.num_attention_heads % tp == 0,
             f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})"),
            (self.num_attention_heads % groups == 0,
             f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
             f"--num-query-groups ({groups})"),
            (groups % tp == 0,
             f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size "
             f"({tp})"),
            ((self.ffn_hidden_size or 4 * self.hidden_size) % tp == 0,
             f"--ffn-hidden-size ({self.ffn_hidden_size}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})"),
            (self.normalization in ("LayerNorm", "RMSNorm"),
             f"--normalization {self.normalization!r}: expected LayerNorm or RMSNorm"),
            (self.position_embedding_type in ("learned_absolute", "rope"),
             f"--position-embedding-type {self.position_embedding_type!r}: expected "
             "learned_absolute or rope"),
            (self.seq_length <= self.max_position_embeddings,
             f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
             f"({self.max_position_embeddings})"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ModelConfigError(message)


def transformer_config(
    model: ModelConfig,
    *,
    tensor_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
):
    """megatron-core's ``TransformerConfig`` for ``model`` (CPU-safe: no fused kernels).

    The config has no pipeline split: pipeline stages are DeepSpeed's (``gpt_layers``), and
    every layer gets its global layer number directly.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    model.validate(tensor_parallel_size)
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,
        activation_func=_activation(model),
        add_bias_linear=model.add_bias_linear,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        tensor_model_parallel_size=tensor_parallel_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # on CPU the full weights are drawn then split, so every TP layout starts from the same
        # model; on GPU each rank initialises its own shard in place (Megatron-LM's behaviour)
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (``--openai-gelu``)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _activation(model: ModelConfig):
    if model.swiglu:
        return torch.nn.functional.silu
    return gelu_tanh if model.openai_gelu else torch.nn.functional.gelu


def model_summary(model: ModelConfig) -> dict:
    """The resolved architecture as a plain dict (saved with runs and checkpoints)."""
    return dataclasses.asdict(model)
