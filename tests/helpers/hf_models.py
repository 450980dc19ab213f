"""Tiny random ``transformers`` LLaMA (grouped-query attention; LLaMA-3.1/3.2-style RoPE scaling,
tied embeddings), Mistral and GPT-2 models, saved locally.

Every parameter is random, norms and biases included (transformers initialises those to ones and
zeros, which would hide a mapping that mixes them up).
"""

from __future__ import annotations

import json
import os

import torch

SHAPE = dict(hidden=64, heads=4, groups=2, layers=2, positions=64)

# LLaMA-3.1-style scaling on the tiny shape (head_dim 16, base 500000, wavelengths 6.3, 32, 167,
# ... positions): an original context of 16 positions with these factors keeps the fastest
# frequency (6.3 < 16 / 2), blends the second (16 / 2 < 32 < 16 / 0.25) and divides the rest by
# 4, so every branch of the scaling is used, and 24 tokens run past the original context.
LLAMA31_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=4.0,
    low_freq_factor=0.25,
    high_freq_factor=2.0,
    original_max_position_embeddings=16,
)
# LLaMA-3.2-style: Meta's factors, factor 32, the same short original context
LLAMA32_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


def save_hf_llama(
    directory: str, vocab_size: int, seed: int = 0, name: str = "hf-llama", **overrides
) -> str:
    """A LLaMA; ``overrides`` replace ``LlamaConfig`` arguments (``rope_parameters``,
    ``tie_word_embeddings``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_llama_shape(vocab_size), **overrides})
    return _save(LlamaForCausalLM, config, os.path.join(directory, name), seed)


def save_hf_mistral(directory: str, vocab_size: int, seed: int = 0) -> str:
    """A Mistral (v0.3-style: no sliding window, RoPE base 1e6)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        **_llama_shape(vocab_size),
        sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
    )
    return _save(MistralForCausalLM, config, os.path.join(directory, "hf-mistral"), seed)


def to_hub_rope_spelling(path: str) -> dict:
    """Rewrite ``path``'s config.json with RoPE as the Hub writes it (``rope_theta`` +
    ``rope_scaling``, what transformers before 5 wrote) instead of ``rope_parameters``."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config


def _llama_shape(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=SHAPE["hidden"], intermediate_size=96,
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["groups"], max_position_embeddings=SHAPE["positions"],
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip


def save_hf_gpt2(directory: str, vocab_size: int, seed: int = 0) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=SHAPE["positions"], n_embd=SHAPE["hidden"],
        n_layer=SHAPE["layers"], n_head=SHAPE["heads"], activation_function="gelu_new",
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return _save(GPT2LMHeadModel, config, os.path.join(directory, "hf-gpt2"), seed)


def _save(cls, config, path: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms around 1, biases around 0
                p.uniform_(-0.5, 0.5) if name.endswith("bias") else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def load_hf(path: str, **config):
    """The saved model in eval mode; ``config`` overrides entries of its config.json."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **config).eval()
