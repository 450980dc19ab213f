"""Tiny random ``transformers`` LLaMA (grouped-query attention; LLaMA-3.1/3.2-style RoPE scaling,
tied embeddings), Mistral and GPT-2 models, saved locally, and a tiny CLIP's config.

Every parameter is random, norms and biases included (transformers initialises those to ones and
zeros, which would hide a mapping that mixes them up).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

SHAPE = dict(hidden=64, heads=4, groups=2, layers=2, positions=64)
_TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)

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
LLAMA32_ROPE = dict(LLAMA31_ROPE, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)


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
        vocab_size=vocab_size,
        hidden_size=SHAPE["hidden"],
        intermediate_size=96,
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["groups"],
        max_position_embeddings=SHAPE["positions"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **_TOKENS,
    )


def save_hf_gpt2(
    directory: str, vocab_size: int, seed: int = 0, name: str = "hf-gpt2", **overrides
) -> str:
    """A GPT-2; ``overrides`` replace ``GPT2Config`` arguments."""
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = dict(
        vocab_size=vocab_size,
        n_positions=SHAPE["positions"],
        n_embd=SHAPE["hidden"],
        n_layer=SHAPE["layers"],
        n_head=SHAPE["heads"],
        activation_function="gelu_new",
        **_TOKENS,
    )
    config = GPT2Config(**{**shape, **overrides})
    return _save(GPT2LMHeadModel, config, os.path.join(directory, name), seed)


def hf_clip_config(
    width: int, heads: int, vocab_size: int, context: int, eos: int, channels: int, **kw
):
    """A tiny ``transformers`` ``CLIPConfig``: two QuickGELU layers of ``width`` (``heads``
    heads, FFN 4 x ``width``) per tower, 16 x 16 images of ``channels`` channels in 4 x 4
    patches, ``context`` text positions ending at the ``eos`` id (begin 0, pad 1), projection
    32; ``kw``: more ``CLIPConfig`` arguments."""
    from transformers import CLIPConfig

    tower = dict(
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=2,
        num_attention_heads=heads,
        hidden_act="quick_gelu",
    )
    text = dict(tower, vocab_size=vocab_size, max_position_embeddings=context, eos_token_id=eos)
    return CLIPConfig(
        text_config=dict(text, bos_token_id=0, pad_token_id=1),
        vision_config=dict(tower, image_size=16, patch_size=4, num_channels=channels),
        projection_dim=32,
        **kw,
    )


def _save(cls, config, path: str, seed: int) -> str:
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms around 1, biases around 0
                p.uniform_(-0.5, 0.5) if name.endswith("bias") else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def add_tokenizer(model_dir: str, tokenizer_dir: str) -> str:
    """Copy the files of an HF tokenizer directory (``corpus.save_hf_tokenizer``) into a saved
    model's directory, as a Hub model ships them; returns ``model_dir``."""
    for name in os.listdir(tokenizer_dir):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(model_dir, name))
    return model_dir


def load_hf(path: str, **config):
    """The saved model in eval mode; ``config`` overrides entries of its config.json."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **config).eval()
