"""Inputs and streaming readers for ``.jsonl``, ``.jsonl.zst`` (OpenWebText2's format) and
``.jsonl.gz``, as files or as members of ``.tar`` archives.

``expand_inputs`` turns the ``--input`` values into a list of ``InputFile``: a file as given, a
directory's files (recursively) and a glob's matches, and an archive's members, each sorted by
path, directory by directory (``path_order``). An archive therefore gives what its extracted
directory gives, in the same order. Members are read in place (a seek to their data), never
extracted.

Inputs are read in fixed-size blocks and split into lines, so memory does not depend on the
input size. A truncated compressed stream raises ``InputError`` naming the input and the last
complete line, instead of ending quietly (python-zstandard's stream reader returns a truncated
frame's partial data without complaint).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.logging import get_logger

logger = get_logger(__name__)

_READ_BLOCK = 1 << 20  # compressed bytes per read
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".jsonl.gz", ".json.zst", ".json.gz")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_GLOB_CHARS = "*?["
_NAMED_SKIPS = 10  # skipped files named in a warning, the rest counted


class InputError(UserError, ValueError):
    """Unreadable input: names the file (``archive:member``) and, where there is one, the line."""


@dataclass(frozen=True)
class InputFile:
    """One stream of JSON lines: a file, or a member of a tar archive."""

    path: str
    """The file, or the archive that holds the member."""
    size: int
    """Bytes as stored (compressed): the unit of progress and of partition balance."""
    member: str | None = None
    """The member's name inside the archive (None for a plain file)."""
    offset: int = 0
    """Where the member's data starts in the (uncompressed) tar stream."""

    @property
    def name(self) -> str:
        """``path``, or ``archive.tar:member`` (how messages name the input)."""
        return self.path if self.member is None else f"{self.path}:{self.member}"


@dataclass
class LineChunk:
    """Consecutive lines of one input, the unit of work sent to a worker."""

    source: str  # InputFile.name
    first_line: int  # 1-based line number of lines[0]
    lines: list[bytes]
    nbytes: int  # uncompressed bytes, newlines included
    stored: int = 0  # stored (compressed) bytes of the input read up to this chunk's end


def expand_inputs(paths: list[str]) -> list[InputFile]:
    """The ``--input`` values as a list of inputs, in order.

    A file is taken as it is (an archive: its members); a directory gives its files recursively
    and a glob (``'data/**/*.jsonl.zst'``, quoted against the shell) its matching files, both
    sorted by path; an archive gives its members sorted by name. Files and members of other
    formats inside a directory, glob or archive are skipped with a warning naming each.
    """
    inputs: list[InputFile] = []
    for path in paths:
        if os.path.isdir(path):
            found = _directory_files(path)
            if not found:
                raise InputError(f"--input {path!r}: the directory holds no {_formats()} files")
        elif not os.path.exists(path) and any(c in path for c in _GLOB_CHARS):
            found = _glob_files(path)
        else:
            check_input_path(path)
            found = [path]
        for file in found:
            inputs += _archive_members(file) if _is_archive(file) else [_plain(file)]
    return inputs


def check_input_path(path: str) -> None:
    if not os.path.isfile(path):
        raise InputError(f"--input {path!r}: no such file")
    if not _is_readable_format(path):
        raise InputError(f"--input {path!r}: unknown format; expected {_formats()}")


def _formats() -> str:
    return ", ".join(SUPPORTED_SUFFIXES + ARCHIVE_SUFFIXES)


def _is_archive(name: str) -> bool:
    return name.endswith(ARCHIVE_SUFFIXES)


def _is_readable_format(name: str) -> bool:
    return name.endswith(SUPPORTED_SUFFIXES) or _is_archive(name)


def _gzipped(archive: str) -> bool:
    return archive.endswith((".tar.gz", ".tgz"))


def _plain(path: str) -> InputFile:
    return InputFile(path, os.path.getsize(path))


def _directory_files(directory: str) -> list[str]:
    """Supported files under ``directory`` at any depth, in ``path_order``."""
    found, skipped = [], []
    for folder, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(folder, name)
            (found if _is_readable_format(name) else skipped).append(path)
    _warn_skipped(f"directory {directory}", sorted(skipped, key=path_order))
    return sorted(found, key=path_order)


def _glob_files(pattern: str) -> list[str]:
    """Files matching ``pattern`` (``**`` spans directories) in ``path_order``; matched
    directories are left out (a glob selects files)."""
    matches = sorted(glob.glob(pattern, recursive=True), key=path_order)
    if not matches:
        raise InputError(f"--input {pattern!r}: the pattern matches no file")
    files = [m for m in matches if os.path.isfile(m)]
    _warn_skipped(f"pattern {pattern!r}", [f for f in files if not _is_readable_format(f)])
    found = [f for f in files if _is_readable_format(f)]
    if not found:
        raise InputError(f"--input {pattern!r}: the pattern matches no {_formats()} file")
    return found


def _archive_members(path: str) -> list[InputFile]:
    """The supported regular-file members of a tar archive, in ``path_order`` of their names."""
    members, skipped = [], []
    try:
        with tarfile.open(path, "r:gz" if _gzipped(path) else "r:") as tar:
            for info in tar:
                if info.isdir():
                    continue
                if info.isreg() and info.name.endswith(SUPPORTED_SUFFIXES):
                    if info.sparse is not None:
                        raise InputError(f"{path}:{info.name}: sparse members are not supported")
                    members.append(InputFile(path, info.size, info.name, info.offset_data))
                else:
                    skipped.append(f"{path}:{info.name}")
            # tarfile stops quietly where a truncated archive ends between two members: the
            # end-of-archive marker (zero blocks) must follow the last member
            tar.fileobj.seek(tar.offset)
            if len(tar.fileobj.read(tarfile.BLOCKSIZE)) < tarfile.BLOCKSIZE:
                raise InputError(f"{path}: truncated archive (no end-of-archive marker)")
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise InputError(f"{path}: unreadable tar archive ({e})") from None
    _warn_skipped(f"archive {path}", skipped)
    if not members:
        raise InputError(
            f"--input {path!r}: the archive holds no {', '.join(SUPPORTED_SUFFIXES)} files"
        )
    return sorted(members, key=lambda m: path_order(m.member))


def path_order(path: str) -> list[str]:
    """Sort key of files and members: by directory, then name, at every level (as a sorted
    recursive listing, or ``tar --sort=name``), so that ``a/x`` comes before ``a-1``."""
    return path.split("/")


def _warn_skipped(where: str, names: list[str]) -> None:
    if not names:
        return
    listed = ", ".join(names[:_NAMED_SKIPS])
    more = f" and {len(names) - _NAMED_SKIPS} more" if len(names) > _NAMED_SKIPS else ""
    logger.warning("%s: skipped %d file(s) of other formats: %s%s", where, len(names), listed, more)


class _Reader:
    """The stored bytes of one input (a file, or a member's slice of an open archive), counted
    for the progress report."""

    def __init__(self, item: InputFile, fh, limit: int | None = None):
        self.item, self.fh, self.left, self.consumed = item, fh, limit, 0
        self.name = item.name

    def read(self, n: int = -1) -> bytes:
        if self.left is not None:
            n = self.left if n < 0 else min(n, self.left)
        try:
            data = self.fh.read(n)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise InputError(f"{self.item.path}: corrupt or truncated archive ({e})") from None
        if self.left is not None:
            if len(data) < n:
                raise InputError(f"{self.name}: truncated archive (it ends inside this member)")
            self.left -= len(data)
        self.consumed += len(data)
        return data


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


def iter_line_chunks(
    inputs: Iterable[InputFile], chunk_bytes: int = 1 << 20
) -> Iterator[LineChunk]:
    """The lines of every input in turn (without newlines), in chunks of about ``chunk_bytes``.

    The members of one archive are read from one open archive, each after a seek to its data;
    in a ``.tar.gz`` a seek forward decompresses and discards, so members stored in name order
    (``tar --sort=name``) cost one pass, and each member out of that order a pass more.
    """
    archive_path, archive = None, None
    try:
        for item in inputs:
            if item.member is None:
                with open(item.path, "rb") as fh:
                    yield from _chunks(_Reader(item, fh), chunk_bytes)
                continue
            if item.path != archive_path:
                if archive is not None:
                    archive.close()
                archive_path, archive = item.path, _open_archive(item.path)
            try:
                archive.seek(item.offset)
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise InputError(f"{item.path}: corrupt or truncated archive ({e})") from None
            yield from _chunks(_Reader(item, archive, limit=item.size), chunk_bytes)
    finally:
        if archive is not None:
            archive.close()


def _open_archive(path: str):
    return gzip.open(path, "rb") if _gzipped(path) else open(path, "rb")


def _chunks(reader: _Reader, chunk_bytes: int) -> Iterator[LineChunk]:
    """The chunks of one input; each carries the stored bytes read since the previous one."""
    item = reader.item
    if item.name.endswith(".zst"):
        blocks = _zstd_blocks(item.name, reader)
    elif item.name.endswith(".gz"):
        blocks = _gzip_blocks(item.name, reader)
    else:
        blocks = _plain_blocks(reader)
    line_no, pending, chunk, nbytes, counted = 1, b"", [], 0, 0
    try:
        for block in blocks:
            lines = (pending + block).split(b"\n")
            pending = lines.pop()
            for line in lines:
                chunk.append(line)
                nbytes += len(line) + 1
                if nbytes >= chunk_bytes:
                    stored = min(reader.consumed, item.size) - counted
                    yield LineChunk(item.name, line_no, chunk, nbytes, stored)
                    line_no, counted = line_no + len(chunk), counted + stored
                    chunk, nbytes = [], 0
    except InputError as e:
        last = line_no + len(chunk) - 1
        raise InputError(f"{e} (after line {last})") from None
    if pending:
        chunk.append(pending)
        nbytes += len(pending)
    if chunk or counted < item.size:  # the last chunk completes the input's bytes
        yield LineChunk(item.name, line_no, chunk, nbytes, item.size - counted)


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
