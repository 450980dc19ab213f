"""Tokenize JSON-lines corpora into megatron-core indexed datasets, streaming and in parallel.

The main process reads the inputs block by block and cuts them into chunks of lines; worker
processes parse and tokenize the chunks; the main process writes the results in input order. At
most ``2 * workers`` chunks are in flight, so memory is flat whatever the input size, and the
output is byte-identical whatever ``workers`` is.

Progress is counted in stored (compressed) input bytes as chunks complete, in order: a bar on a
terminal, a line every ``MEGATRON_TEMPNET_PROGRESS_INTERVAL`` seconds elsewhere
(``megatron_tempnet.utils.progress``); documents, tokens and rates are summed up at the end.

Inputs are split into ``partitions`` contiguous groups of files (balanced by size; an archive's
members count as files). Each group is written as its own dataset; by default the groups are
then merged into one dataset (identical to a single-partition run) and removed,
``keep_partitions`` keeps them apart, and ``partition_index`` processes one group only (one job
per partition on a cluster; merge with ``tools/merge_datasets.py``).

Every dataset written gets its tokenizer record beside it, ``P.tokenizer.json``
(``tokenizer_sidecar``): the tokenizer's type, vocabulary size and the sha256 of its files, so
that a run with another tokenizer refuses the data.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from megatron_tempnet.data.indexed import (
    IndexedDatasetWriter,
    IndexSummary,
    merge_datasets,
    token_dtype,
)
from megatron_tempnet.data.jsonl import (
    InputError,
    InputFile,
    LineChunk,
    expand_inputs,
    iter_line_chunks,
    parse_line,
)
from megatron_tempnet.data.tokenizer_sidecar import write_sidecar
from megatron_tempnet.data.tokenizers import build_tokenizer
from megatron_tempnet.utils.cli import Interrupted, UserError
from megatron_tempnet.utils.logging import get_logger
from megatron_tempnet.utils.progress import progress

logger = get_logger(__name__)


class PreprocessError(UserError, ValueError):
    """A user-facing preprocessing failure: names the flag, or the file and line."""


@dataclass
class PreprocessConfig:
    """What ``tools/preprocess_data.py`` does; fields mirror its flags."""

    inputs: list[str]
    """--input: .jsonl / .jsonl.zst / .jsonl.gz files, directories of them (recursive), globs
    and .tar archives of them, in order (``megatron_tempnet.data.jsonl.expand_inputs``)."""
    output_prefix: str
    """--output-prefix P: writes P_{key}_document.bin/.idx for every JSON key."""
    tokenizer: dict
    """Keyword arguments of ``build_tokenizer`` (--tokenizer-type and its files)."""
    json_keys: tuple[str, ...] = ("text",)
    """--json-keys: the string fields to tokenize (one dataset each)."""
    append_eod: bool = False
    """--append-eod: end every document with the tokenizer's end-of-document id."""
    workers: int = 1
    """--workers: tokenizer processes (1 = tokenize in the main process)."""
    partitions: int = 1
    """--partitions: contiguous groups of input files, each written as a dataset first."""
    keep_partitions: bool = False
    """--keep-partitions: keep the partition datasets instead of merging them."""
    partition_index: int | None = None
    """--partition-index: process only this partition (implies keeping it)."""
    skip_bad_lines: bool = False
    """--skip-bad-lines: skip and count bad lines instead of stopping at the first."""
    overwrite: bool = False
    """--overwrite: replace existing output datasets."""
    chunk_bytes: int = 1 << 20
    """Uncompressed bytes of input per unit of work (2 per worker are in flight)."""


@dataclass
class EncodedChunk:
    source: str
    first_line: int
    nbytes: int
    stored: int  # stored input bytes the chunk completes (progress)
    tokens: dict[str, np.ndarray]  # key -> tokens of the chunk's documents, concatenated
    lengths: dict[str, np.ndarray]  # key -> [n_docs] int32
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    blank: int = 0
    empty: int = 0  # documents with no tokens (left out)


# ---- worker side -------------------------------------------------------------------------------

_WORKER: dict = {}
_TOKENIZE_BATCH = 16  # documents per tokenizer call


def _init_worker(tokenizer: dict, keys: tuple[str, ...], append_eod: bool, dtype: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the workers
    tok = build_tokenizer(**tokenizer)
    _WORKER.update(tokenizer=tok, keys=keys, eod=tok.eod if append_eod else None, dtype=dtype)


def encode_chunk(chunk: LineChunk) -> EncodedChunk:
    """Parse and tokenize one chunk (runs in a worker, after ``_init_worker``)."""
    keys, tok = _WORKER["keys"], _WORKER["tokenizer"]
    result = EncodedChunk(chunk.source, chunk.first_line, chunk.nbytes, chunk.stored, {}, {})
    texts: list[list[str]] = []
    for i, line in enumerate(chunk.lines):
        parsed = parse_line(line, keys)
        if parsed is None:
            result.blank += 1
        elif isinstance(parsed, str):
            result.bad.append((chunk.first_line + i, parsed))
        else:
            texts.append(parsed)
    eod = [] if _WORKER["eod"] is None else [_WORKER["eod"]]
    for k, key in enumerate(keys):
        arrays = []
        # small batches, each turned into compact arrays at once: a tokenizer's per-token
        # Python objects for a whole chunk would cost ~50x the chunk's size in a worker
        for start in range(0, len(texts), _TOKENIZE_BATCH):
            batch = [t[k] for t in texts[start : start + _TOKENIZE_BATCH]]
            for ids in tok.tokenize_batch(batch):
                arrays.append(np.asarray(ids + eod, dtype=_WORKER["dtype"]))
        kept = [a for a in arrays if a.size]
        result.empty += len(arrays) - len(kept)
        empty = np.zeros(0, dtype=_WORKER["dtype"])
        result.tokens[key] = np.concatenate(kept) if kept else empty
        result.lengths[key] = np.asarray([a.size for a in kept], dtype=np.int32)
    return result


# ---- main process ------------------------------------------------------------------------------


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def check_output_free(prefix: str, overwrite: bool) -> None:
    """Refuse to replace an existing dataset unless asked (--overwrite)."""
    if not overwrite and (os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin")):
        raise PreprocessError(f"{prefix}.bin/.idx already exist; pass --overwrite to replace them")


def dataset_prefix(output_prefix: str, key: str, partition: int | None = None) -> str:
    """``P_{key}_document`` (Megatron-LM's naming), or ``P_part{i}_{key}_document``."""
    part = "" if partition is None else f"_part{partition}"
    return f"{output_prefix}{part}_{key}_document"


def split_inputs(inputs: list[InputFile], partitions: int) -> list[list[InputFile]]:
    """Contiguous groups of inputs (files, archive members) with about equal stored size (each
    group non-empty)."""
    if partitions > len(inputs):
        raise PreprocessError(
            f"--partitions ({partitions}) exceeds the number of input files ({len(inputs)}); "
            "partitions are groups of whole files (an archive's members count one each)"
        )
    sizes = np.cumsum([f.size for f in inputs])
    groups, start = [], 0
    for i in range(partitions):
        if i == partitions - 1:
            end = len(inputs)
        else:
            target = sizes[-1] * (i + 1) / partitions
            end = start + 1
            last_allowed = len(inputs) - (partitions - i - 1)
            while end < last_allowed and sizes[end] <= target:
                end += 1
        groups.append(inputs[start:end])
        start = end
    return groups


def _ordered_results(
    chunks: Iterator[LineChunk], pool, max_in_flight: int
) -> Iterator[EncodedChunk]:
    """Results in input order with a bounded number of chunks in flight."""
    if pool is None:
        for chunk in chunks:
            yield encode_chunk(chunk)
        return
    pending: deque = deque()
    try:
        for chunk in chunks:
            pending.append(pool.apply_async(encode_chunk, (chunk,)))
            if len(pending) >= max_in_flight:
                yield pending.popleft().get()
    except InputError:
        while pending:  # report a bad line earlier in the file before the read error
            yield pending.popleft().get()
        raise
    while pending:
        yield pending.popleft().get()


class _Tally:
    """Counts for the final report; moves the progress reporter on by each chunk's bytes."""

    def __init__(self, bar):
        self.bar, self.start = bar, time.monotonic()
        self.docs = self.tokens = self.nbytes = self.bad = self.blank = self.empty = 0
        self.reasons: Counter = Counter()

    def add(self, res: EncodedChunk, keys: tuple[str, ...]) -> None:
        self.docs += int(res.lengths[keys[0]].size)
        self.tokens += sum(int(res.lengths[k].sum(dtype=np.int64)) for k in keys)
        self.nbytes += res.nbytes
        self.blank += res.blank
        self.empty += res.empty
        self.bar.update(res.stored)

    def skipped(self, reason: str) -> None:
        """Count a bad line skipped (--skip-bad-lines), by the reason's kind."""
        self.bad += 1
        self.reasons[reason.split(" (")[0]] += 1

    def line(self) -> str:
        secs = max(time.monotonic() - self.start, 1e-9)
        return (
            f"{self.docs:,} documents, {self.tokens:,} tokens, {self.nbytes / 1e6:,.1f} MB of "
            f"text in {secs:.1f} s ({self.docs / secs:,.0f} docs/s, {self.tokens / secs:,.0f} "
            f"tokens/s, {self.nbytes / 1e6 / secs:.2f} MB/s)"
        )


def _consume(config: PreprocessConfig, files: list[InputFile], pool, writers, tally) -> None:
    keys = config.json_keys
    chunks = iter_line_chunks(files, config.chunk_bytes)
    for res in _ordered_results(chunks, pool, 2 * max(config.workers, 1)):
        for line_no, reason in res.bad:
            where = f"{res.source}:{line_no}: {reason}"
            if not config.skip_bad_lines:
                raise PreprocessError(f"{where} (--skip-bad-lines skips and counts such lines)")
            logger.warning("skipped %s", where)
            tally.skipped(reason)
        for key in keys:
            writers[key].add_documents(res.tokens[key], res.lengths[key])
        tally.add(res, keys)


def _write_partition(config, files, prefixes, dtype, pool, tally) -> list[IndexSummary]:
    writers: dict[str, IndexedDatasetWriter] = {}
    try:
        for key in config.json_keys:
            writers[key] = IndexedDatasetWriter(prefixes[key], dtype)
        _consume(config, files, pool, writers, tally)
        empty = [key for key, w in writers.items() if w.num_documents == 0]
        if empty:
            raise PreprocessError(
                f"no documents with tokens under key(s) {empty} in {_names(files)}; nothing written"
            )
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return [writers[key].finalize() for key in config.json_keys]


def _names(files: list[InputFile], shown: int = 3) -> str:
    names = ", ".join(f.name for f in files[:shown])
    return names + (f" and {len(files) - shown} more" if len(files) > shown else "")


def _check_config(config: PreprocessConfig) -> None:
    if config.workers < 1:
        raise PreprocessError(f"--workers ({config.workers}) must be >= 1")
    if config.partitions < 1:
        raise PreprocessError(f"--partitions ({config.partitions}) must be >= 1")
    if config.partition_index is not None and not 0 <= config.partition_index < config.partitions:
        raise PreprocessError(
            f"--partition-index ({config.partition_index}) must be in [0, --partitions "
            f"({config.partitions}))"
        )
    if not config.json_keys or len(set(config.json_keys)) != len(config.json_keys):
        keys = list(config.json_keys)
        raise PreprocessError(f"--json-keys {keys} must be distinct and non-empty")
    out_dir = os.path.dirname(os.path.abspath(config.output_prefix))
    if not os.path.isdir(out_dir):
        raise PreprocessError(f"--output-prefix {config.output_prefix!r}: no directory {out_dir}")


def _planned_outputs(config: PreprocessConfig) -> list[str]:
    separate = config.keep_partitions or config.partition_index is not None
    if config.partitions == 1 or not separate:
        return [dataset_prefix(config.output_prefix, k) for k in config.json_keys]
    parts = range(config.partitions) if config.partition_index is None else [config.partition_index]
    return [dataset_prefix(config.output_prefix, k, p) for p in parts for k in config.json_keys]


def run_preprocess(config: PreprocessConfig) -> list[IndexSummary]:
    """Run a whole preprocessing job; returns the summaries of the datasets written."""
    _check_config(config)
    tokenizer = build_tokenizer(**config.tokenizer)
    if config.append_eod and tokenizer.eod is None:
        raise PreprocessError(f"--append-eod: {tokenizer!r} has no end-of-document token")
    dtype = token_dtype(tokenizer.vocab_size)
    files = expand_inputs(config.inputs)
    groups = split_inputs(files, config.partitions)
    for prefix in _planned_outputs(config):
        check_output_free(prefix, config.overwrite)
    todo = groups if config.partition_index is None else [groups[config.partition_index]]
    total = sum(f.size for group in todo for f in group)
    logger.info(
        "tokenizer %r, token dtype %s, %d input file(s) to read (%.1f MB), %d worker(s)",
        tokenizer,
        np.dtype(dtype).name,
        sum(len(group) for group in todo),
        total / 1e6,
        config.workers,
    )
    init_args = (config.tokenizer, tuple(config.json_keys), config.append_eod, np.dtype(dtype).name)
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    pool = None
    try:
        if config.workers > 1:
            pool = mp.get_context("spawn").Pool(config.workers, _init_worker, init_args)
        else:
            _init_worker(*init_args)
            signal.signal(signal.SIGINT, _raise_interrupted)
        with progress("preprocessing", total, unit="MB", scale=1e6) as bar:
            tally = _Tally(bar)
            summaries = _run_partitions(config, groups, dtype, pool, tally)
    finally:
        if pool is not None:
            # close + join: the chunks still in flight (bounded) finish. Pool.terminate() can
            # deadlock when it kills a worker that holds the result queue's lock.
            pool.close()
            pool.join()
        for s, handler in previous.items():
            signal.signal(s, handler)
    files = [os.path.abspath(f) for f in tokenizer.files]
    for summary in summaries:
        write_sidecar(summary.prefix, tokenizer.identity, files)
    _report(tally, summaries)
    return summaries


def _run_partitions(config, groups, dtype, pool, tally) -> list[IndexSummary]:
    keys = config.json_keys
    if config.partitions == 1:
        prefixes = {k: dataset_prefix(config.output_prefix, k) for k in keys}
        return _write_partition(config, groups[0], prefixes, dtype, pool, tally)
    indices = [config.partition_index] if config.partition_index is not None else []
    indices = indices or list(range(config.partitions))
    summaries = []
    for p in indices:
        prefixes = {k: dataset_prefix(config.output_prefix, k, p) for k in keys}
        logger.info("partition %d/%d: %d file(s)", p, config.partitions, len(groups[p]))
        summaries += _write_partition(config, groups[p], prefixes, dtype, pool, tally)
    if config.keep_partitions or config.partition_index is not None:
        return summaries
    merged = []
    for key in keys:
        parts = [dataset_prefix(config.output_prefix, key, p) for p in indices]
        merged.append(merge_datasets(parts, dataset_prefix(config.output_prefix, key)))
        for part in parts:
            os.remove(part + ".idx")
            os.remove(part + ".bin")
    return merged


def _report(tally: _Tally, summaries: list[IndexSummary]) -> None:
    logger.info("done: %s", tally.line())
    for s in summaries:
        logger.info(
            "wrote %s.bin/.idx/.tokenizer.json: %d documents, %d tokens, %s",
            s.prefix,
            s.num_documents,
            s.num_tokens,
            np.dtype(s.dtype).name,
        )
    if tally.bad:
        detail = ", ".join(f"{r}: {n}" for r, n in tally.reasons.most_common())
        logger.warning("skipped %d bad line(s) (%s)", tally.bad, detail)
    if tally.blank:
        logger.info("ignored %d blank line(s)", tally.blank)
    if tally.empty:
        logger.warning("left out %d document(s) with no tokens", tally.empty)
