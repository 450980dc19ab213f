"""Model shapes the tests share (on top of the ``tiny`` preset)."""

LLAMA_SHAPE = dict(
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    num_query_groups=2,
)
"""LLaMA's computation: RoPE, RMSNorm, SwiGLU, no biases, untied embeddings, 4 heads sharing 2
key/value groups."""
