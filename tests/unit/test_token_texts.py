"""The per-token text of generated tokens (tools/generate.py, tools/serve.py)."""

from __future__ import annotations

from megatron_tempnet.data.tokenizers import build_tokenizer
from megatron_tempnet.inference.generation import long_token_texts, token_texts
from tests.helpers.corpus import train_gpt2_bpe


def test_a_character_split_by_byte_level_bpe_belongs_to_the_token_completing_it(tmp_path):
    vocab, merges = train_gpt2_bpe(str(tmp_path), vocab_size=300)  # trained on ASCII text
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    prompt, text = "The café", " sert 日本 thé 🙂."
    prompt_ids, ids = tok.tokenize(prompt), tok.tokenize(text)
    assert len(ids) > 20  # é (2 bytes), 日 and 本 (3) and 🙂 (4) each span several tokens
    texts = token_texts(tok.detokenize, ids, prompt_ids)
    assert len(texts) == len(ids) and "".join(texts) == text
    assert not any("\ufffd" in t for t in texts)
    # each character is the text of the token holding its last byte
    ends = {}
    for i in range(len(ids)):
        ends.setdefault(tok.detokenize(ids[: i + 1]).rstrip("\ufffd"), i)
    assert texts[ends[" sert 日"]].endswith("日") and texts[ends[" sert 日"] - 1] == ""
    # bytes that never make a character (a continuation byte alone): U+FFFD at each token
    lone = tok.tokenize("é")[-1]  # the second byte of é
    assert tok.detokenize([lone]) == "\ufffd"
    assert token_texts(tok.detokenize, [lone] * 5 + ids[:3], prompt_ids)[:5] == ["\ufffd"] * 5
    # generation stopped inside a character (🙂 is 4 byte tokens; 2 of them generated): its
    # U+FFFD stays, as in the decoded text, and the text before it is whole
    assert len(tok.tokenize("🙂")) == 4 and ids[-1] == tok.tokenize(".")[0]
    cut = token_texts(tok.detokenize, ids[:-3], prompt_ids)
    assert "".join(cut) == tok.detokenize(prompt_ids + ids[:-3])[len(prompt) :]
    assert "".join(cut[-2:]) == "\ufffd" and "\ufffd" not in "".join(cut[:-2])

    # a long stream in chunks (tools/evaluate.py): the same texts, chunk borders anywhere
    stream = ids * 3
    whole = token_texts(tok.detokenize, stream, prompt_ids)
    for chunk in (1, 2, 5, 7):
        assert long_token_texts(tok.detokenize, stream, prompt_ids, chunk=chunk, context=4) == whole
    assert "".join(long_token_texts(tok.detokenize, stream, chunk=5)) == text * 3
