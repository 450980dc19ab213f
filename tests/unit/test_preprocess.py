"""tools/preprocess_data.py: tokenizers x input formats round trips, determinism, bad input,
archives, directories and globs, progress."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_tempnet.data.indexed import (
    DatasetError,
    IndexedDatasetWriter,
    token_dtype,
    validate_indexed_dataset,
)
from megatron_tempnet.data.jsonl import InputError
from megatron_tempnet.data.preprocess import PreprocessConfig, PreprocessError, run_preprocess
from megatron_tempnet.data.tokenizers import build_tokenizer
from megatron_tempnet.utils.progress import INTERVAL_ENV
from tests.helpers.corpus import (
    pydoc_documents,
    save_hf_tokenizer,
    train_gpt2_bpe,
    train_sentencepiece,
    write_jsonl,
    write_tar,
)
from tests.helpers.processes import run_in_terminal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, dict]:
    d = str(tmp_path_factory.mktemp("tok"))
    vocab, merges = train_gpt2_bpe(d)
    return {
        "SentencePieceTokenizer": {"tokenizer_model": train_sentencepiece(d)},
        "GPT2BPETokenizer": {"vocab_file": vocab, "merge_file": merges},
        "HuggingFaceTokenizer": {"tokenizer_model": save_hf_tokenizer(d)},
    }


def _spec(tokenizers, kind: str) -> dict:
    return {"tokenizer_type": kind, **tokenizers[kind]}


def _run(inputs, prefix, spec, **kw) -> list:
    return run_preprocess(
        PreprocessConfig(inputs=inputs, output_prefix=prefix, tokenizer=spec, **kw)
    )


def _read_back(prefix: str) -> list[np.ndarray]:
    ds = IndexedDataset(prefix)  # megatron-core's reader
    return [np.array(ds[i]) for i in range(len(ds))]  # copies: the mmap closes with ds


def _files(prefix: str) -> tuple[bytes, bytes]:
    with open(prefix + ".bin", "rb") as b, open(prefix + ".idx", "rb") as i:
        return b.read(), i.read()


@pytest.mark.parametrize(
    "kind", ["SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer"]
)
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst", ".jsonl.gz"])
def test_round_trip(tmp_path, tokenizers, kind, suffix):
    docs = pydoc_documents()
    recs = [{"text": d, "meta": {"i": 1}} for d in docs]
    path = write_jsonl(str(tmp_path / f"in{suffix}"), recs)
    (summary,) = _run([path], str(tmp_path / "out"), _spec(tokenizers, kind), append_eod=True)
    tok = build_tokenizer(**_spec(tokenizers, kind))
    assert summary.prefix == str(tmp_path / "out_text_document")
    assert summary.dtype is np.uint16  # vocabularies of 400-600 ids
    back = _read_back(summary.prefix)
    assert len(back) == len(docs) == summary.num_documents
    for doc, ids in zip(docs, back):
        assert ids.dtype == np.uint16
        assert ids[-1] == tok.eod
        assert ids[:-1].tolist() == tok.tokenize(doc)
        assert tok.detokenize(ids[:-1].tolist()) == doc  # lossless tokenizers built in helpers
    assert summary.num_tokens == sum(len(ids) for ids in back)


def test_token_dtype_is_smallest():
    assert token_dtype(256) is np.uint8
    assert token_dtype(257) is np.uint16
    assert token_dtype(65536) is np.uint16
    assert token_dtype(65537) is np.int32
    assert token_dtype(128256) is np.int32


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_writer_matches_megatron_builder(tmp_path, dtype):
    """Our streaming writer produces megatron-core's builder output byte for byte."""
    rng = np.random.default_rng(0)
    high = {np.uint8: 256, np.uint16: 65536, np.int32: 200_000}[dtype]
    docs = [rng.integers(0, high, size=rng.integers(1, 300)) for _ in range(57)]
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for d in docs:
        ref.add_document(d, [d.size])
    ref.finalize(str(tmp_path / "ref.idx"))
    with IndexedDatasetWriter(str(tmp_path / "ours"), dtype) as w:
        for start in range(0, len(docs), 10):  # several blocks per call
            block = docs[start : start + 10]
            w.add_documents(np.concatenate(block), np.array([d.size for d in block]))
    assert _files(str(tmp_path / "ours")) == _files(str(tmp_path / "ref"))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]


def _mixed_inputs(tmp_path) -> list[str]:
    docs = pydoc_documents()
    thirds = [docs[:60], docs[60:120], docs[120:]]
    return [
        write_jsonl(str(tmp_path / name), [{"text": d} for d in part])
        for name, part in zip(["a.jsonl.zst", "b.jsonl.gz", "c.jsonl"], thirds)
    ]


def test_identical_output_for_1_and_4_workers(tmp_path, tokenizers):
    inputs = _mixed_inputs(tmp_path)
    spec = _spec(tokenizers, "SentencePieceTokenizer")
    kw = {"append_eod": True, "chunk_bytes": 20_000}  # ~25 chunks: real interleaving
    (one,) = _run(inputs, str(tmp_path / "w1"), spec, workers=1, **kw)
    (four,) = _run(inputs, str(tmp_path / "w4"), spec, workers=4, **kw)
    assert _files(one.prefix) == _files(four.prefix)
    assert one.num_documents == len(pydoc_documents())


def test_partitions_merge_or_stay_separate(tmp_path, tokenizers):
    inputs = _mixed_inputs(tmp_path)
    spec = _spec(tokenizers, "GPT2BPETokenizer")
    (single,) = _run(inputs, str(tmp_path / "single"), spec, append_eod=True)
    (merged,) = _run(inputs, str(tmp_path / "merged"), spec, append_eod=True, partitions=2)
    assert _files(merged.prefix) == _files(single.prefix)
    assert not [f for f in os.listdir(tmp_path) if "_part" in f]  # parts removed after merge
    parts = _run(
        inputs,
        str(tmp_path / "kept"),
        spec,
        append_eod=True,
        partitions=3,
        keep_partitions=True,
        workers=2,
    )
    assert [p.prefix for p in parts] == [
        str(tmp_path / f"kept_part{i}_text_document") for i in range(3)
    ]
    concatenated = [ids.tolist() for p in parts for ids in _read_back(p.prefix)]
    assert concatenated == [ids.tolist() for ids in _read_back(single.prefix)]
    # one partition alone (an array job), then the merge tool reproduces the single pass
    (only1,) = _run(
        inputs, str(tmp_path / "job"), spec, append_eod=True, partitions=3, partition_index=1
    )
    assert _files(only1.prefix) == _files(parts[1].prefix)
    out = str(tmp_path / "tool_merged")
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "merge_datasets.py"),
            "--input",
            *[p.prefix for p in parts],
            "--output-prefix",
            out,
        ],
        check=True,
        capture_output=True,
    )
    assert _files(out) == _files(single.prefix)


def test_multiple_json_keys(tmp_path, tokenizers):
    recs = [{"title": f"Title {i}", "text": d} for i, d in enumerate(pydoc_documents(20))]
    path = write_jsonl(str(tmp_path / "in.jsonl"), recs)
    spec = _spec(tokenizers, "GPT2BPETokenizer")
    title, text = _run([path], str(tmp_path / "o"), spec, json_keys=("title", "text"))
    tok = build_tokenizer(**spec)
    assert [t.tolist() for t in _read_back(title.prefix)] == [
        tok.tokenize(r["title"]) for r in recs
    ]
    assert [t.tolist() for t in _read_back(text.prefix)] == [tok.tokenize(r["text"]) for r in recs]


BAD_LINES = {
    3: (b'{"text": "unterminated', "invalid JSON"),
    7: (b'{"meta": {}}', "missing key 'text'"),
    11: (b'{"text": 42}', "key 'text' holds int, expected a string"),
    13: (b'["text"]', "expected a JSON object, got list"),
    17: (b'{"text": "\xff\xfe bad utf-8"}', "invalid UTF-8"),
}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
def test_bad_line_stops_with_file_and_line(tmp_path, tokenizers, suffix):
    docs = pydoc_documents(30)
    for line_index, (raw, reason) in BAD_LINES.items():
        recs = [{"text": d} for d in docs]
        recs[line_index - 1] = raw  # line numbers are 1-based
        path = write_jsonl(str(tmp_path / f"bad{line_index}{suffix}"), recs)
        with pytest.raises(PreprocessError) as err:
            _run(
                [path],
                str(tmp_path / f"o{line_index}"),
                _spec(tokenizers, "GPT2BPETokenizer"),
                workers=2,
                chunk_bytes=3000,
            )
        assert f"{path}:{line_index}: {reason}" in str(err.value)
        # nothing written, nothing partial left
        assert not [f for f in os.listdir(tmp_path) if f.startswith(f"o{line_index}")]


def test_skip_bad_lines_counts_and_reports_each(tmp_path, tokenizers, caplog):
    docs = pydoc_documents(30)
    recs = [{"text": d} for d in docs]
    for line_index, (raw, _) in BAD_LINES.items():
        recs[line_index - 1] = raw
    path = write_jsonl(str(tmp_path / "bad.jsonl.gz"), recs, raw_lines={20: b"   "})
    spec = _spec(tokenizers, "SentencePieceTokenizer")
    with caplog.at_level(logging.INFO, logger="megatron_tempnet"):
        (s,) = _run(
            [path], str(tmp_path / "o"), spec, skip_bad_lines=True, workers=2, chunk_bytes=3000
        )
    assert s.num_documents == len(docs) - len(BAD_LINES)
    good = [d for i, d in enumerate(docs, start=1) if i not in BAD_LINES]
    tok = build_tokenizer(**spec)
    assert [ids.tolist() for ids in _read_back(s.prefix)] == [tok.tokenize(d) for d in good]
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped ")]
    for line_index, (_, reason) in BAD_LINES.items():
        n = line_index + (line_index > 20)  # the blank line shifts later line numbers
        assert any(f"{path}:{n}: {reason}" in m for m in skipped), (n, skipped)
    assert any("skipped 5 bad line(s)" in m for m in skipped)
    assert any("ignored 1 blank line(s)" in r.getMessage() for r in caplog.records)


def test_truncated_compressed_inputs(tmp_path, tokenizers):
    docs = pydoc_documents()
    spec = _spec(tokenizers, "GPT2BPETokenizer")
    for suffix, what in ((".jsonl.zst", "truncated zstd stream"), (".jsonl.gz", "truncated gzip")):
        full = write_jsonl(str(tmp_path / f"full{suffix}"), [{"text": d} for d in docs])
        with open(full, "rb") as f:
            data = f.read()
        cut = str(tmp_path / f"cut{suffix}")
        with open(cut, "wb") as f:
            f.write(data[: len(data) * 2 // 3])
        with pytest.raises(InputError) as err:
            _run([cut], str(tmp_path / f"o{suffix}"), spec, workers=2)
        assert cut in str(err.value) and what in str(err.value)
        assert "after line" in str(err.value)
        assert not [f for f in os.listdir(tmp_path) if f.startswith(f"o{suffix}")]


def test_multi_frame_zstd(tmp_path, tokenizers):
    """Concatenated zstd frames (e.g. `cat a.zst b.zst`) are read as one stream."""
    docs = pydoc_documents(40)
    parts = [b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs[i::2]) for i in (0, 1)]
    frames = [zstandard.ZstdCompressor().compress(p) for p in parts]
    path = str(tmp_path / "multi.jsonl.zst")
    with open(path, "wb") as f:
        f.write(b"".join(frames))
    spec = _spec(tokenizers, "GPT2BPETokenizer")
    (s,) = _run([path], str(tmp_path / "o"), spec)
    assert s.num_documents == 40
    tok = build_tokenizer(**spec)
    expected = [tok.tokenize(d) for d in docs[0::2] + docs[1::2]]
    assert [ids.tolist() for ids in _read_back(s.prefix)] == expected


def test_corrupt_index_is_named(tmp_path, tokenizers):
    path = write_jsonl(str(tmp_path / "in.jsonl"), [{"text": d} for d in pydoc_documents(20)])
    (s,) = _run([path], str(tmp_path / "o"), _spec(tokenizers, "GPT2BPETokenizer"))
    assert validate_indexed_dataset(s.prefix).num_documents == 20
    idx, bin_ = s.prefix + ".idx", s.prefix + ".bin"
    with open(idx, "rb") as f:
        good = f.read()
    cases = {
        "truncated": (good[:-8], "truncated or corrupt"),
        "magic": (b"XXXXXXXXX" + good[9:], "bad magic"),
        "header": (good[:20], "truncated header"),
        "pointers": (good[: 34 + 4 * 20] + b"\x01" + good[34 + 4 * 20 + 1 :], "pointers disagree"),
    }
    for name, (data, message) in cases.items():
        with open(idx, "wb") as f:
            f.write(data)
        with pytest.raises(DatasetError) as err:
            validate_indexed_dataset(s.prefix)
        assert idx in str(err.value) and message in str(err.value), name
    with open(idx, "wb") as f:
        f.write(good)
    with open(bin_, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DatasetError, match="the pair is truncated or mismatched"):
        validate_indexed_dataset(s.prefix)


def _cli(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, **kw)


def _cli_tok(tokenizers) -> list[str]:
    t = tokenizers["GPT2BPETokenizer"]
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        t["vocab_file"],
        "--merge-file",
        t["merge_file"],
    ]


def test_cli_errors_are_one_line_and_keep_existing_output(tmp_path, tokenizers):
    good = write_jsonl(str(tmp_path / "good.jsonl"), [{"text": d} for d in pydoc_documents(10)])
    prefix = str(tmp_path / "o")
    r = _cli(["--input", good, "--output-prefix", prefix, "--append-eod", *_cli_tok(tokenizers)])
    assert r.returncode == 0, r.stderr
    before = _files(prefix + "_text_document")
    # the same output again: refused, nothing touched
    r = _cli(["--input", good, "--output-prefix", prefix, *_cli_tok(tokenizers)])
    assert r.returncode == 1 and "already exist; pass --overwrite" in r.stderr
    # --overwrite with a bad line half way: the earlier dataset survives intact
    recs = [{"text": d} for d in pydoc_documents(10)] + [b"{oops"]
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), recs)
    r = _cli(["--input", bad, "--output-prefix", prefix, "--overwrite", *_cli_tok(tokenizers)])
    assert r.returncode == 1
    assert f"error: {bad}:11: invalid JSON" in r.stderr and "Traceback" not in r.stderr
    assert _files(prefix + "_text_document") == before
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]
    for args, message in [
        (["--input", str(tmp_path / "missing.jsonl")], "no such file"),
        (["--input", str(tmp_path / "o_text_document.bin")], "unknown format"),
        (["--input", str(tmp_path / "no" / "*.jsonl.zst")], "the pattern matches no file"),
        (["--input", good, "--partitions", "2"], "--partitions (2) exceeds the number of input"),
        (["--input", good, "--workers", "0"], "--workers (0) must be >= 1"),
    ]:
        r = _cli([*args, "--output-prefix", str(tmp_path / "x"), *_cli_tok(tokenizers)])
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = _cli(
        [
            "--input",
            good,
            "--output-prefix",
            str(tmp_path / "x"),
            "--tokenizer-type",
            "SentencePieceTokenizer",
        ]
    )
    assert r.returncode == 1 and "needs --tokenizer-model" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_interrupted_run_leaves_no_complete_looking_index(tmp_path, tokenizers, sig):
    docs = pydoc_documents(4000)
    big = write_jsonl(str(tmp_path / "big.jsonl.gz"), [{"text": d} for d in docs])
    prefix = str(tmp_path / "o")
    proc = subprocess.Popen(
        [
            sys.executable,
            TOOL,
            "--input",
            big,
            "--output-prefix",
            prefix,
            "--workers",
            "2",
            *_cli_tok(tokenizers),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    partial = prefix + "_text_document.bin.partial"
    deadline = time.monotonic() + 60
    while not (os.path.exists(partial) and os.path.getsize(partial) > 0):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    left = os.listdir(tmp_path)
    assert not [f for f in left if f.endswith(".idx")], left
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert "interrupted by SIGTERM; partial outputs were removed" in stderr
        assert not [f for f in left if f.endswith(".partial")], left
    else:
        assert proc.returncode == -signal.SIGKILL


def test_input_without_documents_writes_nothing(tmp_path, tokenizers):
    path = write_jsonl(str(tmp_path / "empty.jsonl"), [{"text": ""}, {"text": ""}])
    with pytest.raises(
        PreprocessError, match=r"no documents with tokens under key\(s\) \['text'\]"
    ):
        _run([path], str(tmp_path / "o"), _spec(tokenizers, "GPT2BPETokenizer"))
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl"]


# ---- archives, directories, globs and progress ---------------------------------------------------

# OpenWebText2's archive in small: .jsonl.zst files, some in a folder, stored out of order. They
# are read in path order, directory by directory: 2020/* before 2020-12 (a character order would
# put "-" before "/").
ARCHIVE_ORDER = [
    "2020-12.jsonl.zst",
    "2020/02.jsonl.zst",
    "2019-01.jsonl.zst",
    "2020/01.jsonl.zst",
    "2019-02.jsonl.zst",
]
PATH_ORDER = [
    "2019-01.jsonl.zst",
    "2019-02.jsonl.zst",
    "2020/01.jsonl.zst",
    "2020/02.jsonl.zst",
    "2020-12.jsonl.zst",
]
DOCS_PER_FILE = 20


@pytest.fixture(scope="module")
def owt2_like(tmp_path_factory, tokenizers) -> dict:
    """The files extracted and as a tar, and the dataset of the extracted directory."""
    root = tmp_path_factory.mktemp("owt2")
    extracted = root / "extracted"
    (extracted / "2020").mkdir(parents=True)
    docs = pydoc_documents(DOCS_PER_FILE * len(PATH_ORDER))
    for i, name in enumerate(PATH_ORDER):
        part = docs[i * DOCS_PER_FILE : (i + 1) * DOCS_PER_FILE]
        write_jsonl(str(extracted / name), [{"text": d, "meta": {"file": name}} for d in part])
    spec = _spec(tokenizers, "GPT2BPETokenizer")
    (ref,) = _run([str(extracted)], str(root / "dir"), spec, append_eod=True)
    return {
        "extracted": str(extracted),
        "tar": write_tar(str(root / "owt2.jsonl.zst.tar"), str(extracted), ARCHIVE_ORDER),
        "docs": docs,
        "spec": spec,
        "reference": ref.prefix,
    }


def test_directory_is_read_recursively_in_path_order(owt2_like):
    tok = build_tokenizer(**owt2_like["spec"])
    expected = [tok.tokenize(d) + [tok.eod] for d in owt2_like["docs"]]
    assert [ids.tolist() for ids in _read_back(owt2_like["reference"])] == expected


def test_archive_on_a_terminal_equals_its_extracted_files(owt2_like, tokenizers, tmp_path):
    """The tar through the tool, on a terminal: the extracted directory's bytes, and a bar."""
    prefix = str(tmp_path / "tar")
    args = ["--input", owt2_like["tar"], "--output-prefix", prefix, "--append-eod"]
    code, out = run_in_terminal([sys.executable, TOOL, *args, *_cli_tok(tokenizers)])
    assert code == 0, out
    assert _files(prefix + "_text_document") == _files(owt2_like["reference"])
    mb = sum(os.path.getsize(os.path.join(owt2_like["extracted"], n)) for n in PATH_ORDER) / 1e6
    final = rf"\rpreprocessing: 100%\|█+\| {mb:.1f}/{mb:.1f} MB \[[\d:]+<00:00, +[\d.]+MB/s\]\r\n"
    assert re.search(final, out), out
    assert "done: 100 documents" in out and "INFO preprocessing:" not in out


def test_glob_equals_the_archive_and_logs_plain_progress(owt2_like, tokenizers, tmp_path):
    """A glob through the tool, output to pipes: a line per chunk at interval 0, and a last."""
    prefix = str(tmp_path / "glob")
    pattern = os.path.join(owt2_like["extracted"], "**", "*.jsonl.zst")
    env = dict(os.environ, **{INTERVAL_ENV: "0"})
    args = ["--input", pattern, "--output-prefix", prefix, "--append-eod"]
    r = _cli([*args, *_cli_tok(tokenizers)], env=env)
    assert r.returncode == 0, r.stderr
    assert _files(prefix + "_text_document") == _files(owt2_like["reference"])
    sizes = np.cumsum(
        [os.path.getsize(os.path.join(owt2_like["extracted"], n)) for n in PATH_ORDER]
    )
    mb, rate = f"{sizes[-1] / 1e6:.1f}", r"([\d.e+-]+) MB/s"
    line = rf"preprocessing: (\d+)% [\d.]+/{mb} MB \| {rate} \| elapsed [\d:]+ \| ETA [\d:]+"
    lines = re.findall(line, r.stderr)
    # one chunk per file: the percentage after each file (of the stored bytes), a rate, an ETA
    assert [int(p) for p, _ in lines] == [round(100 * s / sizes[-1]) for s in sizes]
    assert all(float(r) > 0 for _, r in lines)
    assert len(re.findall(rf"preprocessing: 100% {mb}/{mb} MB in [\d:]+ \({rate}\)", r.stderr)) == 1
    assert re.search(r"done: 100 documents, [\d,]+ tokens, .* tokens/s, ", r.stderr)


def test_gzipped_archive_and_partitions_of_members(owt2_like, tmp_path):
    """A .tar.gz read out of its stored order; an archive's members are partitioned as files."""
    tgz = write_tar(str(tmp_path / "owt2.tgz"), owt2_like["extracted"], ARCHIVE_ORDER)
    (s,) = _run([tgz], str(tmp_path / "tgz"), owt2_like["spec"], append_eod=True)
    assert _files(s.prefix) == _files(owt2_like["reference"])
    tar = owt2_like["tar"]
    (merged,) = _run([tar], str(tmp_path / "m"), owt2_like["spec"], append_eod=True, partitions=2)
    assert _files(merged.prefix) == _files(owt2_like["reference"])
    with pytest.raises(
        PreprocessError, match=r"--partitions \(6\) exceeds the number of input files \(5\)"
    ):
        _run([tar], str(tmp_path / "p"), owt2_like["spec"], partitions=6)


def test_archive_errors_name_archive_member_and_line(tmp_path, tokenizers, caplog):
    spec = _spec(tokenizers, "GPT2BPETokenizer")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    docs = pydoc_documents(40)
    write_jsonl(str(src / "good.jsonl.zst"), [{"text": d} for d in docs[:10]])
    recs = [{"text": d} for d in docs[:10]]
    recs[6] = b'{"meta": {}}'
    write_jsonl(str(src / "sub" / "bad.jsonl.zst"), recs)
    (src / "README").write_text("not data")
    tar = write_tar(str(tmp_path / "bad.tar"), str(src), ["sub/bad.jsonl.zst", "good.jsonl.zst"])
    with tarfile.open(tar, "a") as t:
        t.add(str(src / "README"), "README")
    with caplog.at_level(logging.WARNING, logger="megatron_tempnet"):
        with pytest.raises(PreprocessError) as err:
            _run([tar], str(tmp_path / "o"), spec)
    assert str(err.value) == (
        f"{tar}:sub/bad.jsonl.zst:7: missing key 'text' (--skip-bad-lines skips and counts such "
        "lines)"
    )
    skipped = [r.getMessage() for r in caplog.records if "skipped 1 file(s)" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].startswith(f"archive {tar}: ")
    assert skipped[0].endswith(f": {tar}:README")
    # a truncated member: as for a file, the member and the last complete line
    with open(src / "good.jsonl.zst", "rb") as f:
        data = f.read()
    (src / "cut.jsonl.zst").write_bytes(data[: len(data) // 2])
    cut = write_tar(str(tmp_path / "cut.tar"), str(src), ["good.jsonl.zst", "cut.jsonl.zst"])
    with pytest.raises(InputError) as err:
        _run([cut], str(tmp_path / "o"), spec)
    assert str(err.value).startswith(f"{cut}:cut.jsonl.zst: truncated zstd stream")
    assert re.search(r"\(after line \d+\)$", str(err.value))
    # a truncated archive: cut inside a member, or between two (where tarfile stops quietly)
    with tarfile.open(cut) as t:
        first = t.getmember("good.jsonl.zst")
    with open(cut, "rb") as f:
        whole = f.read()
    boundary = first.offset_data + -(-first.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    for size, message in [
        (boundary - 100, "unreadable tar archive (unexpected end of data)"),
        (boundary, "truncated archive (no end-of-archive marker)"),
    ]:
        (tmp_path / "short.tar").write_bytes(whole[:size])
        with pytest.raises(InputError, match=re.escape(f"short.tar: {message}")):
            _run([str(tmp_path / "short.tar")], str(tmp_path / "o"), spec)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o")]
