"""megatron-core indexed datasets (``P.bin`` + ``P.idx``): a streaming writer and a validator.

Files are byte-for-byte what megatron-core's ``IndexedDatasetBuilder`` writes and are read by its
``IndexedDataset``. The writer differs in two ways that matter at OpenWebText2 scale:

- memory is flat: per-sequence lengths and document boundaries go to side files on disk instead
  of Python lists (megatron-core's builder holds ~70 bytes per document in RAM);
- publication is atomic: everything is written under ``*.partial`` names and renamed at the end,
  ``.bin`` first and ``.idx`` last, so an interrupted run never leaves an ``.idx`` that looks
  complete. An existing ``.idx`` being replaced is removed before the new ``.bin`` lands, and
  so is the old dataset's tokenizer record (``PREFIX.tokenizer.json``, ``data.tokenizer_sidecar``):
  it never describes the new one.

``.idx`` layout (little endian): ``MMIDIDX\\0\\0``, u64 version = 1, u8 dtype code, u64 sequence
count N, u64 document count D, i32 lengths[N], i64 byte pointers[N], i64 document indices[D].
"""

from __future__ import annotations

import os
import shutil
import struct
from dataclasses import dataclass

import numpy as np

from megatron_tempnet.utils.cli import UserError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_PREAMBLE = struct.Struct("<9sQBQQ")  # header, version, dtype code, sequences, documents
PARTIAL = ".partial"
TOKENIZER_SIDECAR = ".tokenizer.json"  # which tokenizer wrote the dataset (tokenizer_sidecar)
_STREAM_ELEMENTS = 1 << 22  # elements per block when streaming index arrays

# megatron-core's DType codes (megatron.core.datasets.indexed_dataset.DType)
_DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class DatasetError(UserError, ValueError):
    """An indexed dataset that is missing, truncated or inconsistent; names the file."""


def token_dtype(vocab_size: int) -> type[np.number]:
    """The smallest dtype that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size <= 1 << 8:
        return np.uint8
    if vocab_size <= 1 << 16:
        return np.uint16
    return np.int32


@dataclass(frozen=True)
class IndexSummary:
    prefix: str
    dtype: type[np.number]
    num_sequences: int
    num_documents: int  # real documents (the index stores num_documents + 1 boundaries)
    num_tokens: int


class IndexedDatasetWriter:
    """Streaming writer of one indexed dataset; use as a context manager.

    Leaving the ``with`` block normally publishes the dataset; leaving it with an exception (or
    ``abort()``) removes every partial file and leaves any earlier dataset at ``prefix`` untouched.
    """

    def __init__(self, prefix: str, dtype: type[np.number]):
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"unsupported token dtype {dtype}")
        self.prefix, self.dtype = prefix, dtype
        self._paths = {k: f"{prefix}.{k}{PARTIAL}" for k in ("bin", "idx", "lengths", "docs")}
        self._bin = open(self._paths["bin"], "wb")
        self._lengths = open(self._paths["lengths"], "wb")
        self._docs = open(self._paths["docs"], "wb")
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents of one sequence each: ``tokens`` concatenated, ``lengths`` [n_docs]."""
        lengths = np.asarray(lengths, dtype=np.int32)
        self._bin.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.write(lengths.tobytes())
        ends = self.num_sequences + np.arange(1, lengths.size + 1, dtype=np.int64)
        self._docs.write(ends.tobytes())
        self.num_sequences += lengths.size
        self.num_documents += lengths.size
        self.num_tokens += int(lengths.sum(dtype=np.int64))

    def add_dataset(self, prefix: str) -> None:
        """Append a whole existing dataset (validated first; its dtype must match)."""
        summary = validate_indexed_dataset(prefix)
        if summary.dtype is not self.dtype:
            raise DatasetError(
                f"{prefix}.idx: token dtype {summary.dtype.__name__} differs from "
                f"{self.dtype.__name__}; datasets from different tokenizers cannot be merged"
            )
        n_seq, n_doc = summary.num_sequences, summary.num_documents
        lengths, _, doc_indices = _index_arrays(prefix, n_seq, n_doc)
        for start in range(0, lengths.size, _STREAM_ELEMENTS):
            self._lengths.write(np.asarray(lengths[start : start + _STREAM_ELEMENTS]).tobytes())
        for start in range(1, doc_indices.size, _STREAM_ELEMENTS):
            block = np.asarray(doc_indices[start : start + _STREAM_ELEMENTS]) + self.num_sequences
            self._docs.write(block.tobytes())
        with open(f"{prefix}.bin", "rb") as src:
            shutil.copyfileobj(src, self._bin, 1 << 24)
        self.num_sequences += summary.num_sequences
        self.num_documents += summary.num_documents
        self.num_tokens += summary.num_tokens

    def finalize(self) -> IndexSummary:
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        self._write_index()
        idx_path, bin_path = f"{self.prefix}.idx", f"{self.prefix}.bin"
        for old in (idx_path, self.prefix + TOKENIZER_SIDECAR):
            if os.path.exists(old):
                os.remove(old)  # never pair an old .idx or tokenizer record with the new .bin
        _fsync(self._paths["bin"])
        os.replace(self._paths["bin"], bin_path)
        _fsync(self._paths["idx"])
        os.replace(self._paths["idx"], idx_path)
        for key in ("lengths", "docs"):
            os.remove(self._paths[key])
        return IndexSummary(
            self.prefix, self.dtype, self.num_sequences, self.num_documents, self.num_tokens
        )

    def abort(self) -> None:
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        for path in self._paths.values():
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.summary = self.finalize()
        else:
            self.abort()

    def _write_index(self) -> None:
        itemsize = np.dtype(self.dtype).itemsize
        with open(self._paths["idx"], "wb") as out:
            out.write(
                _PREAMBLE.pack(
                    INDEX_HEADER,
                    1,
                    _DTYPE_CODES[self.dtype],
                    self.num_sequences,
                    self.num_documents + 1,
                )
            )
            with open(self._paths["lengths"], "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            pointer = 0
            with open(self._paths["lengths"], "rb") as f:
                for raw in iter(lambda: f.read(4 * _STREAM_ELEMENTS), b""):
                    nbytes = np.frombuffer(raw, dtype=np.int32).astype(np.int64) * itemsize
                    ends = pointer + np.cumsum(nbytes)
                    out.write((ends - nbytes).tobytes())
                    pointer = int(ends[-1])
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            with open(self._paths["docs"], "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)


def _fsync(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _read_preamble(idx_path: str) -> tuple[type[np.number], int, int]:
    if not os.path.isfile(idx_path):
        raise DatasetError(f"{idx_path}: no such file")
    with open(idx_path, "rb") as f:
        raw = f.read(_PREAMBLE.size)
    if len(raw) < _PREAMBLE.size:
        raise DatasetError(f"{idx_path}: truncated header ({len(raw)} bytes)")
    header, version, code, n_seq, n_doc = _PREAMBLE.unpack(raw)
    if header != INDEX_HEADER:
        raise DatasetError(f"{idx_path}: not a megatron-core index (bad magic {header!r})")
    if version != 1:
        raise DatasetError(f"{idx_path}: unsupported index version {version}")
    if code not in _CODE_DTYPES:
        raise DatasetError(f"{idx_path}: unknown token dtype code {code}")
    return _CODE_DTYPES[code], n_seq, n_doc


def document_count(prefix: str) -> int:
    """Documents in ``prefix.idx`` (its header only)."""
    return _read_preamble(f"{prefix}.idx")[2] - 1  # the document index starts with a 0


def stored_dtype(prefix: str) -> type[np.number]:
    """The token dtype of ``prefix.bin`` (from its index's header)."""
    return _read_preamble(f"{prefix}.idx")[0]


def _index_arrays(prefix: str, n_seq: int, n_documents: int):
    """Memory-mapped (lengths, pointers, document indices [n_documents + 1]) of an index."""
    idx = np.memmap(f"{prefix}.idx", mode="r", dtype=np.uint8)
    offset = _PREAMBLE.size
    lengths = idx[offset : offset + 4 * n_seq].view(np.int32)
    offset += 4 * n_seq
    pointers = idx[offset : offset + 8 * n_seq].view(np.int64)
    offset += 8 * n_seq
    doc_indices = idx[offset : offset + 8 * (n_documents + 1)].view(np.int64)
    return lengths, pointers, doc_indices


def validate_indexed_dataset(prefix: str) -> IndexSummary:
    """Check ``prefix.idx``/``prefix.bin`` for consistency; raise ``DatasetError`` naming the file.

    Checks the header, that the file sizes match the counts, that lengths are non-negative and
    pointers are their running sum, and that document boundaries are increasing and end at N.
    Reads the index in blocks (memory does not grow with the dataset).
    """
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    dtype, n_seq, n_doc_entries = _read_preamble(idx_path)
    itemsize = np.dtype(dtype).itemsize
    expected = _PREAMBLE.size + 12 * n_seq + 8 * n_doc_entries
    actual = os.path.getsize(idx_path)
    if actual not in (expected, expected + n_seq):  # + n_seq: megatron's multimodal modes
        raise DatasetError(
            f"{idx_path}: {actual} bytes, but its header ({n_seq} sequences, {n_doc_entries} "
            f"document boundaries) needs {expected}: the file is truncated or corrupt"
        )
    if n_doc_entries < 1:
        raise DatasetError(f"{idx_path}: no document boundaries")
    lengths, pointers, doc_indices = _index_arrays(prefix, n_seq, n_doc_entries - 1)
    total = 0
    for start in range(0, n_seq, _STREAM_ELEMENTS):
        block = np.asarray(lengths[start : start + _STREAM_ELEMENTS]).astype(np.int64)
        if (block < 0).any():
            raise DatasetError(f"{idx_path}: negative sequence length near sequence {start}")
        ends = total + np.cumsum(block)
        expect_ptr = (ends - block) * itemsize
        if not np.array_equal(expect_ptr, pointers[start : start + _STREAM_ELEMENTS]):
            raise DatasetError(f"{idx_path}: sequence pointers disagree with the lengths")
        total = int(ends[-1])
    previous = 0
    for start in range(0, n_doc_entries, _STREAM_ELEMENTS):
        block = np.asarray(doc_indices[start : start + _STREAM_ELEMENTS])
        if (block[0] < previous) or (np.diff(block) < 0).any() or (start == 0 and block[0] != 0):
            raise DatasetError(f"{idx_path}: document boundaries are not increasing from 0")
        previous = int(block[-1])
    if previous != n_seq:
        raise DatasetError(f"{idx_path}: the last document boundary is {previous}, not {n_seq}")
    if not os.path.isfile(bin_path):
        raise DatasetError(f"{bin_path}: no such file (its index {idx_path} exists)")
    bin_size = os.path.getsize(bin_path)
    if bin_size != total * itemsize:
        raise DatasetError(
            f"{bin_path}: {bin_size} bytes, but {idx_path} describes {total} tokens of "
            f"{itemsize} byte(s) = {total * itemsize} bytes; the pair is truncated or mismatched"
        )
    return IndexSummary(prefix, dtype, n_seq, n_doc_entries - 1, total)


def merge_datasets(prefixes: list[str], out_prefix: str) -> IndexSummary:
    """Concatenate datasets (same token dtype) into ``out_prefix``, in the order given."""
    dtype = validate_indexed_dataset(prefixes[0]).dtype
    with IndexedDatasetWriter(out_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_dataset(prefix)
    return writer.summary
