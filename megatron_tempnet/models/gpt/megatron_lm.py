"""Megatron-LM's GPT/LLaMA checkpoints, read without Megatron-LM, at any layout.

Megatron-LM's ``--save DIR`` holds ``latest_checkpointed_iteration.txt`` (an iteration, or
``release``) naming ``DIR/iter_XXXXXXX/``, in one of two formats:

- ``torch_dist`` (megatron-core's ``dist_checkpointing``): ``.metadata`` and ``__*.distcp``
  files of ``torch.distributed.checkpoint``, ``common.pt`` (the saved ``args``) and
  ``metadata.json`` (``sharded_backend: torch_dist``). Each tensor is one global tensor under
  megatron-core's ``GPTModel`` names; the transformer layers are stacked on a leading layer
  axis (``decoder.layers.self_attention.linear_qkv.weight``: ``[L, ...]``) and the norms go by
  Transformer Engine's fused names (``...linear_qkv.layer_norm_weight``), whichever layer spec
  trained. Read with DCP's own ``FileSystemReader``, only the part of a stacked tensor a layer
  needs.
- ``torch`` (legacy): ``mp_rank_TT/model_optim_rng.pt`` (``mp_rank_TT_PPP`` with pipeline
  stages), each the ``state_dict`` of one rank's model under ``model``, its layers numbered
  from 0 in every stage, its split tensors cut as megatron-core cuts them (``distributed.
  sharding`` merges them).

Tensors are given under ``GPTStack``'s names (``checkpoint_io.lm_names``), full and with the
vocabulary unpadded, so a checkpoint saved at any TP x PP loads at any other. The model comes
from the saved ``args`` (``model_fields``); what ``GPTStack`` does not compute (experts, MLA,
QK-norm, a custom layer spec, ...) is refused by name. Optimizer, RNG and data position are not
read: a Megatron-LM checkpoint is a starting point (its weights), as with ``--finetune``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass

import torch

from megatron_tempnet.distributed.sharding import full_shape, merge, split_kind
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.layers import PieceIndex
from megatron_tempnet.trainer.checkpoint_format import CheckpointError
from megatron_tempnet.trainer.file_io import load_foreign_file

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's file naming the newest checkpoint of a --save directory."""
TORCH_DIST, TORCH = "torch_dist", "torch"
TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
"""``GPTStack``'s norm names -> Transformer Engine's spec (the norm fused into the linear)."""
_MODEL_ROOTS = ("embedding", "decoder", "output_layer")
"""The first name part of a ``GPTModel`` tensor (the optimizer's and others' are not)."""
_RANK_DIR = re.compile(r"mp_rank_(\d\d)(?:_(\d\d\d))?$")


@dataclass(frozen=True)
class Located:
    """The checkpoint directory (``iter_XXXXXXX``) a Megatron-LM ``--save`` names, its format."""

    directory: str
    format: str
    iteration: str


def locate(path: str, source: str) -> Located | None:
    """The Megatron-LM checkpoint ``path`` holds (a --save directory, or one ``iter_``
    directory); None when it holds none. Raises when it names one that cannot be read."""
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
    ("heterogeneous_layers_config_path", bool, "heterogeneous layers"),
)
"""Saved arguments whose models ``GPTStack`` does not compute: (name, refused when, what)."""
_LEGACY_UNEVEN = (
    "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
)
"""Pipeline splits whose legacy files number layers other than evenly per stage."""
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


def model_fields(args: argparse.Namespace, source: str) -> dict:
    """``ModelConfig``'s fields from Megatron-LM's saved ``args`` (the vocabulary size aside:
    the tokenizer gives it); raises, naming it, on what ``GPTStack`` does not compute."""
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
    if not isinstance(kind, str):
        return None
    spec = {"tokenizer_type": kind}
    for name in ("tokenizer_model", "vocab_file", "merge_file", "vocab_size"):
        if getattr(args, name, None) is not None:
            spec[name] = getattr(args, name)
    return spec


# ------------------------------------------------------------------ reading


class MegatronLMCheckpoint:
    """The full tensors of a Megatron-LM checkpoint under ``GPTStack``'s names.

    ``vocab_size``: the true vocabulary (its tokenizer's); the checkpoint's padded rows are
    dropped. ``model``: the ``ModelConfig`` its saved args describe, with that vocabulary.
    """

    def __init__(self, located: Located, source: str, vocab_size: int):
        self.located, self.source = located, source
        self.path = located.directory
        self._torch_dist = located.format == TORCH_DIST
        if self._torch_dist:
            from torch.distributed.checkpoint import FileSystemReader

            self._saved = FileSystemReader(self.path).read_metadata().state_dict_metadata
        else:
            self._files = _rank_files(self.path, source)
        self.args = saved_args(located, source)
        fields = model_fields(self.args, source)
        self.model = ModelConfig(**fields, vocab_size=vocab_size)
        self.tp = int(getattr(self.args, "tensor_model_parallel_size", 1) or 1)
        self.pp = int(getattr(self.args, "pipeline_model_parallel_size", 1) or 1)
        self._at = PieceIndex(self.model.num_layers)
        if not self._torch_dist:
            self._check_legacy_layout()
        self.config = {"model": self.model.__dict__.copy(), "tokenizer": tokenizer_spec(self.args)}

    def has_lm(self) -> bool:
        return True

    def has_tempnet(self) -> bool:
        return False

    def tempnet_state(self) -> dict[str, torch.Tensor]:
        return {}

    @property
    def description(self) -> str:
        return (
            f"a Megatron-LM {self.located.format} checkpoint ({self.path}, iteration "
            f"{self.located.iteration}, saved at TP {self.tp} x PP {self.pp})"
        )

    # ------------------------------------------------------------- names and shapes

    def _where(self, name: str) -> tuple[list[str], int | None]:
        """megatron-core's candidate names of ``name`` and its layer (None: not a layer's)."""
        piece, _, rest = name.removeprefix("pieces.").partition(".")
        i = int(piece)
        if i in (self._at.embedding, self._at.embedding_output):
            return ["embedding." + rest], None
        if i == self._at.final_norm:
            return ["decoder.final_layernorm." + rest.removeprefix("norm.")], None
        if i == self._at.output:
            return [rest], None
        rest = rest.removeprefix("layer.")
        return [n for n in (rest, TE_NORMS.get(rest)) if n], i - 2

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The full (unpadded) shape of ``name``; None when the checkpoint lacks it."""
        found = self._find(name)
        if found is None:
            return None
        if self._torch_dist:
            key, layer = found
            shape = tuple(self._saved[key].size)[0 if layer is None else 1 :]
        else:
            stage, key = found
            shard = self._model_state(0, stage)[key]
            kind = split_kind(name)
            shape = full_shape(kind, shard.shape, self.tp, vocab_size=self.model.vocab_size)
        if split_kind(name) == "vocab":
            shape = (self.model.vocab_size, *shape[1:])
        return shape

    def names(self, wanted: list[str]) -> dict[str, tuple[int, ...]]:
        """The shapes of ``wanted``'s names that the checkpoint holds."""
        shapes = {n: self.shape(n) for n in wanted}
        return {n: s for n, s in shapes.items() if s is not None}

    def stray(self, wanted: list[str]) -> list[str]:
        """The checkpoint's model tensors that none of ``wanted`` reads (a bias this model
        lacks, say), under megatron-core's names."""
        read = set() if self.model.untie_embeddings_and_output_weights else {"output_layer.weight"}
        for n in wanted:
            found = self._find(n)
            if found is not None:
                read.add(found[0] if self._torch_dist else _unnumbered(found[1]))
        if self._torch_dist:
            saved = {k for k, v in self._saved.items() if hasattr(v, "size")}
            model = {k for k in saved if k.split(".")[0] in _MODEL_ROOTS}
        else:
            model = {
                _unnumbered(k)
                for s in range(self.pp)
                for k, v in self._model_state(0, s).items()
                if isinstance(v, torch.Tensor)
            }
        return sorted(model - read)

    def _find(self, name: str):
        names, layer = self._where(name)
        if self._torch_dist:
            for n in names:
                if layer is not None and f"decoder.layers.{layer}.{n}" in self._saved:
                    return f"decoder.layers.{layer}.{n}", None
                key = n if layer is None else f"decoder.layers.{n}"
                if key in self._saved and hasattr(self._saved[key], "size"):
                    return key, layer
            return None
        stage, local = self._stage_of(name, layer)
        state = self._model_state(0, stage)
        for n in names:
            key = n if local is None else f"decoder.layers.{local}.{n}"
            if isinstance(state.get(key), torch.Tensor):
                return stage, key
        return None

    # ------------------------------------------------------------- tensors

    def full(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (vocabulary unpadded), in its saved dtype."""
        found = self._find(name)
        if found is None:
            raise CheckpointError(f"{self.source}: {self.path} has no tensor for {name}")
        if self._torch_dist:
            tensor = self._read_dist(*found)
        else:
            stage, key = found
            shards = [self._model_state(t, stage)[key] for t in range(self.tp)]
            tensor = merge(name, shards, swiglu=self.model.swiglu, vocab_size=self.model.vocab_size)
        if split_kind(name) == "vocab":
            if tensor.shape[0] < self.model.vocab_size:
                raise CheckpointError(
                    f"{self.source}: {name} has {tensor.shape[0]} rows, fewer than the "
                    f"tokenizer's {self.model.vocab_size} ids: another tokenizer trained it"
                )
            tensor = tensor[: self.model.vocab_size]
        return tensor.contiguous()

    def _read_dist(self, key: str, layer: int | None) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.api import CheckpointException

        from megatron_tempnet.trainer.shard_reading import BoxLoadPlanner
        from megatron_tempnet.trainer.shard_storage import Box, first_failure, single_process_quiet

        saved = self._saved[key]
        size = tuple(saved.size)
        shape = size if layer is None else (1, *size[1:])
        out = torch.empty(shape, dtype=saved.properties.dtype)
        offsets = (0,) * len(size) if layer is None else (layer,) + (0,) * (len(size) - 1)
        box = Box(key, size, offsets, out)
        try:
            with single_process_quiet():
                dcp.load(
                    {},
                    storage_reader=FileSystemReader(self.path),
                    planner=BoxLoadPlanner([box]),
                    no_dist=True,
                )
        except CheckpointException as e:
            raise CheckpointError(f"{self.source}: {key}: {first_failure(e)}") from None
        return out if layer is None else out[0]

    # ------------------------------------------------------------- the legacy files

    def _check_legacy_layout(self) -> None:
        want = {(t, p) for t in range(self.tp) for p in range(self.pp)}
        if set(self._files) != want:
            raise CheckpointError(
                f"{self.source}: {self.path} has {len(self._files)} mp_rank_* files; its args "
                f"say TP {self.tp} x PP {self.pp}"
            )
        for name in _LEGACY_UNEVEN:
            if getattr(self.args, name, None) not in (None, 1):
                raise CheckpointError(
                    f"{self.source}: a legacy torch checkpoint with {name} = "
                    f"{getattr(self.args, name)} is not read: convert it to torch_dist with "
                    "Megatron-LM (--ckpt-convert-format torch_dist)"
                )
        if self.model.num_layers % self.pp:
            raise CheckpointError(f"{self.source}: {self.model.num_layers} layers on PP {self.pp}")
        self._states: dict[tuple[int, int], dict] = {}

    def _stage_of(self, name: str, layer: int | None) -> tuple[int, int | None]:
        """The pipeline stage holding ``name``, and the layer's number in that stage."""
        if layer is not None:
            per = self.model.num_layers // self.pp
            return layer // per, layer % per
        i = int(name.removeprefix("pieces.").partition(".")[0])
        last = i in (self._at.final_norm, self._at.output)
        return (self.pp - 1 if last else 0), None

    def _model_state(self, t: int, p: int) -> dict:
        if (t, p) not in self._states:
            state = load_foreign_file(self._files[(t, p)], mmap=True)
            if "model" not in state:
                raise CheckpointError(
                    f"{self.source}: {self._files[(t, p)]} has no 'model' (a checkpoint with "
                    "virtual pipeline stages, model0/model1, is not read)"
                )
            self._states[(t, p)] = state["model"]
        return self._states[(t, p)]


def _unnumbered(key: str) -> str:
    return re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", key)


def _rank_files(directory: str, source: str) -> dict[tuple[int, int], str]:
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
    else:
        files = _rank_files(located.directory, source)
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


def open_checkpoint(path: str, source: str, vocab_size: int | None = None):
    """The Megatron-LM checkpoint in ``path`` (None when it holds none), its vocabulary
    ``vocab_size`` (default: its saved tokenizer's)."""
    located = locate(path, source)
    if located is None:
        return None
    if vocab_size is None:
        vocab_size = vocabulary(saved_args(located, source), source)
    return MegatronLMCheckpoint(located, source, vocab_size)


class TrainingWeights:
    """A Megatron-LM checkpoint as ``trainer.task.ForeignCheckpoint``: the LM's parameters
    under the training module's names (``GPTStack``'s behind ``prefix``)."""

    def __init__(self, checkpoint: MegatronLMCheckpoint, prefix: str):
        self.checkpoint, self.prefix = checkpoint, prefix
        self.path, self.description = checkpoint.path, checkpoint.description

    def _lm(self, names: list[str]) -> list[str]:
        return [n.removeprefix(self.prefix) for n in names if n.startswith(self.prefix)]

    def shapes(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        found = self.checkpoint.names(self._lm(names))
        return {self.prefix + n: shape for n, shape in found.items()}

    def stray(self, names: list[str]) -> list[str]:
        return self.checkpoint.stray(self._lm(names))

    def full(self, name: str) -> torch.Tensor:
        return self.checkpoint.full(name.removeprefix(self.prefix))


_SAME_MODEL = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "add_bias_linear",
    "swiglu",
    "openai_gelu",
    "untie_embeddings_and_output_weights",
)
"""What the weights' shapes and meaning depend on: a run reading the checkpoint has its values."""


def check_same_model(saved: ModelConfig, run: ModelConfig, source: str) -> None:
    """The run's model computes what the checkpoint's did (a RoPE base or a norm epsilon
    differs without changing a shape: loading would be silently another model)."""
    for name in _SAME_MODEL:
        mine, theirs = getattr(run, name), getattr(saved, name)
        if name == "num_query_groups":  # None: one group per head
            mine = mine or run.num_attention_heads
            theirs = theirs or saved.num_attention_heads
        if mine != theirs:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"{source}: the checkpoint's model has {flag} {theirs}, this run {mine}: give "
                f"{flag} {theirs}, or --use-checkpoint-args to take the model from it"
            )
