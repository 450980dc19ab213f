"""Core attention on PyTorch's fused ``scaled_dot_product_attention`` (the ``auto`` backend).

megatron-core's local ``DotProductAttention`` (``--attention-backend unfused``) computes the
scores ``[b, heads/tp, s, s]`` with a batched GEMM, a masked softmax and a second GEMM, and keeps
the softmax for the backward pass: ``s^2`` memory per head and layer. ``FusedCoreAttention``
computes the same ``softmax(q k^T / sqrt(d)) v`` with ``torch.nn.functional.
scaled_dot_product_attention``, which on a GPU dispatches to the flash or memory-efficient
kernels and on a CPU to PyTorch's fused (flash) CPU kernel: neither stores the ``s x s``
probabilities; the backward pass recomputes them block by block.

It plugs into megatron-core's layer specs as the ``core_attention`` submodule of
``SelfAttention`` (same constructor and ``forward`` contract as ``DotProductAttention``):
causal for GPT/LLaMA and CLIP's text tower, no mask for the ViT, grouped-query attention without
repeating keys and values, attention dropout from megatron-core's model-parallel RNG tracker
(as the unfused module draws it).

Generation keeps every layer's keys and values in a ``KVCache``. The cache reaches the core
attention as the layer's ``attention_mask`` argument, which megatron-core's ``TransformerLayer``
and ``SelfAttention`` hand down unchanged: the layers, their weights and their RoPE are the ones
training uses, and only the core attention reads and writes the cache. (megatron-core's own
``StaticInferenceContext`` keeps one sequence offset for the whole batch and allocates on CUDA;
a batch of prompts of different lengths needs a position per sequence.)
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from torch import nn

ATTENTION_BACKENDS = ("auto", "unfused")


class FusedCoreAttention(nn.Module):
    """``softmax(q k^T * scale [+ mask]) v`` per head with one fused kernel.

    ``forward(query [sq, b, np, hn], key [sk, b, ng, hn], value [sk, b, ng, hn], attention_mask)``
    -> ``[sq, b, np * hn]`` where ``np``/``ng`` are this TP rank's query heads / key-value groups.
    ``attention_mask`` (megatron-core's convention: True = masked out) is only needed for masks
    other than causal / none.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if config.context_parallel_size != 1:
            raise ValueError("--attention-backend auto does not support context parallelism")
        tp = pg_collection.tp.size() if pg_collection is not None else _tp_size()
        self.config = config
        self.layer_number = layer_number
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.causal = attn_mask_type == AttnMaskType.causal
        self.scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if isinstance(attention_mask, KVCache):
            return attention_mask.attend(self, query, key, value)
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "--attention-backend auto: attention bias and packed sequences are not supported"
            )
        sq, b = query.shape[:2]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)
        mask, causal = self._mask(attention_mask, sq, k.shape[2], q.device)
        p = self.dropout if self.training else 0.0
        with _dropout_rng(p, self.config.sequence_parallel):
            return self.attend(q, k, v, mask, causal, p)

    def attend(self, q, k, v, mask, causal: bool, dropout_p: float = 0.0) -> torch.Tensor:
        """The kernel on ``q [b, np, sq, hn]``, ``k``/``v`` ``[b, ng, sk, hn]`` ->
        ``[sq, b, np * hn]``."""
        context = nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=self.heads != self.groups,
        )  # [b, np, sq, hn]
        sq, b = q.shape[2], q.shape[0]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _mask(self, attention_mask, sq: int, sk: int, device) -> tuple[torch.Tensor | None, bool]:
        """(boolean mask, True = attend; is_causal) for the kernel."""
        if attention_mask is not None:
            return ~attention_mask.bool(), False
        if not self.causal:
            return None, False
        if sq == sk:
            return None, True
        # queries are the last sq of sk positions (a cache of earlier keys): the causal diagonal
        # sits at the bottom right, where is_causal would put it at the top left
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq), False


class KVCache:
    """Keys and values of every layer for a batch of sequences being generated.

    ``keys``/``values``: ``[layers, b, groups/tp, length, head_dim]`` (this TP rank's key/value
    heads). Before each forward pass, ``at(positions)`` says where the pass's tokens go: one start
    position for the whole batch (the prompt, right-padded, from 0; or the next token of sequences
    that are all equally long), or one position per sequence (``[b]``, one new token each). Keys
    of a sequence past its own position are never attended to: they are padding of the prompt
    batch, overwritten by that sequence's later tokens.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        groups: int,
        head_dim: int,
        length: int,
        dtype: torch.dtype,
        device,
    ):
        shape = (num_layers, batch, groups, length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = length
        self._start: int | None = 0
        self._rows = torch.arange(batch, device=device)
        self._positions: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._end = 0

    def at(self, positions: int | torch.Tensor) -> None:
        """The next pass writes from ``positions``: an int (every sequence) or ``[b]`` (one new
        token per sequence)."""
        if isinstance(positions, int):
            self._start, self._positions, self._mask = positions, None, None
            return
        self._start = None
        self._positions = positions.to(self._rows.device)
        self._end = int(positions.max()) + 1
        keys = torch.arange(self._end, device=self._rows.device)
        self._mask = (keys[None] <= self._positions[:, None])[:, None, None]  # [b, 1, 1, end]

    def attend(self, core, query, key, value) -> torch.Tensor:
        """``FusedCoreAttention`` over the cached keys: stores this pass's ``key``/``value``
        (``[s, b, groups, hn]``) and attends ``query`` (``[s, b, heads, hn]``) to every key up to
        each query's position. -> ``[s, b, heads * hn]``."""
        layer = core.layer_number - 1
        sq, b = query.shape[:2]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sq, hn]
        v = value.permute(1, 2, 0, 3)
        mask, causal = None, False
        if self._start is None:  # one new token per sequence, each at its own position
            self.keys[layer, self._rows, :, self._positions] = k[:, :, 0]
            self.values[layer, self._rows, :, self._positions] = v[:, :, 0]
            end, mask = self._end, self._mask
        else:
            start, end = self._start, self._start + sq
            if end > self.length:
                raise ValueError(f"KVCache: position {end - 1} is past its length {self.length}")
            self.keys[layer, :, :, start:end] = k
            self.values[layer, :, :, start:end] = v
            if start > 0 and sq > 1:  # queries are the last sq of end positions
                mask = torch.ones(sq, end, dtype=torch.bool, device=q.device).tril(start)
        if self._start == 0:  # the prompt: its own keys, causal
            keys, values, causal = k, v, sq > 1
        else:
            keys, values = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        return core.attend(q, keys, values, mask, causal)


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _dropout_rng(p: float, sequence_parallel: bool):
    """megatron-core's model-parallel RNG for attention dropout (heads differ across TP ranks)."""
    import contextlib

    if p == 0.0 or sequence_parallel:
        return contextlib.nullcontext()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().fork()


def layer_spec(normalization: str, backend: str, causal: bool = True, *, own_norm: bool = False):
    """megatron-core's local ``TransformerLayer`` spec with the chosen core attention.

    ``backend``: ``auto`` (``FusedCoreAttention``) or ``unfused`` (megatron-core's
    ``DotProductAttention``); ``causal=False`` gives bidirectional attention (the ViT).
    ``own_norm``: the layers' two norms (and ``FinalNorm``, built from the spec) are
    ``models.norms.Norm``, which supports ``--apply-layernorm-1p`` and ``--sequence-parallel``
    (megatron-core's local torch norm refuses both); the function is the same.
    """
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend!r}: expected one of {ATTENTION_BACKENDS}")
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    attention = spec.submodules.self_attention
    if not causal:
        attention.params = {"attn_mask_type": AttnMaskType.no_mask}
    if backend == "auto":
        attention.submodules.core_attention = FusedCoreAttention
    if own_norm:
        from megatron_tempnet.models.norms import Norm

        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = Norm
    return spec
