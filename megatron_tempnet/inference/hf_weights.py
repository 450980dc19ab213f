"""Hugging Face ``transformers`` LLaMA-1/2 and GPT-2 weights <-> this project's full tensors.

Full tensors are named as in ``GPTStack`` (``pieces.{i}.…``, see ``models.sharding``): piece 0
the word embeddings, 1 the learned positions, ``2 .. L+1`` the transformer layers, ``L+2`` the
final norm, ``L+3`` the untied output layer.

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
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch

from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.trainer.checkpoint_format import CheckpointError

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
                self._open[file] = torch.load(
                    path, map_location="cpu", mmap=True, weights_only=True
                )
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


def model_config_from_hf(config: dict) -> ModelConfig:
    """This project's ``ModelConfig`` for an HF ``config.json`` (LLaMA or GPT-2)."""
    kind = config.get("model_type")
    if kind == "llama":
        if config.get("attention_bias", False) != config.get("mlp_bias", False):
            raise CheckpointError("LLaMA with attention_bias != mlp_bias is not supported")
        theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0
        )
        scaling = config.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise CheckpointError(f"rope_scaling {scaling} is not supported (LLaMA-1/2 only)")
        return ModelConfig(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=config["num_attention_heads"],
            num_query_groups=config.get("num_key_value_heads") or config["num_attention_heads"],
            ffn_hidden_size=config["intermediate_size"],
            seq_length=config["max_position_embeddings"],
            max_position_embeddings=config["max_position_embeddings"],
            normalization="RMSNorm",
            swiglu=True,
            position_embedding_type="rope",
            rotary_base=int(theta),
            add_bias_linear=bool(config.get("attention_bias", False)),
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            norm_epsilon=config["rms_norm_eps"],
            vocab_size=config["vocab_size"],
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
        )
    raise CheckpointError(f"model_type {kind!r}: only 'llama' and 'gpt2' are supported")


def architecture(model: ModelConfig) -> str:
    """``llama`` or ``gpt2``: the HF architecture with the same computation as ``model``."""
    shape = (model.normalization, model.swiglu, model.position_embedding_type)
    if shape == ("RMSNorm", True, "rope"):
        return "llama"
    if shape == ("LayerNorm", False, "learned_absolute") and model.add_bias_linear:
        return "gpt2"
    raise CheckpointError(
        "this model has no Hugging Face equivalent here: LLaMA needs RMSNorm, --swiglu and "
        "RoPE; GPT-2 LayerNorm, GELU, learned positions and biases "
        f"(got {model.normalization}, swiglu={model.swiglu}, {model.position_embedding_type}, "
        f"bias={model.add_bias_linear})"
    )


def hf_config(model: ModelConfig, dtype: torch.dtype) -> dict:
    """``config.json`` for ``model`` in Hugging Face's format."""
    dtype_name = str(dtype).removeprefix("torch.")
    tied = not model.untie_embeddings_and_output_weights
    if architecture(model) == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size,
            "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
            "num_hidden_layers": model.num_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.num_query_groups or model.num_attention_heads,
            "max_position_embeddings": model.max_position_embeddings,
            "rms_norm_eps": model.norm_epsilon,
            "rope_theta": float(model.rotary_base),
            "hidden_act": "silu",
            "attention_bias": model.add_bias_linear,
            "mlp_bias": model.add_bias_linear,
            "tie_word_embeddings": tied,
            "dtype": dtype_name,
        }
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


def _layer_map(model: ModelConfig) -> dict[str, str]:
    """Our layer-relative name -> HF's layer-relative name (single-tensor correspondences)."""
    if architecture(model) == "llama":
        names = {
            "input_layernorm.weight": "input_layernorm.weight",
            "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
            "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
            "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        }
        if model.add_bias_linear:
            names["self_attention.linear_proj.bias"] = "self_attn.o_proj.bias"
            names["mlp.linear_fc2.bias"] = "mlp.down_proj.bias"
        return names
    return {
        "input_layernorm.weight": "ln_1.weight",
        "input_layernorm.bias": "ln_1.bias",
        "self_attention.linear_proj.weight": "attn.c_proj.weight",
        "self_attention.linear_proj.bias": "attn.c_proj.bias",
        "pre_mlp_layernorm.weight": "ln_2.weight",
        "pre_mlp_layernorm.bias": "ln_2.bias",
        "mlp.linear_fc1.weight": "mlp.c_fc.weight",
        "mlp.linear_fc1.bias": "mlp.c_fc.bias",
        "mlp.linear_fc2.weight": "mlp.c_proj.weight",
        "mlp.linear_fc2.bias": "mlp.c_proj.bias",
    }


def _transposed(hf_name: str) -> bool:
    """GPT-2's Conv1D weights (``[in, out]``)."""
    return hf_name.endswith("weight") and any(p in hf_name for p in ("c_attn", "c_proj", "c_fc"))


def from_hf(model: ModelConfig, hf: HFWeights) -> Callable[[str], torch.Tensor]:
    """``full(name)``: our full tensor ``name``, read from ``hf`` when asked."""
    llama = architecture(model) == "llama"
    L, heads = model.num_layers, model.num_attention_heads
    groups = model.num_query_groups or heads
    top = "model." if llama else "transformer."
    layer_map = _layer_map(model)

    def get(name: str) -> torch.Tensor:
        tensor = hf.get(top + name, name)  # old GPT-2 files lack the "transformer." prefix
        return tensor.t() if _transposed(name) else tensor

    def full(name: str) -> torch.Tensor:
        index, rest = int(name.split(".")[1]), name.split(".", 2)[2]
        if index == 0:
            return get("embed_tokens.weight" if llama else "wte.weight")
        if index == 1:
            return get("wpe.weight")
        if index == L + 2:
            return get(("norm." if llama else "ln_f.") + rest.split(".", 1)[1])
        if index == L + 3:
            return hf.get("lm_head.weight")
        layer = f"layers.{index - 2}." if llama else f"h.{index - 2}."
        rest = rest.removeprefix("layer.")
        if rest in layer_map:
            return get(layer + layer_map[rest])
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            if llama:
                q, k, v = (get(f"{layer}self_attn.{p}_proj.{kind}") for p in "qkv")
            else:
                q, k, v = get(f"{layer}attn.c_attn.{kind}").chunk(3, dim=0)
            return _group_qkv(q, k, v, groups)
        if rest.startswith("mlp.linear_fc1.") and llama:
            kind = rest.rsplit(".", 1)[1]
            gate, up = get(f"{layer}mlp.gate_proj.{kind}"), get(f"{layer}mlp.up_proj.{kind}")
            return torch.cat([gate, up])
        raise CheckpointError(f"no Hugging Face tensor maps to {name!r}")

    return full


def to_hf(
    model: ModelConfig, full: Callable[[str], torch.Tensor], names: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of the HF model, from our full tensors."""
    llama = architecture(model) == "llama"
    L, heads = model.num_layers, model.num_attention_heads
    groups = model.num_query_groups or heads
    top = "model." if llama else "transformer."
    layer_map = _layer_map(model)

    def out(hf_name: str, tensor: torch.Tensor):
        return top + hf_name, (tensor.t() if _transposed(hf_name) else tensor).contiguous()

    for name in names:
        index, rest = int(name.split(".")[1]), name.split(".", 2)[2]
        tensor = full(name)
        if index == 0:
            yield out("embed_tokens.weight" if llama else "wte.weight", tensor)
        elif index == 1:
            yield out("wpe.weight", tensor)
        elif index == L + 2:
            yield out(("norm." if llama else "ln_f.") + rest.split(".", 1)[1], tensor)
        elif index == L + 3:
            yield "lm_head.weight", tensor.contiguous()
        else:
            layer = f"layers.{index - 2}." if llama else f"h.{index - 2}."
            rest = rest.removeprefix("layer.")
            kind = rest.rsplit(".", 1)[1]
            if rest in layer_map:
                yield out(layer + layer_map[rest], tensor)
            elif rest.startswith("self_attention.linear_qkv."):
                q, k, v = _ungroup_qkv(tensor, heads, groups)
                if llama:
                    for p, t in zip("qkv", (q, k, v)):
                        yield out(f"{layer}self_attn.{p}_proj.{kind}", t)
                else:
                    yield out(f"{layer}attn.c_attn.{kind}", torch.cat([q, k, v]))
            elif rest.startswith("mlp.linear_fc1.") and llama:
                gate, up = tensor.chunk(2, dim=0)
                yield out(f"{layer}mlp.gate_proj.{kind}", gate)
                yield out(f"{layer}mlp.up_proj.{kind}", up)
            else:
                raise CheckpointError(f"no Hugging Face tensor for {name!r}")
