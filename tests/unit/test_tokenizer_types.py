"""Megatron-LM's tokenizer types: NullTokenizer (ids are the text, --vocab-size N: N + 1 ids, end
of document N), GPTSentencePieceTokenizer (the model's ids, nothing added) and Llama2Tokenizer
(a BOS before every text), against SentencePiece itself; --vocab-size with the others."""

from __future__ import annotations

import pytest

from megatron_tempnet.data.tokenizers import (
    TokenizerConfig,
    TokenizerError,
    build_tokenizer,
)
from tests.helpers.corpus import train_sentencepiece

TEXTS = ["def f(x):\n    return x + 1\n", "Hello, world"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    return train_sentencepiece(str(tmp_path_factory.mktemp("sp")))


def test_null_tokenizer_reads_ids_and_ends_documents_with_vocab_size():
    tok = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128256).build()
    assert (tok.vocab_size, tok.eod) == (128257, 128256)  # Megatron-LM's: eod after the ids
    assert tok.tokenize_batch(["0 17 128255", " 5  6 ", ""]) == [[0, 17, 128255], [5, 6], []]
    assert tok.detokenize([3, 128256, 0]) == "3 128256 0"
    other = build_tokenizer("NullTokenizer", vocab_size=1000).identity
    assert tok.identity.tokenizer_type == "NullTokenizer" and tok.identity != other


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"tokenizer_type": "NullTokenizer"}, "--tokenizer-type NullTokenizer needs --vocab-size"),
        ({"tokenizer_type": "NullTokenizer", "vocab_size": 0}, "--vocab-size (0) must be >= 1"),
    ],
)
def test_null_tokenizer_errors_name_the_flags(spec, message):
    with pytest.raises(TokenizerError) as e:
        build_tokenizer(**spec)
    assert message in str(e.value)


def test_null_tokenizer_refuses_what_is_no_id():
    tok = build_tokenizer("NullTokenizer", vocab_size=10)
    with pytest.raises(TokenizerError, match="ids separated by spaces, got 'a b'"):
        tok.tokenize("a b")
    with pytest.raises(TokenizerError, match=r"id 11 outside \[0, 11\) \(--vocab-size 10\)"):
        tok.tokenize("10 11")


def test_sentencepiece_flavours_against_sentencepiece(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    ids = sp.encode(TEXTS)
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert plain.tokenize_batch(TEXTS) == ids and gpt.tokenize_batch(TEXTS) == ids
    assert llama.tokenize_batch(TEXTS) == [[sp.bos_id(), *i] for i in ids]
    assert sp.bos_id() >= 0 and all(i[0] != sp.bos_id() for i in ids)
    for tok in (plain, gpt, llama):
        assert (tok.vocab_size, tok.eod) == (sp.vocab_size(), sp.eos_id())
        assert tok.detokenize(tok.tokenize(TEXTS[0])) == TEXTS[0]
        # the same ids mean the same pieces: datasets of one are read by the others
        assert tok.identity == plain.identity


def test_vocab_size_with_a_tokenizer_of_files_must_be_its_size(sp_model):
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model, vocab_size=400)
    assert tok.vocab_size == 400
    with pytest.raises(TokenizerError) as e:
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model, vocab_size=128256)
    assert str(e.value) == (
        "--vocab-size 128256: --tokenizer-type GPTSentencePieceTokenizer has 400 ids; leave "
        "--vocab-size out (only NullTokenizer needs it)"
    )
    with pytest.raises(TokenizerError, match="Llama2Tokenizer needs --tokenizer-model"):
        build_tokenizer("Llama2Tokenizer")
