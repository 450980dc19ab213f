"""Hugging Face ``transformers`` LLaMA-1/2/3, Mistral and GPT-2 weights <-> this project's full
tensors.

Full tensors are named as in ``GPTStack`` (``pieces.{i}.…``, ``i`` from
``models.gpt.layers.PieceIndex``; split over TP ranks by ``distributed.sharding``). One table,
``_name_map``, gives each of them its HF tensors and how they map both ways; ``from_hf`` and
``to_hf`` both read it:

- Attention: megatron-core keeps q, k and v in one ``linear_qkv`` weight, grouped by key/value
  head: for each of the ``G`` query groups, its ``H/G`` query heads, then its key head, then its
  value head (``[G * (H/G + 2) * d, h]``). HF keeps ``q_proj [H d, h]``, ``k_proj``, ``v_proj
  [G d, h]`` (LLaMA) or one ``c_attn`` Conv1D ``[h, 3h]`` holding ``[q | k | v]`` (GPT-2).
- Rotary embeddings: HF's LLaMA rotates the two halves of each head (``rotate_half``); its
  conversion script already permuted Meta's interleaved q/k rows into that layout. megatron-core's
  non-interleaved RoPE (``rotary_interleaved=False``, what this project builds) uses the same
  halves, so the q/k rows map without a permutation (tested: logits equal HF's).
- SwiGLU: ``linear_fc1 = [gate_proj; up_proj]`` (megatron-core applies ``silu`` to the first half).
- GPT-2's Conv1D weights are stored ``[in, out]``: transposed here.
- ``--apply-layernorm-1p``: the norms multiply by ``1 + weight``; HF's by their weight. The export
  writes ``1 + weight`` and the import into such a model subtracts 1 (in float32).

Configs (``model_config_from_hf``, ``hf_config``): ``model_type`` llama and mistral are the same
computation here (Mistral's tensors have LLaMA's names); the type is kept in
``ModelConfig.hf_model_type`` so that an export writes it back. RoPE's settings are read in both
spellings, the Hub's ``rope_theta`` + ``rope_scaling`` and transformers 5's ``rope_parameters``,
and written in the Hub's (which both read). Only what the model computes is accepted: plain RoPE
or the ``llama3`` scaling, SiLU, ``head_dim = hidden_size / num_attention_heads``, no sliding
window, biases on all linear layers or none; anything else is refused by name. ``pretraining_tp``
is accepted: it only splits transformers 4's matrix products into slices (transformers 5 ignores
it), the function is the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.checkpoint.file_io import load_file
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.layers import PieceIndex, piece_key

_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


class HFWeights:
    """Lazy access to a Hugging Face model directory's tensors (safetensors or ``.bin``)."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise CheckpointError(f"--hf-dir {hf_dir}: no config.json (not a model directory)")
        with open(os.path.join(hf_dir, "config.json")) as f:
            self.config = json.load(f)
        found = next((f for f in _FILES if os.path.isfile(os.path.join(hf_dir, f))), None)
        if found is None:
            raise CheckpointError(f"--hf-dir {hf_dir}: none of {', '.join(_FILES)}")
        if found.endswith(".index.json"):
            with open(os.path.join(hf_dir, found)) as f:
                self.where = json.load(f)["weight_map"]
        else:
            self.where = None
            self._single = found
        self._open: dict[str, object] = {}

    def _file(self, name: str) -> str | None:
        if self.where is None:
            return self._single
        return self.where.get(name)

    def _handle(self, file: str):
        if file not in self._open:
            path = os.path.join(self.dir, file)
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                self._open[file] = safe_open(path, framework="pt")
            else:
                self._open[file] = load_file(path, mmap=True)  # never unpickles code
        return self._open[file]

    def get(self, *names: str) -> torch.Tensor:
        """The first of ``names`` present (checkpoints differ in their prefixes)."""
        for name in names:
            file = self._file(name)
            if file is None:
                continue
            handle = self._handle(file)
            if hasattr(handle, "get_tensor"):
                if name in handle.keys():
                    return handle.get_tensor(name)
            elif name in handle:
                return handle[name]
        raise CheckpointError(f"--hf-dir {self.dir}: tensor {names[0]!r} not found")


_LLAMA_TYPES = ("llama", "mistral")
_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def model_config_from_hf(config: dict) -> ModelConfig:
    """This project's ``ModelConfig`` for an HF ``config.json`` (LLaMA, Mistral or GPT-2).

    Raises ``CheckpointError`` naming the key and its value for a setting the model here does not
    compute (see the module's docstring).
    """
    kind = config.get("model_type")
    if kind in _LLAMA_TYPES:
        _check_llama_config(config, kind)
        heads = config["num_attention_heads"]
        return ModelConfig(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            ffn_hidden_size=config["intermediate_size"],
            seq_length=config["max_position_embeddings"],
            max_position_embeddings=config["max_position_embeddings"],
            normalization="RMSNorm",
            swiglu=True,
            position_embedding_type="rope",
            add_bias_linear=bool(config.get("attention_bias", False)),
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            norm_epsilon=config["rms_norm_eps"],
            vocab_size=config["vocab_size"],
            hf_model_type=kind,
            # LLaMA and Mistral: no dropout on the residual stream, their attention dropout
            hidden_dropout=0.0,
            attention_dropout=float(config.get("attention_dropout", 0.0)),
            **_rope_fields(config),
        )
    if kind == "gpt2":
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"GPT-2 activation_function {act!r} is not supported")
        return ModelConfig(
            num_layers=config["n_layer"],
            hidden_size=config["n_embd"],
            num_attention_heads=config["n_head"],
            ffn_hidden_size=config.get("n_inner") or 4 * config["n_embd"],
            seq_length=config["n_positions"],
            max_position_embeddings=config["n_positions"],
            norm_epsilon=config["layer_norm_epsilon"],
            vocab_size=config["vocab_size"],
            openai_gelu=act != "gelu",
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True),
            hidden_dropout=float(config.get("resid_pdrop", 0.1)),
            attention_dropout=float(config.get("attn_pdrop", 0.1)),
        )
    raise CheckpointError(f"model_type {kind!r}: only 'llama', 'mistral' and 'gpt2' are supported")


def _check_llama_config(config: dict, kind: str) -> None:
    """Refuse the LLaMA/Mistral settings the model here does not compute."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{kind} hidden_act {act!r}: only 'silu' (SwiGLU) is supported")
    attention_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    if bool(attention_bias) != bool(mlp_bias):
        raise CheckpointError(
            f"{kind} attention_bias={attention_bias} with mlp_bias={mlp_bias}: the model has "
            "biases on every linear layer or on none (--disable-bias-linear)"
        )
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise CheckpointError(
            f"{kind} head_dim={head_dim}: only hidden_size / num_attention_heads "
            f"({hidden} / {heads} = {hidden // heads}) is supported"
        )
    window = config.get("sliding_window")
    if window is not None and config.get("use_sliding_window", True):
        raise CheckpointError(
            f"{kind} sliding_window={window}: sliding-window attention is not supported (only "
            "full causal attention, sliding_window null)"
        )
    layers = [t for t in config.get("layer_types") or () if t != "full_attention"]
    if layers:
        raise CheckpointError(
            f"{kind} layer_types holds {sorted(set(layers))}: only full_attention is supported"
        )


def _rope_settings(config: dict) -> tuple[dict, dict]:
    """RoPE's settings from every spelling: top-level ``rope_theta`` (and
    ``partial_rotary_factor``), transformers 5's ``rope_parameters`` and the Hub's
    ``rope_scaling`` (``type`` read as ``rope_type``). -> (settings, the key each came from);
    a setting given twice must have one value."""
    top = {k: config[k] for k in ("rope_theta", "partial_rotary_factor") if k in config}
    merged: dict = {}
    where: dict = {}
    for source, values in (
        ("config.json", top),
        ("rope_parameters", config.get("rope_parameters")),
        ("rope_scaling", config.get("rope_scaling")),
    ):
        for key, value in (values or {}).items():
            if value is None:  # as not given
                continue
            key = "rope_type" if key == "type" else key
            if isinstance(value, dict):
                raise CheckpointError(
                    f"{source} holds RoPE settings per layer type ({key!r}): only one RoPE for "
                    "every layer is supported"
                )
            if key in merged and merged[key] != value:
                raise CheckpointError(
                    f"{where[key]} gives {key}={merged[key]!r} and {source} gives "
                    f"{key}={value!r}: the config must agree with itself"
                )
            merged[key], where[key] = value, source
    return merged, where


def _rope_fields(config: dict) -> dict:
    """``ModelConfig``'s RoPE fields (``rotary_base``, ``use_rope_scaling``,
    ``rope_scaling_*``) for a LLaMA/Mistral config."""
    settings, where = _rope_settings(config)
    kind = settings.pop("rope_type", None) or "default"
    if kind not in ("default", "llama3"):
        raise CheckpointError(
            f"{where['rope_type']} rope_type {kind!r}: only 'default' and 'llama3' (LLaMA-3.1 "
            "and 3.2's frequency scaling) are supported"
        )
    theta = settings.pop("rope_theta", 10000.0)
    if float(theta) != int(theta) or theta <= 0:
        raise CheckpointError(
            f"{where.get('rope_theta', 'config.json')} rope_theta={theta!r}: --rotary-base takes a "
            "positive integer"
        )
    partial = settings.pop("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise CheckpointError(
            f"{where['partial_rotary_factor']} partial_rotary_factor={partial!r}: only RoPE over "
            "the whole head (1.0) is supported"
        )
    fields: dict = {"rotary_base": int(theta)}
    if kind == "llama3":
        # transformers' rule: a top-level value wins, else max_position_embeddings
        original = config.get("original_max_position_embeddings") or settings.get(
            "original_max_position_embeddings", config["max_position_embeddings"]
        )
        settings["original_max_position_embeddings"] = original
        missing = [k for k in _LLAMA3_ROPE if k not in settings]
        if missing:
            raise CheckpointError(
                f"{where['rope_type']} rope_type 'llama3' lacks {', '.join(missing)}"
            )
        fields.update(
            use_rope_scaling=True,
            rope_scaling_factor=float(settings.pop("factor")),
            rope_scaling_low_freq_factor=float(settings.pop("low_freq_factor")),
            rope_scaling_high_freq_factor=float(settings.pop("high_freq_factor")),
            rope_scaling_original_max_position_embeddings=int(
                settings.pop("original_max_position_embeddings")
            ),
        )
    if settings:
        listed = ", ".join(f"{where.get(k, 'config.json')} {k}={v!r}" for k, v in settings.items())
        raise CheckpointError(f"RoPE setting(s) {listed} not supported with rope_type {kind!r}")
    return fields


def architecture(model: ModelConfig) -> str:
    """``llama``, ``mistral`` or ``gpt2``: the HF model type with the same computation as
    ``model`` (``mistral`` when ``model.hf_model_type`` says so, for a LLaMA-shaped model)."""
    shape = (model.normalization, model.swiglu, model.position_embedding_type)
    if shape == ("RMSNorm", True, "rope"):
        kind = model.hf_model_type or "llama"
        if kind not in _LLAMA_TYPES:
            raise CheckpointError(
                f"hf_model_type {kind!r} does not fit a LLaMA-shaped model (RMSNorm, SwiGLU, "
                "RoPE): export it as llama or mistral (--hf-model-type)"
            )
        if kind == "mistral" and model.add_bias_linear:
            raise CheckpointError(
                "Mistral has no biases: export this model (with biases) as --hf-model-type llama"
            )
        return kind
    if shape == ("LayerNorm", False, "learned_absolute") and model.add_bias_linear:
        if model.hf_model_type not in (None, "gpt2"):
            raise CheckpointError(
                f"hf_model_type {model.hf_model_type!r} does not fit a GPT-2-shaped model"
            )
        return "gpt2"
    raise CheckpointError(
        "this model has no Hugging Face equivalent here: LLaMA needs RMSNorm, --swiglu and "
        "RoPE; GPT-2 LayerNorm, GELU, learned positions and biases "
        f"(got {model.normalization}, swiglu={model.swiglu}, {model.position_embedding_type}, "
        f"bias={model.add_bias_linear})"
    )


def _rope_scaling(model: ModelConfig) -> dict | None:
    """The Hub's ``rope_scaling`` entry (None: plain RoPE)."""
    if not model.use_rope_scaling:
        return None
    return {
        "rope_type": "llama3",
        "factor": model.rope_scaling_factor,
        "low_freq_factor": model.rope_scaling_low_freq_factor,
        "high_freq_factor": model.rope_scaling_high_freq_factor,
        "original_max_position_embeddings": model.rope_scaling_original_max_position_embeddings,
    }


def hf_config(model: ModelConfig, dtype: torch.dtype) -> dict:
    """``config.json`` for ``model`` in Hugging Face's format (RoPE in the Hub's spelling)."""
    dtype_name = str(dtype).removeprefix("torch.")
    tied = not model.untie_embeddings_and_output_weights
    kind = architecture(model)
    if kind in _LLAMA_TYPES:
        config = {
            "architectures": ["MistralForCausalLM" if kind == "mistral" else "LlamaForCausalLM"],
            "model_type": kind,
            "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size,
            "intermediate_size": model.ffn_size(),
            "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.num_query_groups or model.num_attention_heads,
            "head_dim": model.hidden_size // model.num_attention_heads,
            "max_position_embeddings": model.max_position_embeddings,
            "rms_norm_eps": model.norm_epsilon,
            "rope_theta": float(model.rotary_base),
            "rope_scaling": _rope_scaling(model),
            "hidden_act": "silu",
            "tie_word_embeddings": tied,
            "dtype": dtype_name,
        }
        if kind == "mistral":
            config["sliding_window"] = None
        else:
            config.update(attention_bias=model.add_bias_linear, mlp_bias=model.add_bias_linear)
        return config
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.max_position_embeddings,
        "n_embd": model.hidden_size,
        "n_layer": model.num_layers,
        "n_head": model.num_attention_heads,
        "n_inner": model.ffn_hidden_size,
        "layer_norm_epsilon": model.norm_epsilon,
        "activation_function": "gelu_new" if model.openai_gelu else "gelu",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": tied,
        "dtype": dtype_name,
    }


def _group_qkv(q, k, v, groups: int) -> torch.Tensor:
    """``[H d, ...]``, ``[G d, ...]`` x 2 -> megatron-core's grouped ``[G (H/G + 2) d, ...]``."""
    tail = q.shape[1:]
    q, k, v = (t.reshape(groups, -1, *tail) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _ungroup_qkv(qkv, heads: int, groups: int):
    tail = qkv.shape[1:]
    d = qkv.shape[0] // (heads + 2 * groups)
    per_group = qkv.reshape(groups, -1, *tail)
    q, k, v = per_group.split([heads // groups * d, d, d], dim=1)
    return (t.reshape(-1, *tail).contiguous() for t in (q, k, v))


def _one(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0]


def _alone(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor]


@dataclass(frozen=True)
class _TensorMap:
    """One of our full tensors and the Hugging Face tensors it is made of, both ways."""

    hf: tuple[str, ...]
    """HF's names, after ``prefix``."""
    prefix: str = ""
    """``model.`` (LLaMA), ``transformer.`` (GPT-2; old files lack it) or none (``lm_head``)."""
    merge: Callable[[list[torch.Tensor]], torch.Tensor] = _one
    """HF's tensors (in ``hf``'s order, Conv1D weights transposed) -> ours."""
    split: Callable[[torch.Tensor], list[torch.Tensor]] = _alone
    """Ours -> HF's tensors (before Conv1D weights are transposed): the inverse of ``merge``."""
    conv1d: bool = False
    """GPT-2's Conv1D weight, stored ``[in, out]``: transposed both ways."""
    norm: bool = False
    """A norm's weight: shifted by 1 with ``--apply-layernorm-1p``."""

    def read(self, hf: HFWeights) -> torch.Tensor:
        """Our tensor, from HF's."""
        tensors = []
        for name in self.hf:
            # without the prefix too: old GPT-2 files lack "transformer."
            tensor = hf.get(self.prefix + name, name) if self.prefix else hf.get(name)
            tensors.append(tensor.t() if self.conv1d else tensor)
        return self.merge(tensors)

    def write(self, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF's name, HF's tensor)`` for each of HF's tensors, from ours."""
        for name, part in zip(self.hf, self.split(tensor), strict=True):
            yield self.prefix + name, (part.t() if self.conv1d else part).contiguous()


def _layer_map(model: ModelConfig) -> dict[str, _TensorMap]:
    """Our name inside a ``TransformerPiece``'s ``layer`` -> its map (HF's names inside a
    layer, no prefix)."""
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    if architecture(model) in _LLAMA_TYPES:
        maps = {
            "input_layernorm.weight": _TensorMap(("input_layernorm.weight",), norm=True),
            "pre_mlp_layernorm.weight": _TensorMap(("post_attention_layernorm.weight",), norm=True),
        }
        for p in ("weight", "bias") if model.add_bias_linear else ("weight",):
            maps[f"self_attention.linear_qkv.{p}"] = _TensorMap(
                tuple(f"self_attn.{x}_proj.{p}" for x in "qkv"),
                merge=lambda t: _group_qkv(*t, groups),
                split=lambda t: list(_ungroup_qkv(t, heads, groups)),
            )
            maps[f"self_attention.linear_proj.{p}"] = _TensorMap((f"self_attn.o_proj.{p}",))
            maps[f"mlp.linear_fc1.{p}"] = _TensorMap(  # SwiGLU: [gate_proj; up_proj]
                (f"mlp.gate_proj.{p}", f"mlp.up_proj.{p}"),
                merge=torch.cat,
                split=lambda t: list(t.chunk(2, dim=0)),
            )
            maps[f"mlp.linear_fc2.{p}"] = _TensorMap((f"mlp.down_proj.{p}",))
        return maps
    maps = {}
    for p in ("weight", "bias"):
        weight = p == "weight"  # GPT-2: every linear layer's weight is a Conv1D's
        maps[f"input_layernorm.{p}"] = _TensorMap((f"ln_1.{p}",), norm=weight)
        maps[f"self_attention.linear_qkv.{p}"] = _TensorMap(  # one [q | k | v]
            (f"attn.c_attn.{p}",),
            merge=lambda t: _group_qkv(*t[0].chunk(3, dim=0), groups),
            split=lambda t: [torch.cat(list(_ungroup_qkv(t, heads, groups)))],
            conv1d=weight,
        )
        maps[f"self_attention.linear_proj.{p}"] = _TensorMap((f"attn.c_proj.{p}",), conv1d=weight)
        maps[f"pre_mlp_layernorm.{p}"] = _TensorMap((f"ln_2.{p}",), norm=weight)
        maps[f"mlp.linear_fc1.{p}"] = _TensorMap((f"mlp.c_fc.{p}",), conv1d=weight)
        maps[f"mlp.linear_fc2.{p}"] = _TensorMap((f"mlp.c_proj.{p}",), conv1d=weight)
    return maps


def _name_map(model: ModelConfig) -> dict[str, _TensorMap]:
    """Our full tensor's name (``pieces.{i}.…``) -> its ``_TensorMap``: the one table that
    ``from_hf`` and ``to_hf`` both read."""
    llama = architecture(model) in _LLAMA_TYPES
    top = "model." if llama else "transformer."
    at = PieceIndex(model.num_layers)
    embedding = "embed_tokens.weight" if llama else "wte.weight"
    maps = {piece_key(at.embedding, "word_embeddings.weight"): _TensorMap((embedding,), top)}
    if not llama:
        positions = piece_key(at.embedding_output, "position_embeddings.weight")
        maps[positions] = _TensorMap(("wpe.weight",), top)
    layer_map = _layer_map(model)
    for i in range(model.num_layers):
        layer = f"layers.{i}." if llama else f"h.{i}."
        for ours, m in layer_map.items():
            hf = tuple(layer + name for name in m.hf)
            maps[piece_key(at.layer(i), f"layer.{ours}")] = replace(m, hf=hf, prefix=top)
    final_norm = "norm." if llama else "ln_f."
    for p in ("weight",) if llama else ("weight", "bias"):
        maps[piece_key(at.final_norm, f"norm.{p}")] = _TensorMap(
            (final_norm + p,), top, norm=p == "weight"
        )
    if model.untie_embeddings_and_output_weights:
        maps[piece_key(at.output, "output_layer.weight")] = _TensorMap(("lm_head.weight",))
    return maps


def _shift(tensor: torch.Tensor, by: float) -> torch.Tensor:
    """``tensor + by`` in float32 (``--apply-layernorm-1p``'s norm weights)."""
    return (tensor.float() + by).to(tensor.dtype)


def from_hf(model: ModelConfig, hf: HFWeights) -> Callable[[str], torch.Tensor]:
    """``full(name)``: our full tensor ``name``, read from ``hf`` when asked."""
    maps = _name_map(model)

    def full(name: str) -> torch.Tensor:
        if name not in maps:
            raise CheckpointError(f"no Hugging Face tensor maps to {name!r}")
        tensor = maps[name].read(hf)
        if model.apply_layernorm_1p and maps[name].norm:
            return _shift(tensor, -1)  # our zero-centred weight
        return tensor

    return full


def to_hf(
    model: ModelConfig, full: Callable[[str], torch.Tensor], names: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of the HF model, from our full tensors (each read
    once, in ``names``' order)."""
    maps = _name_map(model)
    for name in names:
        tensor = full(name)
        if name not in maps:
            raise CheckpointError(f"no Hugging Face tensor for {name!r}")
        if model.apply_layernorm_1p and maps[name].norm:
            tensor = _shift(tensor, 1)  # what the norm multiplies by
        yield from maps[name].write(tensor)
