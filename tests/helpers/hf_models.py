"""Tiny random ``transformers`` LLaMA (grouped-query attention) and GPT-2 models, saved locally.

Every parameter is random, norms and biases included (transformers initialises those to ones and
zeros, which would hide a mapping that mixes them up).
"""

from __future__ import annotations

import os

import torch

SHAPE = dict(hidden=64, heads=4, groups=2, layers=2, positions=64)


def save_hf_llama(directory: str, vocab_size: int, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=SHAPE["hidden"], intermediate_size=96,
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["groups"], max_position_embeddings=SHAPE["positions"],
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return _save(LlamaForCausalLM, config, os.path.join(directory, "hf-llama"), seed)


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


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
