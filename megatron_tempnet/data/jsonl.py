"""Streaming readers for ``.jsonl``, ``.jsonl.zst`` (OpenWebText2's format) and ``.jsonl.gz``.

Files are read in fixed-size blocks and split into lines, so memory does not depend on the file
size. A truncated compressed stream raises ``InputError`` naming the file and the last complete
line, instead of ending quietly (python-zstandard's stream reader returns a truncated frame's
partial data without complaint).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_tempnet.utils.cli import UserError

_READ_BLOCK = 1 << 20  # compressed bytes per read
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".jsonl.gz", ".json.zst", ".json.gz")


class InputError(UserError, ValueError):
    """Unreadable input: names the file and, where there is one, the line."""


@dataclass
class LineChunk:
    """Consecutive lines of one input file, the unit of work sent to a worker."""

    source: str
    first_line: int  # 1-based line number of lines[0]
    lines: list[bytes]
    nbytes: int  # uncompressed bytes, newlines included


def expand_inputs(paths: list[str]) -> list[str]:
    """Files as given, directories expanded to their supported files in sorted order."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(path, f) for f in os.listdir(path) if f.endswith(SUPPORTED_SUFFIXES)
            )
            if not found:
                raise InputError(f"--input {path!r}: directory holds no {SUPPORTED_SUFFIXES} files")
            files += found
        else:
            check_input_path(path)
            files.append(path)
    return files


def check_input_path(path: str) -> None:
    if not os.path.isfile(path):
        raise InputError(f"--input {path!r}: no such file")
    if not path.endswith(SUPPORTED_SUFFIXES):
        raise InputError(
            f"--input {path!r}: unknown format; expected one of {', '.join(SUPPORTED_SUFFIXES)}"
        )


def _zstd_blocks(path: str, fh) -> Iterator[bytes]:
    """Decompressed blocks of a (multi-frame) zstd file; raise if the last frame is cut short."""
    import zstandard

    dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)  # accept --long=31 archives
    dobj, fed = dctx.decompressobj(), False
    for raw in iter(lambda: fh.read(_READ_BLOCK), b""):
        while raw:
            try:
                out = dobj.decompress(raw)
            except zstandard.ZstdError as e:
                raise InputError(f"{path}: corrupt zstd data ({e})") from None
            fed = True
            if out:
                yield out
            if dobj.eof:  # frame finished: the rest of the block starts the next frame
                raw, dobj, fed = dobj.unused_data, dctx.decompressobj(), False
            else:
                raw = b""
    if fed and not dobj.eof:
        raise InputError(f"{path}: truncated zstd stream (the file ends inside a frame)")


def _gzip_blocks(path: str, fh) -> Iterator[bytes]:
    with gzip.GzipFile(fileobj=fh) as gz:
        while True:
            try:
                out = gz.read(_READ_BLOCK)
            except EOFError:
                raise InputError(f"{path}: truncated gzip stream (the file ends early)") from None
            except (gzip.BadGzipFile, zlib.error) as e:
                raise InputError(f"{path}: corrupt gzip data ({e})") from None
            if not out:
                return
            yield out


def _plain_blocks(fh) -> Iterator[bytes]:
    yield from iter(lambda: fh.read(_READ_BLOCK), b"")


def iter_line_chunks(path: str, chunk_bytes: int = 1 << 20) -> Iterator[LineChunk]:
    """Yield the lines of ``path`` (without newlines) in chunks of about ``chunk_bytes``."""
    with open(path, "rb") as fh:
        if path.endswith(".zst"):
            blocks = _zstd_blocks(path, fh)
        elif path.endswith(".gz"):
            blocks = _gzip_blocks(path, fh)
        else:
            blocks = _plain_blocks(fh)
        line_no, pending, chunk, chunk_bytes_now = 1, b"", [], 0
        try:
            for block in blocks:
                lines = (pending + block).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    chunk.append(line)
                    chunk_bytes_now += len(line) + 1
                    if chunk_bytes_now >= chunk_bytes:
                        yield LineChunk(path, line_no, chunk, chunk_bytes_now)
                        line_no += len(chunk)
                        chunk, chunk_bytes_now = [], 0
        except InputError as e:
            last = line_no + len(chunk) - 1
            raise InputError(f"{e} (after line {last})") from None
        if pending:
            chunk.append(pending)
            chunk_bytes_now += len(pending)
        if chunk:
            yield LineChunk(path, line_no, chunk, chunk_bytes_now)


def parse_line(line: bytes, keys: tuple[str, ...]) -> list[str] | str | None:
    """The strings under ``keys`` of one JSON line; a str is the reason the line is bad.

    Returns None for a blank line.
    """
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        return f"invalid UTF-8 ({e.reason} at byte {e.start})"
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    texts = []
    for key in keys:
        if key not in obj:
            return f"missing key {key!r}"
        value = obj[key]
        if not isinstance(value, str):
            return f"key {key!r} holds {type(value).__name__}, expected a string"
        texts.append(value)
    return texts
