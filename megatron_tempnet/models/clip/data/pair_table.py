"""Image-text pairs held compactly, and the cached member index of a tar shard.

``PairTable``: every pair's caption, label, image path (manifests) and where it came from are
UTF-8 bytes in four growing buffers with int64 offsets; a tar image is its shard's number, byte
offset and size. No Python object per pair: 52 bytes per pair plus the text itself
(``benchmarks/clip_data_bench.py`` measures it at 1M pairs).

``shard_index(path, cache_dir)``: a tar shard's members grouped by sample key, built by one scan
of its headers and cached as JSON beside the shard (``SHARD.tar.idx.json``) or in
``--data-cache-path``, valid while the shard's size and modification time are those recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from array import array

import numpy as np

from megatron_tempnet.utils.logging import get_logger

INDEX_FORMAT = 1
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
TEXT_SUFFIXES = (".txt", ".json", ".cls")


class _Strings:
    """Strings appended into one UTF-8 buffer; ``[i]`` decodes string ``i``."""

    def __init__(self):
        self.data, self.ends = bytearray(), array("q")

    def append(self, text: str) -> None:
        self.data += text.encode("utf-8", "surrogateescape")
        self.ends.append(len(self.data))

    def freeze(self) -> None:
        self.data, self.ends = bytes(self.data), np.frombuffer(self.ends, dtype=np.int64).copy()

    def __getitem__(self, i: int) -> str:
        start = int(self.ends[i - 1]) if i else 0
        return self.data[start : int(self.ends[i])].decode("utf-8", "surrogateescape")

    def nbytes(self) -> int:
        return len(self.data) + 8 * len(self.ends)


class PairTable:
    """The pairs of a dataset, in order: ``add`` them, ``freeze``, then read by index."""

    def __init__(self):
        self.sources: list[str] = []  # file paths
        self._source, self._offset, self._size = array("i"), array("q"), array("q")
        self._text = {k: _Strings() for k in ("caption", "label", "where", "path")}

    def source(self, path: str) -> int:
        """The number of a source file (added once)."""
        self.sources.append(path)
        return len(self.sources) - 1

    def add(self, source: int, where: str, image: str | tuple[int, int], caption: str,
            label: str) -> None:  # fmt: skip
        """``where``: the line (manifest) or sample key (tar); ``image``: a path, or the
        ``(offset, size)`` of a member of the source shard."""
        self._source.append(source)
        offset, size = (-1, -1) if isinstance(image, str) else image
        self._offset.append(offset)
        self._size.append(size)
        for key, value in (("caption", caption), ("label", label), ("where", where),
                           ("path", image if isinstance(image, str) else "")):  # fmt: skip
            self._text[key].append(value)

    def freeze(self) -> PairTable:
        for name in ("_source", "_offset", "_size"):
            kind = np.int32 if name == "_source" else np.int64
            setattr(self, name, np.frombuffer(getattr(self, name), dtype=kind).copy())
        for strings in self._text.values():
            strings.freeze()
        return self

    def __len__(self) -> int:
        return len(self._source)

    def caption(self, i: int) -> str:
        return self._text["caption"][i]

    def label(self, i: int) -> str:
        return self._text["label"][i]

    def where(self, i: int) -> str:
        return f"{self.sources[self._source[i]]}:{self._text['where'][i]}"

    def image(self, i: int) -> str | tuple[str, int, int]:
        """A path, or ``(shard, offset, size)``."""
        if self._offset[i] < 0:
            return self._text["path"][i]
        return self.sources[self._source[i]], int(self._offset[i]), int(self._size[i])

    def nbytes(self) -> int:
        """Bytes held for the pairs (arrays and text buffers)."""
        arrays = sum(getattr(self, n).nbytes for n in ("_source", "_offset", "_size"))
        return arrays + sum(s.nbytes() for s in self._text.values())


def _cache_file(path: str, cache_dir: str | None) -> str:
    if cache_dir:
        digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
        return os.path.join(
            cache_dir, "clip_shard_index", f"{digest}-{os.path.basename(path)}.json"
        )
    return path + ".idx.json"


def _stamp(path: str) -> dict:
    st = os.stat(path)
    return {"format": INDEX_FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def scan_shard(path: str) -> list[list]:
    """One pass over the shard's headers: ``[key, image offset, image size, {suffix: text},
    problem]`` per sample key, in member order (offset -1: no image)."""
    groups: dict[str, list] = {}
    with tarfile.open(path, mode="r:") as tar:  # "r:": offsets must be file offsets
        for member in tar:
            if not member.isfile():
                continue
            folder, name = os.path.split(member.name)
            stem, _, suffix = name.partition(".")
            suffix = "." + suffix.lower()
            group = groups.setdefault(os.path.join(folder, stem), [-1, -1, {}, ""])
            if suffix not in IMAGE_SUFFIXES and suffix not in TEXT_SUFFIXES:
                continue
            slot = "image" if suffix in IMAGE_SUFFIXES else suffix
            if (slot == "image" and group[0] >= 0) or slot in group[2]:
                group[3] = f"two {slot} members ({member.name})"
            elif slot == "image":
                group[0], group[1] = member.offset_data, member.size
            else:
                raw = tar.extractfile(member).read()
                group[2][slot] = raw.decode("utf-8", "surrogateescape")
    return [[key, *group] for key, group in groups.items()]


def shard_index(path: str, cache_dir: str | None = None) -> list[list]:
    """``scan_shard(path)``, from its cache when the shard is unchanged; a new scan is cached
    (a cache that cannot be written is reported once and the scan used)."""
    cache, stamp = _cache_file(path, cache_dir), _stamp(path)
    try:
        with open(cache) as f:
            saved = json.load(f)
        if all(saved.get(k) == v for k, v in stamp.items()):
            return saved["groups"]
    except (OSError, ValueError):
        pass
    groups = scan_shard(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.partial"
        with open(tmp, "w") as f:
            json.dump({**stamp, "groups": groups}, f)
        os.replace(tmp, cache)
    except OSError as e:
        get_logger(__name__).warning(
            "%s: cannot write its member index %s (%s): every run scans it; give "
            "--data-cache-path a writable directory", path, cache, e.strerror or e,
        )  # fmt: skip
    return groups
