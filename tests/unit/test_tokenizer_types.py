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
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert gpt.tokenize_batch(TEXTS) == ids
    assert llama.tokenize_batch(TEXTS) == [[sp.bos_id(), *i] for i in ids]
    assert sp.bos_id() >= 0 and all(i[0] != sp.bos_id() for i in ids)
    for tok in (gpt, llama):
        assert (tok.vocab_size, tok.eod) == (sp.vocab_size(), sp.eos_id())
        assert tok.detokenize(tok.tokenize(TEXTS[0])) == TEXTS[0]
    # the same ids mean the same pieces: datasets of one are read by the other
    assert llama.identity == gpt.identity


def test_sentencepiece_tokenizer_adds_megatron_lms_special_tokens(sp_model):
    """Megatron-LM's SentencePieceTokenizer, its rules written out: after the model's n pieces,
    <CLS> <SEP> <EOD> <MASK> and the model's pad, BOS and EOS pieces, each only when the model
    lacks it (this model: no pad piece, so <PAD>; its <s> and </s> keep their ids); end of
    document = <EOD>; a special token in the text is its id; detokenized between spaces."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    n, bos, eos = sp.vocab_size(), sp.bos_id(), sp.eos_id()
    assert sp.pad_id() < 0 and (sp.id_to_piece(bos), sp.id_to_piece(eos)) == ("<s>", "</s>")
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    cls, sep, eod, mask, pad = range(n, n + 5)
    assert tok.special_ids == {
        "<CLS>": cls, "<SEP>": sep, "<EOD>": eod, "<MASK>": mask, "<PAD>": pad,
        "<s>": bos, "</s>": eos,
    }  # fmt: skip
    assert (tok.vocab_size, tok.eod) == (n + 5, eod)
    assert tok.tokenize_batch(TEXTS) == sp.encode(TEXTS)  # text without special tokens
    a, b = TEXTS[0], TEXTS[1]
    text = f"<CLS>{a}<EOD>{b}</s><MASK>"
    want = [cls, *sp.encode(a), eod, *sp.encode(b), eos, mask]
    assert tok.tokenize(text) == want
    assert tok.tokenize_batch([a, text, b]) == [sp.encode(a), want, sp.encode(b)]
    assert tok.detokenize([cls, *sp.encode(a), eod]) == f" <CLS> {a} <EOD> "
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    assert tok.identity.tokenizer_type == "SentencePieceTokenizer" and tok.identity != gpt.identity


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
