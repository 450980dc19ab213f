"""Checkpoints kept as one file per rank: each file holds a rank's ``state_dict``, its split
tensors cut as Megatron cuts them (``distributed.sharding`` merges them).

- ``LegacyFiles``: Megatron-LM's legacy ``torch`` format, ``mp_rank_TT[_PPP]/
  model_optim_rng.pt`` with megatron-core's names under ``model``, the layers numbered from 0 in
  every pipeline stage (an even split), the norms under the local or Transformer Engine spec's
  names.
- ``DeepSpeedFiles``: Megatron-DeepSpeed's, saved by DeepSpeed in ``global_stepN/``: without
  pipeline stages ``mp_rank_TT_model_states.pt`` holds the model under ``module`` (Megatron's
  legacy names, nested: ``language_model.encoder.layers.0.self_attention.query_key_value``); with
  them, every layer of DeepSpeed's ``PipelineModule`` has its own
  ``layer_II-model_TT-model_states.pt`` (I: the layer's place in ``GPTModelPipe``: 1 the
  embedding, 2 .. L+1 the transformer layers, L+2 the final norm, L+3 the untied output layer).

Both give, for a ``GPTStack`` name, where it is (``find``) and each tensor-parallel rank's
shard of it (``shard``), and the names of every model tensor they hold (``keys``).
"""

from __future__ import annotations

import os
import re

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.checkpoint.file_io import load_foreign_file
from megatron_tempnet.models.gpt.layers import PieceIndex
from megatron_tempnet.models.gpt.megatron_lm.saved import (
    DS_LAYER_FILE,
    ds_rank_files,
    rank_files,
)

TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
"""``GPTStack``'s norm names -> Transformer Engine's spec (the norm fused into the linear)."""
_LEGACY_UNEVEN = (
    "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
)
"""Pipeline splits whose legacy files number layers other than evenly per stage."""
_DS_LAYER = {
    "self_attention.linear_qkv.": "self_attention.query_key_value.",
    "self_attention.linear_proj.": "self_attention.dense.",
    "pre_mlp_layernorm.": "post_attention_layernorm.",
    "mlp.linear_fc1.": "mlp.dense_h_to_4h.",
    "mlp.linear_fc2.": "mlp.dense_4h_to_h.",
}
"""``GPTStack``'s layer names -> Megatron's legacy ``ParallelTransformerLayer``'s."""


def mcore_names(name: str, at: PieceIndex) -> tuple[list[str], int | None]:
    """megatron-core's candidate names of ``GPTStack``'s ``name`` and its layer (None: not a
    layer's): the local spec's, then Transformer Engine's."""
    piece, _, rest = name.removeprefix("pieces.").partition(".")
    i = int(piece)
    if i in (at.embedding, at.embedding_output):
        return ["embedding." + rest], None
    if i == at.final_norm:
        return ["decoder.final_layernorm." + rest.removeprefix("norm.")], None
    if i == at.output:
        return [rest], None
    rest = rest.removeprefix("layer.")
    return [n for n in (rest, TE_NORMS.get(rest)) if n], i - 2


def unnumbered(key: str) -> str:
    """A layer's key without its number (``decoder.layers.3.x`` -> ``decoder.layers.x``)."""
    return re.sub(r"(layers\.)\d+\.", r"\1", key)


class LegacyFiles:
    """Megatron-LM's legacy torch format (module docstring)."""

    tied_output = "output_layer.weight"
    """The last stage's copy of tied embeddings (not a tensor of its own)."""

    def __init__(self, path: str, source: str, args, at: PieceIndex, tp: int, pp: int):
        self.source, self.at, self.tp, self.pp = source, at, tp, pp
        self.files = rank_files(path, source)
        want = {(t, p) for t in range(tp) for p in range(pp)}
        if set(self.files) != want:
            raise CheckpointError(
                f"{source}: {path} has {len(self.files)} mp_rank_* files; its args say TP {tp} "
                f"x PP {pp}"
            )
        for name in _LEGACY_UNEVEN:
            if getattr(args, name, None) not in (None, 1):
                raise CheckpointError(
                    f"{source}: a legacy torch checkpoint with {name} = {getattr(args, name)} "
                    "is not read: convert it to torch_dist with Megatron-LM "
                    "(--ckpt-convert-format torch_dist)"
                )
        if at.num_layers % pp:
            raise CheckpointError(f"{source}: {at.num_layers} layers on PP {pp}")
        self._states: dict[tuple[int, int], dict] = {}

    def _state(self, t: int, p: int) -> dict:
        if (t, p) not in self._states:
            state = load_foreign_file(self.files[(t, p)], mmap=True)
            if "model" not in state:
                raise CheckpointError(
                    f"{self.source}: {self.files[(t, p)]} has no 'model' (a checkpoint with "
                    "virtual pipeline stages, model0/model1, is not read)"
                )
            self._states[(t, p)] = state["model"]
        return self._states[(t, p)]

    def find(self, name: str) -> tuple[int, str] | None:
        """(pipeline stage, key) of ``name``."""
        names, layer = mcore_names(name, self.at)
        if layer is not None:
            per = self.at.num_layers // self.pp
            stage, prefix = layer // per, f"decoder.layers.{layer % per}."
        else:
            last = name.startswith((f"pieces.{self.at.final_norm}.", f"pieces.{self.at.output}."))
            stage, prefix = (self.pp - 1 if last else 0), ""
        state = self._state(0, stage)
        for n in names:
            if isinstance(state.get(prefix + n), torch.Tensor):
                return stage, prefix + n
        return None

    def shard(self, where: tuple[int, str], t: int) -> torch.Tensor:
        stage, key = where
        return self._state(t, stage)[key]

    def key(self, where: tuple[int, str]) -> str:
        return unnumbered(where[1])

    def keys(self) -> set[str]:
        return {
            unnumbered(k)
            for p in range(self.pp)
            for k, v in self._state(0, p).items()
            if isinstance(v, torch.Tensor)
        }


class DeepSpeedFiles:
    """Megatron-DeepSpeed's DeepSpeed checkpoints (module docstring)."""

    tied_output = None

    def __init__(self, path: str, source: str, args, at: PieceIndex, tp: int, pp: int):
        self.path, self.source, self.at, self.tp = path, source, at, tp
        ranks = ds_rank_files(path)
        layers = (DS_LAYER_FILE.match(f) for f in os.listdir(path))
        self.layers = {(int(m.group(1)), int(m.group(2))): m.group(0) for m in layers if m}
        self.piped = bool(self.layers)
        if not self.piped and set(ranks) != set(range(tp)):
            raise CheckpointError(
                f"{source}: {path} has {len(ranks)} mp_rank_XX_model_states.pt; its args say "
                f"TP {tp}"
            )
        self.ranks = ranks
        self._loaded: dict[tuple, dict] = {}

    def _file(self, index: int | None, t: int) -> dict:
        """Layer ``index``'s state (with pipeline stages), or rank ``t``'s flattened ``module``."""
        if (index, t) not in self._loaded:
            if index is None:
                module = load_foreign_file(self.ranks[t], mmap=True).get("module")
                if not isinstance(module, dict):
                    raise CheckpointError(f"{self.source}: {self.ranks[t]} holds no 'module'")
                state = _flatten(module)
            else:
                if (index, t) not in self.layers:
                    return {}
                path = os.path.join(self.path, self.layers[(index, t)])
                state = load_foreign_file(path, mmap=True)
            self._loaded[(index, t)] = state
        return self._loaded[(index, t)]

    def _names(self, name: str) -> tuple[int | None, str]:
        """(layer file index or None, key) of ``name``."""
        piece, _, rest = name.removeprefix("pieces.").partition(".")
        i, at = int(piece), self.at
        if i in (at.embedding, at.embedding_output):
            return (1, rest) if self.piped else (None, "language_model.embedding." + rest)
        if i == at.final_norm:
            rest = rest.removeprefix("norm.")
            return (
                (i, rest)
                if self.piped
                else (None, "language_model.encoder.final_layernorm." + rest)
            )
        if i == at.output:
            return (i, "lm_head.weight") if self.piped else (None, "language_model." + rest)
        rest = rest.removeprefix("layer.")
        for ours, theirs in _DS_LAYER.items():
            if rest.startswith(ours):
                rest = theirs + rest.removeprefix(ours)
        return (i, rest) if self.piped else (None, f"language_model.encoder.layers.{i - 2}.{rest}")

    def find(self, name: str) -> tuple[int | None, str] | None:
        where = self._names(name)
        return where if isinstance(self._file(where[0], 0).get(where[1]), torch.Tensor) else None

    def shard(self, where: tuple[int | None, str], t: int) -> torch.Tensor:
        return self._file(where[0], t)[where[1]]

    def key(self, where: tuple[int | None, str]) -> str:
        index, key = where
        return key if index is None else f"layer_{index:02d}.{key}"

    def keys(self) -> set[str]:
        if not self.piped:
            state = self._file(None, 0)
            return {k for k, v in state.items() if isinstance(v, torch.Tensor)}
        indices = sorted({i for i, _ in self.layers})
        return {
            f"layer_{i:02d}.{k}"
            for i in indices
            for k, v in self._file(i, 0).items()
            if isinstance(v, torch.Tensor)
        }


def _flatten(state: dict, prefix: str = "") -> dict:
    """Megatron's nested ``state_dict_for_save_checkpoint`` as flat dotted keys."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
