"""RoPE's frequencies for any LLaMA-3.1-style scaling.

megatron-core's ``RotaryEmbedding`` applies LLaMA-3.1's frequency scaling with
``rope_scaling=True``, but its constructor passes only the factor to the scaling helper, which
then uses low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192
whatever the model's values. The subclass here takes the inverse frequencies from the caller
instead (``models.rope.Llama3RopeScaling`` computes them for any values) and sets
``inv_freq``, the instance attribute from which every angle is computed.
"""

from __future__ import annotations

import functools


@functools.cache
def rotary_embedding_class() -> type:
    """megatron-core's ``RotaryEmbedding`` with the caller's inverse frequencies.

    ``cls(frequencies, **kwargs)``: ``kwargs`` are ``RotaryEmbedding``'s (without
    ``rope_scaling``); ``frequencies`` maps its unscaled inverse frequencies (``[d/2]`` float32,
    ``base^(-2i/d)``) to the ones every angle is computed from (``position x inv_freq``).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class ScaledRotaryEmbedding(RotaryEmbedding):
        """``RotaryEmbedding`` whose ``inv_freq`` is ``frequencies(base^(-2i/d))``."""

        def __init__(self, frequencies, **kwargs):
            super().__init__(rope_scaling=False, **kwargs)
            self.inv_freq = frequencies(self.inv_freq)

    return ScaledRotaryEmbedding
