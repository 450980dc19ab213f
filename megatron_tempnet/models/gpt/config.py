"""GPT-2 and LLaMA-1/2 architectures: the config, the ``--model`` presets, flags that rebuild one.

GPT-2: learned absolute positions, LayerNorm, GELU MLP with biases, input and output embeddings
tied. LLaMA: RoPE, RMSNorm, SwiGLU MLP without biases, untied embeddings, grouped-query attention
(``num_query_groups`` key/value heads). Both are built from megatron-core's layers (``layers``);
tensor parallelism splits attention heads, MLP columns and the vocabulary as in Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tempnet.models.transformer import (
    ModelConfigError,
    TransformerShape,
    padded_vocab_size,
    preset_fields,
)
from megatron_tempnet.utils.flags import derived, option

_TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=256,
    seq_length=128,
    max_position_embeddings=128,
)
_GPT2_125M = dict(
    num_layers=12,
    hidden_size=768,
    num_attention_heads=12,
    ffn_hidden_size=3072,
    seq_length=1024,
    max_position_embeddings=1024,
    openai_gelu=True,
)
_LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    norm_epsilon=1e-5,
    seq_length=4096,
    max_position_embeddings=4096,
    vocab_size=32000,
)
PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "gpt2-125m": _GPT2_125M,
    "llama2-7b": dict(
        _LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008
    ),
    "llama2-13b": dict(
        _LLAMA, num_layers=40, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=13824
    ),
    "llama2-70b": dict(
        _LLAMA,
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=28672,
    ),
}
"""``--model``: architectures by name; every other model flag overrides its preset's value."""


@dataclass
class ModelConfig(TransformerShape):
    """The language model's architecture (Megatron-LM's flag names)."""

    seq_length: int = 128
    """Tokens per training sample."""
    max_position_embeddings: int = 128
    """Positions the model supports (learned positions, RoPE's range)."""
    untie_embeddings_and_output_weights: bool = False
    """A separate output layer instead of the input embedding's weight (LLaMA)."""
    position_embedding_type: str = option("learned_absolute", choices=("learned_absolute", "rope"))
    """Learned absolute positions (GPT-2) or rotary embeddings (LLaMA)."""
    rotary_base: int = 10000
    """RoPE's base."""
    vocab_size: int | None = derived()
    """The true vocabulary size (from the tokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this x the tensor-parallel size (padded columns are
    excluded from every loss)."""

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        """A preset (``--model``) with the given values (None: the preset's) taking precedence."""
        return cls(**preset_fields(PRESETS, name, overrides))

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        return padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, tensor_parallel_size
        )

    def validate(self, tensor_parallel_size: int = 1) -> None:
        """Raise ``ModelConfigError`` naming the flags when the model cannot be built."""
        super().validate(tensor_parallel_size)
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ModelConfigError(
                f"--position-embedding-type {self.position_embedding_type!r}: expected "
                "learned_absolute or rope"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ModelConfigError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})"
            )


def model_flags(model: ModelConfig) -> list[str]:
    """``pretrain_gpt.py`` flags that build exactly ``model`` (vocabulary from the tokenizer)."""
    pairs = [
        ("--num-layers", model.num_layers),
        ("--hidden-size", model.hidden_size),
        ("--num-attention-heads", model.num_attention_heads),
        ("--ffn-hidden-size", model.ffn_hidden_size or 4 * model.hidden_size),
        ("--max-position-embeddings", model.max_position_embeddings),
        ("--normalization", model.normalization),
        ("--norm-epsilon", model.norm_epsilon),
        ("--position-embedding-type", model.position_embedding_type),
    ]
    if model.num_query_groups and model.num_query_groups != model.num_attention_heads:
        pairs.append(("--num-query-groups", model.num_query_groups))
    if model.position_embedding_type == "rope":
        pairs.append(("--rotary-base", model.rotary_base))
    switches = {
        "--swiglu": model.swiglu,
        "--openai-gelu": model.openai_gelu,
        "--untie-embeddings-and-output-weights": model.untie_embeddings_and_output_weights,
        "--disable-bias-linear": not model.add_bias_linear,
    }
    flags = [str(x) for pair in pairs for x in pair]
    return flags + [flag for flag, on in switches.items() if on]
