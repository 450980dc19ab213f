"""A dataset's range of token ids against the run's vocabulary, scanned once and cached.

An id the vocabulary does not have is wrong data that no layer reports well: at TP = 1 the
embedding raises ``IndexError`` in one process; at TP > 1 megatron-core's vocabulary-parallel
embedding gives it a zero vector and the run trains on it to the end; an id in ``[vocab, padded
vocab)`` reads a padding row at any TP. So a run compares every dataset's largest and smallest id
with its vocabulary size before it builds anything from the data (``check_token_ids``).

The scan (``scan_token_range``) reads ``PREFIX.bin`` once, memory-mapped, ``_BLOCK`` tokens at a
time (memory stays flat). Measured on the project's 2-core development VM with a 2.1 GB uint16
``.bin`` (one core): 0.08 s per GB from the page cache, 0.5 s per GB after evicting it (the
disk's read rate), so about 20 s for a 40 GB dataset read from disk, once. Writing that data cost
~630 s per GB of ``.bin`` per preprocessing worker (docs/performance.md). The result is cached
in a small JSON file beside megatron-core's sample-index cache (``cache_file``), valid while the
size, modification time and inode of both ``PREFIX.bin`` and ``PREFIX.idx`` are unchanged: a
rewritten dataset is scanned again, an unchanged one never.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

import numpy as np

from megatron_tempnet.data.indexed import DatasetError, stored_dtype
from megatron_tempnet.utils.files import write_atomic
from megatron_tempnet.utils.logging import get_logger
from megatron_tempnet.utils.progress import progress

logger = get_logger(__name__)

FORMAT = "megatron_tempnet.token_range/1"
_BLOCK = 1 << 24  # tokens per block (32 MB of uint16)
_SHOW_PROGRESS = 1 << 30  # bytes: a scan of a larger .bin reports its progress


@dataclass(frozen=True)
class TokenRange:
    """The smallest and largest id in ``PREFIX.bin`` and where each first occurs (token offsets
    from the start of the file); None for a dataset without tokens."""

    tokens: int
    min_id: int | None
    min_at: int | None
    max_id: int | None
    max_at: int | None


def scan_token_range(prefix: str) -> TokenRange:
    """One pass over ``prefix.bin`` (``_BLOCK`` tokens at a time, memory-mapped)."""
    path = prefix + ".bin"
    nbytes = os.path.getsize(path)
    if nbytes == 0:
        return TokenRange(0, None, None, None, None)
    try:
        tokens = np.memmap(path, dtype=stored_dtype(prefix), mode="r")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it ({e})") from None
    lo = hi = lo_at = hi_at = None
    desc = f"token ids of {os.path.basename(path)}"
    with progress(desc, nbytes, unit="MB", scale=1e6, enabled=nbytes >= _SHOW_PROGRESS) as bar:
        for start in range(0, tokens.size, _BLOCK):
            block = tokens[start : start + _BLOCK]
            block_hi, block_lo = int(block.max()), int(block.min())
            if hi is None or block_hi > hi:  # argmax only where the maximum grows
                hi, hi_at = block_hi, start + int(block.argmax())
            if lo is None or block_lo < lo:
                lo, lo_at = block_lo, start + int(block.argmin())
            bar.update(block.nbytes)
    return TokenRange(int(tokens.size), lo, lo_at, hi, hi_at)


def cache_file(prefix: str, cache_dir: str | None) -> str:
    """``CACHE/NAME-<hash of the dataset's real path>-token_range.json``; without a cache
    directory ``PREFIX/cache/token_range.json`` (where megatron-core then puts the indices)."""
    if cache_dir is None:
        return os.path.join(prefix, "cache", "token_range.json")
    key = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"{os.path.basename(prefix)}-{key}-token_range.json")


def _files_key(prefix: str) -> dict:
    """What tells a rewritten dataset from the one scanned: size, mtime (ns), inode."""
    key = {}
    for ext in ("bin", "idx"):
        st = os.stat(f"{prefix}.{ext}")
        key[ext] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return key


def _read_cache(path: str, key: dict) -> TokenRange | None:
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if record.get("format") != FORMAT or record.get("files") != key:
            return None  # another version's, or the dataset changed since
        return TokenRange(**record["range"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or damaged: scan again


def cached_token_range(prefix: str, cache_dir: str | None) -> TokenRange:
    """``scan_token_range(prefix)``, from the cache while the dataset is unchanged."""
    path, key = cache_file(prefix, cache_dir), _files_key(prefix)
    found = _read_cache(path, key)
    if found is not None:
        return found
    found = scan_token_range(prefix)
    record = {"format": FORMAT, "files": key, "range": asdict(found)}
    try:
        write_atomic(path, json.dumps(record, indent=2) + "\n")
    except OSError as e:  # a read-only dataset directory: correct, only slower next time
        logger.warning(
            "cannot cache the token id range of %s in %s (%s): the next start-up scans it "
            "again; --data-cache-path DIR keeps the cache elsewhere",
            prefix,
            path,
            e,
        )
    return found


def check_token_ids(prefix: str, vocab_size: int, cache_dir: str | None) -> TokenRange:
    """Raise ``DatasetError`` when ``prefix`` holds an id outside ``[0, vocab_size)``."""
    found = cached_token_range(prefix, cache_dir)
    if found.tokens and found.max_id >= vocab_size:
        bad, where = found.max_id, found.max_at
    elif found.tokens and found.min_id < 0:
        bad, where = found.min_id, found.min_at
    else:
        return found
    raise DatasetError(
        f"dataset {prefix} holds token id {bad} (first at token {where} of {prefix}.bin), "
        f"outside the run's vocabulary of {vocab_size} ids: it was tokenised with another "
        "tokenizer or is corrupt; re-run tools/preprocess_data.py with the run's tokenizer"
    )
