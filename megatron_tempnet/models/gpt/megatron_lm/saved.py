"""Where a Megatron-LM (or Megatron-DeepSpeed) checkpoint is, its format, and the model and
tokenizer its saved ``args`` describe."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.checkpoint.file_io import load_foreign_file

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's file naming the newest checkpoint of a --save directory."""
TORCH_DIST, TORCH, DEEPSPEED = "torch_dist", "torch", "deepspeed"
DS_RANK_FILE = re.compile(r"mp_rank_(\d\d)_model_states\.pt$")
"""Megatron-DeepSpeed's (DeepSpeed's) file of a tensor-parallel rank: the model without
pipeline stages (``module``), and the saved ``args``."""
DS_LAYER_FILE = re.compile(r"layer_(\d\d+)-model_(\d\d)-model_states\.pt$")
"""DeepSpeed's file of one pipeline layer of a tensor-parallel rank."""
_RANK_DIR = re.compile(r"mp_rank_(\d\d)(?:_(\d\d\d))?$")


@dataclass(frozen=True)
class Located:
    """The checkpoint directory (``iter_XXXXXXX``) a Megatron-LM ``--save`` names, its format."""

    directory: str
    format: str
    iteration: str


def locate(path: str, source: str) -> Located | None:
    """The Megatron-LM checkpoint ``path`` holds (a --save directory, or one ``iter_``
    directory; or Megatron-DeepSpeed's --save directory, whose DeepSpeed ``latest`` names
    ``global_stepN``); None when it holds none. Raises when it names one that cannot be read."""
    deepspeed = _deepspeed(path, source)
    if deepspeed is not None:
        return deepspeed
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{source}: {tracker} holds {text!r}, not an iteration")
        tag = "release" if text == "release" else f"iter_{int(text):07d}"
        directory = os.path.join(path, tag)
        if not os.path.isdir(directory):
            raise CheckpointError(f"{source}: {tracker} names {tag}, which is not there")
    elif _format(path) is not None:
        directory, text = path, os.path.basename(os.path.normpath(path))
    else:
        return None
    found = _format(directory)
    if found is None:
        raise CheckpointError(
            f"{source}: {directory} holds neither a torch_dist checkpoint (metadata.json, "
            ".metadata) nor a legacy torch one (mp_rank_XX/model_optim_rng.pt)"
        )
    return Located(directory, found, text)


def _deepspeed(path: str, source: str) -> Located | None:
    """Megatron-DeepSpeed's checkpoint: DeepSpeed's ``latest`` names ``global_stepN``."""
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag = f.read().strip()
    if not tag.startswith("global_step"):
        return None  # this project's own ``latest`` names iter_XXXXXXX
    directory = os.path.join(path, tag)
    if not os.path.isdir(directory) or not ds_rank_files(directory):
        raise CheckpointError(
            f"{source}: {latest} names {tag}, which holds no mp_rank_XX_model_states.pt"
        )
    return Located(directory, DEEPSPEED, tag.removeprefix("global_step"))


def ds_rank_files(directory: str) -> dict[int, str]:
    """``{tensor-parallel rank: mp_rank_XX_model_states.pt}`` of a DeepSpeed checkpoint."""
    files = (DS_RANK_FILE.match(f) for f in os.listdir(directory))
    return {int(m.group(1)): os.path.join(directory, m.group(0)) for m in files if m}


def _format(directory: str) -> str | None:
    meta = os.path.join(directory, "metadata.json")
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{meta} cannot be read ({e})") from None
        if backend != TORCH_DIST:
            raise CheckpointError(
                f"{meta}: sharded backend {backend!r}: Megatron-LM checkpoints are read in the "
                "torch_dist and torch formats (convert with Megatron-LM's --ckpt-convert-format "
                "torch_dist)"
            )
        return TORCH_DIST
    if os.path.isdir(directory) and any(_RANK_DIR.match(d) for d in os.listdir(directory)):
        return TORCH
    return None


# ------------------------------------------------------------------ the model from the args

_REFUSED = (
    ("num_experts", lambda v: v not in (None, 0, 1), "mixture of experts (--num-experts)"),
    ("multi_latent_attention", bool, "multi-latent attention (--multi-latent-attention)"),
    ("qk_layernorm", bool, "QK layer norm (--qk-layernorm)"),
    ("squared_relu", bool, "the squared-ReLU MLP (--squared-relu)"),
    ("rotary_interleaved", bool, "interleaved RoPE (--rotary-interleaved)"),
    ("rotary_percent", lambda v: v not in (None, 1.0), "partial RoPE (--rotary-percent)"),
    ("spec", lambda v: v is not None, "a custom layer spec (--spec)"),
    ("mtp_num_layers", lambda v: v not in (None, 0), "multi-token prediction (--mtp-num-layers)"),
    (
        "rotary_seq_len_interpolation_factor",
        lambda v: v not in (None, 1),
        "RoPE position interpolation (--rotary-seq-len-interpolation-factor)",
    ),
    ("heterogeneous_layers_config_path", bool, "heterogeneous layers"),
    (
        "apply_residual_connection_post_layernorm",
        bool,
        "the residual taken after the norm (--apply-residual-connection-post-layernorm)",
    ),
)
"""Saved arguments whose models ``GPTStack`` does not compute: (name, refused when, what)."""
_COPIED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "normalization",
    "swiglu",
    "openai_gelu",
    "add_bias_linear",
    "norm_epsilon",
    "init_method_std",
    "hidden_dropout",
    "attention_dropout",
    "apply_layernorm_1p",
    "seq_length",
    "max_position_embeddings",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "make_vocab_size_divisible_by",
)
"""Megatron-LM's arguments that are ``ModelConfig`` fields of the same name and meaning."""


def megatron_lm_args(args: argparse.Namespace, source: str) -> argparse.Namespace:
    """Megatron-DeepSpeed's saved args under Megatron-LM's names (Megatron-LM's own: as
    they are): its lower-case --normalization, --layernorm-epsilon, --num-key-value-heads,
    --use-rotary-position-embeddings with --rotary-position-embeddings-theta, and the experts
    per layer group."""
    if not hasattr(args, "num_key_value_heads") and not hasattr(args, "layernorm_epsilon"):
        return args
    out = argparse.Namespace(**vars(args))
    names = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
    out.normalization = names.get(getattr(args, "normalization", None), args.normalization)
    if getattr(args, "norm_epsilon", None) is None and hasattr(args, "layernorm_epsilon"):
        out.norm_epsilon = args.layernorm_epsilon
    groups = getattr(args, "num_key_value_heads", None)
    if groups is not None and groups != args.num_attention_heads:
        out.group_query_attention, out.num_query_groups = True, groups
    rope = getattr(args, "use_rotary_position_embeddings", False)
    learned = getattr(args, "add_position_embedding", True)
    if rope and learned:
        raise CheckpointError(
            f"{source}: the checkpoint's model adds learned positions to RoPE "
            "(--use-rotary-position-embeddings without --no-position-embedding), which this "
            "project does not build"
        )
    if not rope and not learned:
        raise CheckpointError(f"{source}: the checkpoint's model has no position embedding")
    out.position_embedding_type = "rope" if rope else "learned_absolute"
    out.rotary_base = getattr(args, "rope_theta", 10000)
    experts = getattr(args, "num_experts", None)
    if isinstance(experts, (list, tuple)):
        out.num_experts = max(experts, default=1)
    return out


def model_fields(args: argparse.Namespace, source: str) -> dict:
    """``ModelConfig``'s fields from Megatron-LM's (or Megatron-DeepSpeed's) saved ``args``
    (the vocabulary size aside: the tokenizer gives it); raises, naming it, on what
    ``GPTStack`` does not compute."""
    args = megatron_lm_args(args, source)
    for name, refused, what in _REFUSED:
        if refused(getattr(args, name, None)):
            raise CheckpointError(
                f"{source}: the checkpoint's model uses {what} ({name} = "
                f"{getattr(args, name)!r}), which this project does not build"
            )
    if getattr(args, "add_qkv_bias", False) and not getattr(args, "add_bias_linear", True):
        raise CheckpointError(
            f"{source}: the checkpoint's model has a bias on q/k/v only (--add-qkv-bias), "
            "which this project does not build"
        )
    impl = getattr(args, "transformer_impl", "local")
    if impl not in ("local", "transformer_engine"):
        raise CheckpointError(f"{source}: unknown --transformer-impl {impl!r} in the checkpoint")
    fields = {n: getattr(args, n) for n in _COPIED if getattr(args, n, None) is not None}
    heads = fields.get("num_attention_heads")
    kv = getattr(args, "kv_channels", None)
    if heads and kv not in (None, fields["hidden_size"] // heads):
        raise CheckpointError(
            f"{source}: the checkpoint's head size (--kv-channels {kv}) is not hidden size / "
            "heads, which this project requires"
        )
    if getattr(args, "group_query_attention", False):
        fields["num_query_groups"] = args.num_query_groups
    if fields.get("position_embedding_type") not in (None, "learned_absolute", "rope"):
        raise CheckpointError(
            f"{source}: position embedding {fields['position_embedding_type']!r} in the "
            "checkpoint: this project builds learned_absolute and rope"
        )
    return fields


def tokenizer_spec(args: argparse.Namespace) -> dict | None:
    """The saved tokenizer flags, as ``data.tokenizers.build_tokenizer`` takes them."""
    kind = getattr(args, "tokenizer_type", None)
    kind = "HuggingFaceTokenizer" if kind == "HFTokenizer" else kind  # Megatron-DeepSpeed's
    if not isinstance(kind, str):
        return None
    spec = {"tokenizer_type": kind}
    for name in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size"):
        if getattr(args, name, None) is not None:
            spec[name] = getattr(args, name)
    return spec


def rank_files(directory: str, source: str) -> dict[tuple[int, int], str]:
    files = {}
    for d in os.listdir(directory):
        match = _RANK_DIR.match(d)
        if match:
            path = os.path.join(directory, d, "model_optim_rng.pt")
            if not os.path.isfile(path):
                raise CheckpointError(f"{source}: {path} is missing")
            files[(int(match.group(1)), int(match.group(2) or 0))] = path
    return files


def saved_args(located: Located, source: str) -> argparse.Namespace:
    """The ``args`` a Megatron-LM checkpoint was saved with (``common.pt``, or the first
    rank's file of a legacy one)."""
    if located.format == TORCH_DIST:
        common = load_foreign_file(os.path.join(located.directory, "common.pt"))
    elif located.format == DEEPSPEED:
        files = ds_rank_files(located.directory)
        common = load_foreign_file(files[min(files)], mmap=True)
    else:
        files = rank_files(located.directory, source)
        common = load_foreign_file(files[min(files)], mmap=True)
    args = common.get("args") if isinstance(common, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{source}: {located.directory} carries no saved args")
    return args


def vocabulary(args: argparse.Namespace, source: str) -> int:
    """The true vocabulary of a Megatron-LM checkpoint: its saved tokenizer's size (Megatron-LM
    saves only the padded one)."""
    from megatron_tempnet.data.tokenizers import TokenizerError, build_tokenizer

    spec = tokenizer_spec(args)
    if spec is None:
        raise CheckpointError(
            f"{source}: its args name no tokenizer: give the tokenizer flags (--tokenizer-type "
            "and its files) for its vocabulary size"
        )
    try:
        return build_tokenizer(**spec).vocab_size
    except (TokenizerError, OSError) as e:
        raise CheckpointError(
            f"{source}: its vocabulary size is its tokenizer's ({spec}), which cannot be built "
            f"here ({e}): give the tokenizer flags (--tokenizer-type and its files)"
        ) from None
