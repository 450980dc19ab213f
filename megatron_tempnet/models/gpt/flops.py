"""The training FLOPs of a GPT/LLaMA with TempNet, counted as Megatron-LM counts a GPT's
(``num_floating_point_operations`` of its training loop: dense layers, no MoE).

Per token, every weight of a matrix product costs 2 FLOPs (a multiply and an add) in the forward
pass and twice that in the backward pass (the input's and the weight's gradients): 6 FLOPs per
weight, over the layers' QKV, output projection and MLP, and the output layer over the padded
vocabulary (padded at the run's tensor-parallel size). The core attention adds ``QK^T`` and
``softmax(.) V``, each ``2 s q`` FLOPs per token in the forward pass for ``q = heads x head_dim``,
halved by the causal mask: ``6 L s q`` per token. TempNet's products (``W1``: ``d1`` x the true
vocabulary, ``W2``: ``d2 x d1``) count like the model's. With --freeze-lm the LM runs forward
only: 2 FLOPs per weight. Norms, activations, the softmax and the loss are not counted (nor are
they by Megatron-LM).
"""

from __future__ import annotations

from megatron_tempnet.models.gpt.config import ModelConfig


def layer_matmul_params(model: ModelConfig) -> int:
    """One transformer layer's weights in matrix products: QKV, output projection, MLP."""
    h, heads = model.hidden_size, model.num_attention_heads
    head_dim = h // heads
    groups = model.num_query_groups or heads
    ffn = model.ffn_hidden_size or 4 * h
    up = 2 * ffn if model.swiglu else ffn  # SwiGLU's gate and up projections
    return h * (heads + 2 * groups) * head_dim + heads * head_dim * h + h * up + ffn * h


def flops_per_token(
    model: ModelConfig,
    tempnet: tuple[int, int] | None,
    tensor_parallel: int = 1,
    frozen_lm: bool = False,
) -> float:
    """Training FLOPs per token, forward and backward (see the module docstring)."""
    per_weight = 2.0 if frozen_lm else 6.0
    head_dim = model.hidden_size // model.num_attention_heads
    attention = model.num_layers * model.seq_length * model.num_attention_heads * head_dim
    lm = model.num_layers * layer_matmul_params(model) + _output_params(model, tensor_parallel)
    return per_weight * (lm + attention) + 6.0 * _tempnet_params(model, tempnet)


def _output_params(model: ModelConfig, tensor_parallel: int) -> int:
    return model.padded_vocab_size(tensor_parallel) * model.hidden_size


def _tempnet_params(model: ModelConfig, tempnet: tuple[int, int] | None) -> int:
    if tempnet is None:
        return 0
    d1, d2 = tempnet
    return d1 * model.vocab_size + d2 * d1


def output_stage_flops_per_token(
    model: ModelConfig, tempnet: tuple[int, int] | None, tensor_parallel: int = 1
) -> float:
    """With --freeze-lm, the part of ``flops_per_token`` after the final hidden states: the output
    layer forward and TempNet forward and backward. An iteration that reads the hidden states
    from ``--frozen-lm-cache`` costs this."""
    return 2.0 * _output_params(model, tensor_parallel) + 6.0 * _tempnet_params(model, tempnet)
