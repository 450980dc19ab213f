"""``GPTStack``'s state-dict names (``pieces.{i}.…``): every reader and writer of LM weights
goes by them."""

from __future__ import annotations

from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.layers import PieceIndex, piece_key

WORD_EMBEDDINGS = piece_key(PieceIndex.embedding, "word_embeddings.weight")
"""The LM's first tensor: a checkpoint without it holds TempNet only."""


def lm_names(model: ModelConfig) -> list[str]:
    """The LM's state-dict keys in ``GPTStack`` (``pieces.{i}.…``), in order."""
    at = PieceIndex(model.num_layers)
    bias = model.add_bias_linear
    norm = ["weight", "bias"] if model.normalization == "LayerNorm" else ["weight"]
    linear = ["weight", "bias", "_extra_state"] if bias else ["weight", "_extra_state"]
    names = [WORD_EMBEDDINGS]
    tied = not model.untie_embeddings_and_output_weights
    if tied:
        names.append(piece_key(at.embedding, "output_layer._extra_state"))
    if model.position_embedding_type == "learned_absolute":
        names.append(piece_key(at.embedding_output, "position_embeddings.weight"))
    for i in range(model.num_layers):
        layer = piece_key(at.layer(i), "layer.")
        names += [layer + "input_layernorm." + n for n in norm]
        for part in ("self_attention.linear_proj", "self_attention.linear_qkv"):
            names += [f"{layer}{part}.{n}" for n in linear]
        names += [layer + "pre_mlp_layernorm." + n for n in norm]
        for part in ("mlp.linear_fc1", "mlp.linear_fc2"):
            names += [f"{layer}{part}.{n}" for n in linear]
    names += [piece_key(at.final_norm, f"norm.{n}") for n in norm]
    if not tied:
        names += [piece_key(at.output, f"output_layer.{n}") for n in ("weight", "_extra_state")]
    return names
