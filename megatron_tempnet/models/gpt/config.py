"""GPT-2, LLaMA-1/2/3 and Mistral architectures: the config, the ``--model`` presets, flags that
rebuild one.

GPT-2: learned absolute positions, LayerNorm, GELU MLP with biases, input and output embeddings
tied. LLaMA: RoPE, RMSNorm, SwiGLU MLP without biases, untied embeddings, grouped-query attention
(``num_query_groups`` key/value heads). LLaMA-3 changes the numbers (128256 tokens, RoPE base
500000, 8 key/value groups at every size); LLaMA-3.1 and 3.2 add RoPE frequency scaling
(``--use-rope-scaling``, ``models.rope.Llama3RopeScaling``) and 3.2 ties the embeddings.
Mistral-7B (v0.3, no sliding window) is the LLaMA computation with its own numbers. All are built
from megatron-core's layers (``layers``); tensor parallelism splits attention heads, MLP columns
and the vocabulary as in Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tempnet.models.rope import Llama3RopeScaling, Rope
from megatron_tempnet.models.transformer import (
    ModelConfigError,
    TransformerShape,
    padded_vocab_size,
    preset_fields,
)
from megatron_tempnet.utils.flags import derived, option

_NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)
_TINY = dict(
    _NO_DROPOUT,
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
    hidden_dropout=0.1,
    attention_dropout=0.1,
)
_LLAMA = dict(
    _NO_DROPOUT,
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
_LLAMA3 = dict(
    _LLAMA,
    vocab_size=128256,
    rotary_base=500000,
    num_query_groups=8,
    seq_length=8192,
    max_position_embeddings=8192,
)
# 3.1 and 3.2: trained at 8192 positions, scaled to 131072
_LLAMA31 = dict(
    _LLAMA3,
    max_position_embeddings=131072,
    use_rope_scaling=True,
    rope_scaling_factor=8.0,
    rope_scaling_low_freq_factor=1.0,
    rope_scaling_high_freq_factor=4.0,
    rope_scaling_original_max_position_embeddings=8192,
)
_LLAMA32 = dict(_LLAMA31, rope_scaling_factor=32.0, untie_embeddings_and_output_weights=False)
_LLAMA3_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336)
_LLAMA3_70B = dict(num_layers=80, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672)
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
    "llama3-8b": dict(_LLAMA3, **_LLAMA3_8B),
    "llama3-70b": dict(_LLAMA3, **_LLAMA3_70B),
    "llama3.1-8b": dict(_LLAMA31, **_LLAMA3_8B),
    "llama3.1-70b": dict(_LLAMA31, **_LLAMA3_70B),
    "llama3.1-405b": dict(
        _LLAMA31, num_layers=126, hidden_size=16384, num_attention_heads=128, ffn_hidden_size=53248
    ),
    "llama3.2-1b": dict(
        _LLAMA32, num_layers=16, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=8192
    ),
    "llama3.2-3b": dict(
        _LLAMA32, num_layers=28, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192
    ),
    # v0.3: no sliding window; max_position_embeddings is its config's, 8192 tokens per sample
    "mistral-7b": dict(
        _LLAMA,
        vocab_size=32768,
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        rotary_base=1000000,
        seq_length=8192,
        max_position_embeddings=32768,
        hf_model_type="mistral",
    ),
}
"""``--model``: architectures by name; every other model flag overrides its preset's value."""

HF_MODEL_TYPES = ("llama", "mistral", "gpt2")

SHAPE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "seq_length",
    "max_position_embeddings",
)
"""Sizes: a checkpoint's where the command line gives none (--use-checkpoint-args)."""

STRUCTURE = (
    "num_query_groups",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "add_bias_linear",
    "swiglu",
    "openai_gelu",
    "quick_gelu",
    "untie_embeddings_and_output_weights",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "hf_model_type",
)
"""What the weights' shapes and meaning depend on: always a checkpoint's
(--use-checkpoint-args)."""


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
    rotary_base: int = option(10000, aliases=("--rotary-position-embeddings-theta",))
    """RoPE's base (Megatron-DeepSpeed: --rotary-position-embeddings-theta)."""
    use_rope_scaling: bool = False
    """Scale RoPE's frequencies as LLaMA-3.1 and 3.2 do (Hugging Face's rope_type llama3), with
    the four --rope-scaling-* values."""
    rope_scaling_factor: float = 8.0
    """What the slowest RoPE frequencies are divided by (--use-rope-scaling; LLaMA-3.1: 8,
    LLaMA-3.2: 32)."""
    rope_scaling_low_freq_factor: float = 1.0
    """Frequencies that turn at most this many times over
    --rope-scaling-original-max-position-embeddings are divided by the whole factor."""
    rope_scaling_high_freq_factor: float = 4.0
    """Frequencies that turn at least this many times over
    --rope-scaling-original-max-position-embeddings are kept; those in between are blended."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """The context length the model was first trained at, which the scaling extends."""
    vocab_size: int | None = derived()
    """The true vocabulary size (from the tokenizer)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this x the tensor-parallel size (padded columns are
    excluded from every loss)."""
    hf_model_type: str | None = derived()
    """The Hugging Face model_type the model is exported as (llama, mistral or gpt2; None: llama
    or gpt2 by its shape). Set by --model mistral-7b and by the Hugging Face import; it does not
    change the computation."""

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        """A preset (``--model``) with the given values (None: the preset's) taking precedence."""
        return cls(**preset_fields(PRESETS, name, overrides))

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        return padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, tensor_parallel_size
        )

    def rope(self) -> Rope | None:
        """The layers' rotary embedding (None: learned absolute positions)."""
        if self.position_embedding_type != "rope":
            return None
        scaling = None
        if self.use_rope_scaling:
            scaling = Llama3RopeScaling(
                factor=self.rope_scaling_factor,
                low_freq_factor=self.rope_scaling_low_freq_factor,
                high_freq_factor=self.rope_scaling_high_freq_factor,
                original_max_position_embeddings=self.rope_scaling_original_max_position_embeddings,
            )
        return Rope(base=self.rotary_base, scaling=scaling)

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
        if self.hf_model_type not in (None, *HF_MODEL_TYPES):
            raise ModelConfigError(
                f"hf_model_type {self.hf_model_type!r}: expected one of {', '.join(HF_MODEL_TYPES)}"
            )
        if self.use_rope_scaling:
            self._validate_rope_scaling()

    def _validate_rope_scaling(self) -> None:
        low, high = self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor
        checks = [
            (
                self.position_embedding_type == "rope",
                "--use-rope-scaling needs --position-embedding-type rope (got "
                f"{self.position_embedding_type})",
            ),
            (
                self.rope_scaling_factor >= 1,
                f"--rope-scaling-factor ({self.rope_scaling_factor}) must be >= 1",
            ),
            (
                0 < low < high,
                f"--rope-scaling-low-freq-factor ({low}) must be > 0 and < "
                f"--rope-scaling-high-freq-factor ({high})",
            ),
            (
                self.rope_scaling_original_max_position_embeddings >= 1,
                "--rope-scaling-original-max-position-embeddings "
                f"({self.rope_scaling_original_max_position_embeddings}) must be >= 1",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ModelConfigError(message)


def model_flags(model: ModelConfig) -> list[str]:
    """``pretrain_gpt.py`` flags that build exactly ``model`` (vocabulary from the tokenizer)."""
    pairs = [
        ("--num-layers", model.num_layers),
        ("--hidden-size", model.hidden_size),
        ("--num-attention-heads", model.num_attention_heads),
        ("--ffn-hidden-size", model.ffn_size()),
        ("--max-position-embeddings", model.max_position_embeddings),
        ("--normalization", model.normalization),
        ("--norm-epsilon", model.norm_epsilon),
        ("--position-embedding-type", model.position_embedding_type),
        ("--hidden-dropout", model.hidden_dropout),
        ("--attention-dropout", model.attention_dropout),
    ]
    grouped = model.num_query_groups and model.num_query_groups != model.num_attention_heads
    if grouped:
        pairs.append(("--num-query-groups", model.num_query_groups))
    if model.position_embedding_type == "rope":
        pairs.append(("--rotary-base", model.rotary_base))
    if model.use_rope_scaling:
        pairs += [
            ("--rope-scaling-factor", model.rope_scaling_factor),
            ("--rope-scaling-low-freq-factor", model.rope_scaling_low_freq_factor),
            ("--rope-scaling-high-freq-factor", model.rope_scaling_high_freq_factor),
            (
                "--rope-scaling-original-max-position-embeddings",
                model.rope_scaling_original_max_position_embeddings,
            ),
        ]
    switches = {
        "--swiglu": model.swiglu,
        "--openai-gelu": model.openai_gelu,
        "--untie-embeddings-and-output-weights": model.untie_embeddings_and_output_weights,
        "--use-rope-scaling": model.use_rope_scaling,
        "--disable-bias-linear": not model.add_bias_linear,
        "--group-query-attention": bool(grouped),
        "--apply-layernorm-1p": model.apply_layernorm_1p,
    }
    flags = [str(x) for pair in pairs for x in pair]
    return flags + [flag for flag, on in switches.items() if on]
