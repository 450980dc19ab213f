"""Wrong-data protection, in one process: the tokenizer record preprocessing writes beside a
dataset (checked against references computed here), the merge tool's handling of it, and the
token id range check with its cache."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys

import numpy as np
import pytest

from megatron_tempnet.data import token_range
from megatron_tempnet.data.gpt_data import check_datasets
from megatron_tempnet.data.indexed import DatasetError, IndexedDatasetWriter
from megatron_tempnet.data.preprocess import PreprocessConfig, run_preprocess
from megatron_tempnet.data.tokenizer_sidecar import check_tokenizer, sidecar_path
from megatron_tempnet.data.tokenizers import build_tokenizer
from megatron_tempnet.models.gpt.config import padded_vocab_size
from tests.helpers.corpus import (
    pydoc_documents,
    save_hf_tokenizer,
    train_gpt2_bpe,
    train_sentencepiece,
    write_jsonl,
)
from tests.helpers.entry_points import run_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, dict]:
    """Two GPT-2 BPEs of the same size trained on different text, a SentencePiece model and a
    Hugging Face directory (build_tokenizer's keyword arguments each)."""
    d = tmp_path_factory.mktemp("tok")
    (d / "upper").mkdir()
    vocab, merges = train_gpt2_bpe(str(d), 512)
    upper = train_gpt2_bpe(str(d / "upper"), 512, texts=[t.upper() for t in pydoc_documents()])
    return {
        "gpt2": {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges},
        "gpt2_upper": {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": upper[0],
            "merge_file": upper[1],
        },
        "sp": {
            "tokenizer_type": "GPTSentencePieceTokenizer",
            "tokenizer_model": train_sentencepiece(str(d)),
        },
        "hf": {
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": save_hf_tokenizer(str(d)),
        },
    }


def _preprocess(tmp_path, name: str, spec: dict, n: int = 12) -> str:
    docs = write_jsonl(str(tmp_path / f"{name}.jsonl"), [{"text": t} for t in pydoc_documents(n)])
    config = PreprocessConfig([docs], str(tmp_path / name), spec, append_eod=True)
    return run_preprocess(config)[0].prefix


def _sha256(*paths: str) -> str:
    return hashlib.sha256(b"".join(open(p, "rb").read() for p in paths)).hexdigest()


def _expected_identity(spec: dict) -> tuple[int, str]:
    """(vocabulary size, sha256 of the files), from the files themselves."""
    kind = spec["tokenizer_type"]
    if kind == "GPT2BPETokenizer":
        vocab = json.load(open(spec["vocab_file"], encoding="utf-8"))
        return len(vocab), _sha256(spec["vocab_file"], spec["merge_file"])
    if kind == "GPTSentencePieceTokenizer":
        import sentencepiece

        model = spec["tokenizer_model"]
        return sentencepiece.SentencePieceProcessor(model_file=model).vocab_size(), _sha256(model)
    from transformers import AutoTokenizer

    directory = spec["tokenizer_model"]
    names = sorted(f for f in os.listdir(directory) if f.endswith((".json", ".txt", ".model")))
    files = [os.path.join(directory, f) for f in names]
    return len(AutoTokenizer.from_pretrained(directory)), _sha256(*files)


def test_an_earlier_sentencepiece_record_means_the_models_own_ids(tokenizers, tmp_path):
    """A record written before SentencePieceTokenizer added Megatron-LM's special tokens (format
    1) named the model's own ids so: GPTSentencePieceTokenizer reads its dataset, Megatron-LM's
    SentencePieceTokenizer is refused with both named."""
    spec = tokenizers["sp"]
    gpt = build_tokenizer(**spec)
    megatron = build_tokenizer(**{**spec, "tokenizer_type": "SentencePieceTokenizer"})
    prefix = str(tmp_path / "old")
    record = {"format": "megatron_tempnet.tokenizer/1", "tokenizer_type": "SentencePieceTokenizer",
              "vocab_size": gpt.vocab_size, "sha256": gpt.identity.sha256, "files": []}  # fmt: skip
    with open(sidecar_path(prefix), "w") as f:
        json.dump(record, f)
    assert check_tokenizer([prefix], gpt.identity) == []
    with pytest.raises(DatasetError) as e:
        check_tokenizer([prefix], megatron.identity)
    assert f"GPTSentencePieceTokenizer, {gpt.vocab_size} ids" in str(e.value)
    assert f"SentencePieceTokenizer, {gpt.vocab_size + 5} ids" in str(e.value)


@pytest.mark.parametrize("kind", ["gpt2", "sp", "hf"])
def test_preprocessing_records_the_tokenizer_beside_the_dataset(tokenizers, tmp_path, kind):
    spec = tokenizers[kind]
    prefix = _preprocess(tmp_path, kind, spec)
    record = json.load(open(prefix + ".tokenizer.json"))
    vocab_size, sha = _expected_identity(spec)
    assert record["tokenizer_type"] == spec["tokenizer_type"]
    assert record["vocab_size"] == vocab_size and 400 <= vocab_size <= 600
    assert record["sha256"] == sha
    assert all(os.path.isabs(f) and os.path.isfile(f) for f in record["files"])
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]
    # the run's own tokenizer passes; the other GPT-2 BPE (same type and size) does not
    assert check_tokenizer([prefix], build_tokenizer(**spec).identity) == []
    if kind == "gpt2":
        other = build_tokenizer(**tokenizers["gpt2_upper"]).identity
        assert other.vocab_size == vocab_size and other.sha256 != sha
        with pytest.raises(DatasetError) as e:
            check_tokenizer([prefix], other)
        message = str(e.value)
        assert "\n" not in message and prefix in message
        assert sha[:12] in message and other.sha256[:12] in message


def _merge(*args) -> object:
    tool = os.path.join(REPO, "tools", "merge_datasets.py")
    return run_command([sys.executable, tool, *map(str, args)])


def test_merge_carries_an_agreed_tokenizer_and_refuses_two(tokenizers, tmp_path):
    a = _preprocess(tmp_path, "a", tokenizers["gpt2"])
    b = _preprocess(tmp_path, "b", tokenizers["gpt2"], n=5)
    upper = _preprocess(tmp_path, "u", tokenizers["gpt2_upper"], n=5)
    r = _merge("--input", a, b, "--output-prefix", tmp_path / "ab")
    assert r.returncode == 0, r.stderr
    assert open(str(tmp_path / "ab.tokenizer.json")).read() == open(a + ".tokenizer.json").read()
    r = _merge("--input", a, upper, "--output-prefix", tmp_path / "au")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr
    assert a in errors[0] and upper in errors[0] and "cannot be merged" in errors[0]
    assert not [f for f in os.listdir(tmp_path) if f.startswith("au")]  # nothing written
    # an input of unknown tokenizer: the output's is unknown too, and the record of the dataset
    # it replaces is gone (never left beside other data)
    os.remove(sidecar_path(b))
    r = _merge("--input", a, b, "--output-prefix", tmp_path / "ab", "--overwrite")
    assert r.returncode == 0 and not os.path.exists(tmp_path / "ab.tokenizer.json")


def _write(prefix: str, tokens: np.ndarray, doc_length: int = 100) -> str:
    lengths = [doc_length] * (tokens.size // doc_length)
    with IndexedDatasetWriter(prefix, tokens.dtype.type) as w:
        w.add_documents(tokens, np.asarray(lengths))
    return prefix


def test_ids_outside_the_vocabulary_are_named_padding_included(tmp_path):
    vocab = 500  # padded to 512: ids 500..511 have embedding rows, but no token
    assert padded_vocab_size(vocab, 128, 1) == 512
    tokens = np.random.default_rng(0).integers(0, vocab, 5000).astype(np.uint16)
    tokens[1234] = vocab + 5
    prefix = _write(str(tmp_path / "d"), tokens)
    cache = str(tmp_path / "cache")
    with pytest.raises(DatasetError) as e:
        token_range.check_token_ids(prefix, vocab, cache)
    message = str(e.value)
    assert f"dataset {prefix} holds token id 505 (first at token 1234 of {prefix}.bin)" in message
    assert "vocabulary of 500 ids" in message and "\n" not in message
    assert token_range.check_token_ids(prefix, 506, cache).max_at == 1234  # 505 fits 506
    signed = tokens.astype(np.int32)
    signed[77] = -3
    signed[1234] = 7
    prefix = _write(str(tmp_path / "s"), signed)
    with pytest.raises(DatasetError, match=r"holds token id -3 \(first at token 77 "):
        token_range.check_token_ids(prefix, vocab, cache)


def test_the_range_is_scanned_once_and_rescanned_after_a_rewrite(tmp_path, monkeypatch):
    scans = []
    scan = token_range.scan_token_range
    monkeypatch.setattr(token_range, "scan_token_range", lambda p: scans.append(p) or scan(p))
    tokens = np.arange(3000, dtype=np.uint16) % 400
    prefix, cache = _write(str(tmp_path / "d"), tokens), str(tmp_path / "cache")
    first = token_range.check_token_ids(prefix, 512, cache)
    assert (first.max_id, first.max_at, first.min_id, first.tokens) == (399, 399, 0, 3000)
    path = token_range.cache_file(prefix, cache)
    assert os.path.dirname(path) == cache and scans == [prefix]
    assert token_range.check_token_ids(prefix, 512, cache) == first
    assert scans == [prefix]  # the second start-up read the cache
    # the check believes the cache: a planted out-of-range maximum stops it without a scan
    record = json.load(open(path))
    record["range"].update(max_id=600, max_at=7)
    open(path, "w").write(json.dumps(record))
    with pytest.raises(DatasetError, match="holds token id 600 "):
        token_range.check_token_ids(prefix, 512, cache)
    assert scans == [prefix]
    # a rewritten dataset (same size, other ids) is scanned again
    tokens[2500] = 511
    _write(prefix, tokens)
    assert token_range.check_token_ids(prefix, 512, cache).max_id == 511
    assert scans == [prefix, prefix]
    # without a cache directory: beside megatron-core's default index cache
    assert token_range.cache_file(prefix, None) == os.path.join(prefix, "cache", "token_range.json")


def test_a_dataset_without_a_tokenizer_record_is_accepted(tokenizers, tmp_path, caplog):
    identity = build_tokenizer(**tokenizers["gpt2"]).identity
    prefix = _preprocess(tmp_path, "old", tokenizers["gpt2"])
    os.remove(sidecar_path(prefix))  # as an older version or Megatron-LM's tool writes it
    with caplog.at_level(logging.INFO, logger="megatron_tempnet"):
        check_datasets([prefix], identity, 512, str(tmp_path / "cache"))
    lines = [r.getMessage() for r in caplog.records if "cannot be checked" in r.getMessage()]
    assert len(lines) == 1 and prefix in lines[0] and "vocabulary (512 ids)" in lines[0]
    # with a record of another tokenizer it stops
    upper = _preprocess(tmp_path, "upper", tokenizers["gpt2_upper"])
    with pytest.raises(DatasetError, match=f"dataset {upper} was tokenised with"):
        check_datasets([prefix, upper], identity, 512, str(tmp_path / "cache"))
