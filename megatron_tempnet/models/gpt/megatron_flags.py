"""pretrain_gpt.py's other Megatron-LM spellings, and the rules that keep the model what was asked.

``GPTSpellings`` are flags of Megatron-LM, Megatron-DeepSpeed and the official TempNet code for
what the project builds under its own flags (``--use-rotary-position-embeddings`` is
``--position-embedding-type rope``); each field's docstring reads ``<meaning>. Here: <what it
maps to>``, printed at start-up when a command line gives it.

The rules (``model_problems``, ``model_notes``):

- without ``--model`` no preset fills anything: the shape flags Megatron-LM requires are
  required, the others take Megatron-LM's defaults (``--ffn-hidden-size`` 4 x hidden, or
  int(8 x hidden / 3 / 64) x 64 with ``--swiglu``; learned absolute positions; LayerNorm);
- with ``--model X`` every preset value a flag overrides is listed once at start-up;
- a LLaMA-style model (SwiGLU or RMSNorm) left at learned absolute positions says so, and how to
  get RoPE; ``--num-query-groups`` without ``--group-query-attention`` is an error (Megatron-LM
  ignores it silently).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_tempnet.models.gpt.config import PRESETS
from megatron_tempnet.models.transformer import ATTENTION_SPELLINGS
from megatron_tempnet.trainer.megatron_flags import spelling_notes
from megatron_tempnet.utils.flags import option

REQUIRED_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")
"""The shape flags Megatron-LM requires (and --seq-length, which its GPT data needs)."""


@dataclass
class GPTSpellings:
    """Megatron-LM's, Megatron-DeepSpeed's and TempNet's flags for what pretrain_gpt.py builds."""

    use_rotary_position_embeddings: bool = False
    """Megatron-LM's older spelling of --position-embedding-type rope. Here: the same."""
    add_position_embedding: bool = option(True, name="--no-position-embedding")
    """Megatron-LM: no learned absolute positions (deprecated there, allowed with RoPE only).
    Here: the same, with RoPE only."""
    group_query_attention: bool = False
    """Megatron-LM: grouped-query attention with --num-query-groups key/value heads (default
    1). Here: the same."""
    num_key_value_heads: int | None = None
    """Megatron-DeepSpeed: key/value heads. Here: --group-query-attention --num-query-groups
    N."""
    kv_channels: int | None = None
    """Megatron-LM: each attention head's width (default: --hidden-size /
    --num-attention-heads). Here: that width only."""
    use_flash_attn: bool = option(False, aliases=("--use-flash-attn-v2", "--use-flash-attn-triton"))
    """Megatron-LM: FlashAttention (Megatron-DeepSpeed: also --use-flash-attn-v2 and its Triton
    version, --use-flash-attn-triton). Here: --attention-backend flash (PyTorch's fused attention,
    the flash kernel on GPUs)."""
    rotary_percent: float = 1.0
    """Megatron-LM: the share of each head RoPE rotates. Here: 1.0 only (partial RoPE is not
    built)."""
    masked_softmax_fusion: bool = option(True, name="--no-masked-softmax-fusion")
    """Megatron-LM: turn off the fused scale-mask-softmax. Here: no effect (no attention backend
    uses that fusion)."""
    apply_rope_fusion: bool = option(True, name="--no-rope-fusion")
    """Megatron-LM: turn off the fused RoPE kernel. Here: no effect (RoPE is applied unfused)."""
    cross_entropy_loss_fusion: bool = False
    """Megatron-LM: the fused vocabulary-parallel cross-entropy. Here: the loss is always fused
    with the output layer (the fused output stage; --no-fused-output-stage turns it off)."""
    apply_query_key_layer_scaling: bool = False
    """Megatron-LM: scale Q K^T by 1 / layer number in float16 and undo it in the softmax. Here:
    no effect (the same probabilities: the softmax runs in float32)."""
    query_key_layer_scaling: bool = option(True, name="--no-query-key-layer-scaling")
    """Megatron-DeepSpeed: no query-key layer scaling. Here: no effect (none is applied)."""
    attention_softmax_in_fp32: bool = False
    """Megatron-LM: the attention softmax in float32. Here: always (PyTorch's fused attention
    and megatron-core's softmax accumulate in float32)."""
    use_tempnet: bool = False
    """The official TempNet code's LLaMA-2 switch: train TempNet on the frozen LM with the DRO
    loss. Here: --freeze-lm --loss dro --tau-source tempnet."""


def apply(args: argparse.Namespace, given: set[str]) -> None:
    """Set the project's flags the ``GPTSpellings`` map to (conflicts: ``model_problems``)."""
    if args.use_rotary_position_embeddings and "position_embedding_type" not in given:
        args.position_embedding_type = "rope"
    if args.num_key_value_heads is not None:
        args.group_query_attention = True
        if "num_query_groups" not in given:
            args.num_query_groups = args.num_key_value_heads
    if args.group_query_attention and args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron-LM's default
    if args.use_flash_attn and "attention_backend" not in given:
        args.attention_backend = "flash"
    if args.use_tempnet:  # a contradicting --loss or --tau-source stays (model_problems)
        args.freeze_lm = True
        if "loss" not in given:
            args.loss = "dro"
        if "tau_source" not in given:
            args.tau_source = "tempnet"


def required_shape() -> tuple[str, ...]:
    """The model fields a command line without --model must give."""
    return (*REQUIRED_SHAPE, "seq_length")


def infer_tokenizer(args: argparse.Namespace) -> None:
    """GPT-2's BPE when --vocab-file and --merge-file are given without --tokenizer-type (only
    that tokenizer reads both; Megatron-LM's GPT-3 example gives no type)."""
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"
        args.inferred_tokenizer = True


def model_problems(args: argparse.Namespace, given: set[str]) -> list[str]:
    """What the model flags ask for that cannot be built or would silently differ."""
    out = []
    from_checkpoint = getattr(args, "use_checkpoint_args", False)
    if args.model is None and not from_checkpoint:
        missing = [n for n in required_shape() if getattr(args, n) is None]
        if missing:
            flags = " ".join("--" + n.replace("_", "-") for n in missing)
            out.append(
                f"{flags}: required without --model (Megatron-LM's rule; or start from a preset, "
                f"--model {{{','.join(sorted(PRESETS))}}})"
            )
    out += _conflicts(args, given)
    if args.rotary_percent != 1.0:
        out.append(f"--rotary-percent {args.rotary_percent}: partial RoPE is not built (1.0 only)")
    # the store_false flag: False when --no-position-embedding is given
    if not args.no_position_embedding and _value(args, "position_embedding_type") != "rope":
        out.append(
            "--no-position-embedding: allowed with --position-embedding-type rope only (as in "
            "Megatron-LM); give --position-embedding-type rope"
        )
    gqa_preset = args.model is not None and "num_query_groups" in PRESETS[args.model]
    if "num_query_groups" in given and not (args.group_query_attention or gqa_preset):
        out.append(
            f"--num-query-groups {args.num_query_groups} needs --group-query-attention "
            "(Megatron-LM ignores it without): give both"
        )
    out += _kv_channels(args)
    return out


def _conflicts(args: argparse.Namespace, given: set[str]) -> list[str]:
    pairs = [
        (
            args.use_rotary_position_embeddings and "position_embedding_type" in given,
            args.position_embedding_type != "rope",
            "--use-rotary-position-embeddings contradicts --position-embedding-type "
            f"{args.position_embedding_type}",
        ),
        (
            args.num_key_value_heads is not None and "num_query_groups" in given,
            args.num_query_groups != args.num_key_value_heads,
            f"--num-key-value-heads {args.num_key_value_heads} contradicts --num-query-groups "
            f"{args.num_query_groups}",
        ),
        (
            args.use_flash_attn and "attention_backend" in given,
            args.attention_backend not in ("flash", "auto"),
            f"--use-flash-attn contradicts --attention-backend {args.attention_backend}",
        ),
        (
            args.use_tempnet,
            "loss" in given
            and args.loss != "dro"
            or "tau_source" in given
            and args.tau_source != "tempnet",
            f"--use-tempnet trains TempNet with the DRO loss: it contradicts --loss {args.loss} "
            f"--tau-source {args.tau_source}",
        ),
    ]
    return [message for applies, differs, message in pairs if applies and differs]


def _kv_channels(args: argparse.Namespace) -> list[str]:
    hidden, heads = _value(args, "hidden_size"), _value(args, "num_attention_heads")
    if args.kv_channels is None or hidden is None or not heads:
        return []
    if args.kv_channels * heads != hidden:
        return [
            f"--kv-channels {args.kv_channels}: heads of another width than --hidden-size "
            f"({hidden}) / --num-attention-heads ({heads}) are not built"
        ]
    return []


def _value(args: argparse.Namespace, name: str):
    """A model flag's value: the command line's, else the preset's, else None."""
    value = getattr(args, name)
    if value is None and args.model is not None:
        value = PRESETS[args.model].get(name)
    return value


def model_notes(args: argparse.Namespace, given: set[str]) -> list[str]:
    """Start-up lines: the spellings' mappings, the preset overrides, the defaults that differ
    from Megatron-LM's or from what a LLaMA-style model would want."""
    lines = spelling_notes(GPTSpellings, args, given)
    if getattr(args, "inferred_tokenizer", False):
        lines.append(
            "--tokenizer-type GPT2BPETokenizer: the one tokenizer that reads "
            "--vocab-file and --merge-file"
        )
    backend = getattr(args, "attention_backend", None)
    if backend in ATTENTION_SPELLINGS:
        lines.append(
            f"--attention-backend {backend}: computed by --attention-backend "
            f"{ATTENTION_SPELLINGS[backend]}"
        )
    if args.model is not None:
        preset = PRESETS[args.model]
        for name in sorted(given):
            if name in preset and getattr(args, name) != preset[name]:
                flag = "--" + name.replace("_", "-")
                lines.append(
                    f"{flag} {getattr(args, name)} overrides --model {args.model}'s {preset[name]}"
                )
    llama_like = _value(args, "swiglu") or _value(args, "normalization") == "RMSNorm"
    if llama_like and _value(args, "position_embedding_type") in (None, "learned_absolute"):
        lines.append(
            "learned absolute positions (--position-embedding-type learned_absolute, "
            "Megatron-LM's default) with --swiglu / --normalization RMSNorm: LLaMA's rotary "
            "embeddings are --position-embedding-type rope"
        )
    if not ({"loss", "tau_source"} & given) and not args.use_tempnet:
        lines.append(
            "objective: the KL-DRO loss with TempNet's per-token temperature (--loss dro "
            "--tau-source tempnet, this project's default); Megatron-LM's cross-entropy: --loss ce"
        )
    return lines
