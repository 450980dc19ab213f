"""Rotary position embeddings: megatron-core's ``RotaryEmbedding`` (``Rope``), with LLaMA-3.1's
frequency scaling (``Llama3RopeScaling``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """LLaMA-3.1's RoPE frequency scaling (Hugging Face's ``rope_type: llama3``).

    With ``n = original_max_position_embeddings * f / (2 pi)`` the turns a frequency ``f`` makes
    over the original context: ``f`` is kept where ``n >= high_freq_factor`` (short wavelengths),
    divided by ``factor`` where ``n <= low_freq_factor`` (long ones), and in between
    ``f ((1 - w) / factor + w)`` with ``w = (n - low_freq_factor) / (high_freq_factor -
    low_freq_factor)``: over ``factor`` x the original context the slow frequencies turn as far as
    they did over the original context, while the fast ones keep their resolution.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def inverse_frequencies(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Unscaled ``[d/2]`` inverse frequencies -> the scaled ones (same dtype and device)."""
        turns = self.original_max_position_embeddings * inv_freq / (2 * math.pi)  # [d/2]
        keep = (turns - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        keep = keep.clamp(0.0, 1.0)  # 0: divide by factor, 1: keep, blended in between
        return (1 - keep) * inv_freq / self.factor + keep * inv_freq


@dataclass(frozen=True)
class Rope:
    """A layer's rotary embedding: megatron-core's ``RotaryEmbedding`` of ``base`` over the whole
    head (not interleaved), its frequencies optionally scaled."""

    base: int
    scaling: Llama3RopeScaling | None = None

    def build(self, config) -> nn.Module:
        """The embedding for megatron-core ``config``'s heads: ``module(s)`` -> ``[s, 1, 1, d]``
        angles of positions ``0 .. s-1``."""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        from megatron_tempnet.compat import rotary_embedding_class

        kwargs = dict(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=self.base,
            use_cpu_initialization=config.use_cpu_initialization,
        )
        if self.scaling is None:
            return RotaryEmbedding(**kwargs)
        return rotary_embedding_class()(self.scaling.inverse_frequencies, **kwargs)
