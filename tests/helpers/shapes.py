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


def parity_model(arch: str, seq: int, vocab: int, llama_ffn: int, **kw):
    """The ``tiny`` preset as GPT-2 (OpenAI's GeLU) or LLaMA (``LLAMA_SHAPE``, FFN
    ``llama_ffn``) of ``seq`` positions and ``vocab`` ids, without dropout (parity needs the same
    function); ``kw``: more ``ModelConfig`` fields."""
    from megatron_tempnet.models.gpt import ModelConfig

    shape = dict(
        vocab_size=vocab,
        seq_length=seq,
        max_position_embeddings=seq,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        openai_gelu=arch == "gpt2",
    )
    if arch == "llama":
        shape.update(LLAMA_SHAPE, ffn_hidden_size=llama_ffn)
    return ModelConfig.from_preset("tiny", **{**shape, **kw})
