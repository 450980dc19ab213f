"""Image-text pairs for CLIP: manifests and WebDataset-style tar shards, with a stable index.

Sources, in the order given:

- a manifest ``.csv``/``.tsv`` (a header row naming the columns) or ``.jsonl`` (one JSON object
  per line): one pair per row; ``--image-key`` holds the image path (relative paths are relative
  to the manifest's directory), ``--caption-key`` the caption, ``--label-key`` (optional) a class
  name or an image id for evaluation;
- a ``.tar`` shard (uncompressed), or a directory = its sorted ``.tar`` files: members grouped by
  key, the name up to the first dot of its file name (``KEY.jpg|jpeg|png|webp|bmp`` with
  ``KEY.txt``, optionally ``KEY.json`` holding the ``--label-key`` field, or ``KEY.cls``). Images
  are read by offset through a handle each process opens lazily, never the whole shard. The
  members are found by one scan of the shard's headers, cached (``pair_table.shard_index``)
  beside the shard or in ``--data-cache-path`` and reused while the shard is unchanged.

The pairs are held in a ``pair_table.PairTable`` (text buffers and arrays, no Python object per
pair).

Sample ``i`` is the ``i``-th pair over the sources (rows in file order, tar samples in member
order): the per-sample state of the CLIP losses is keyed by it. A bad row or member (missing
column, empty caption, missing image, a caption without an image...) stops construction with an
error naming the file and the line or member; with ``--skip-bad-samples`` it is dropped, counted
and reported in one warning. An image that cannot be decoded is reported when read; with
``--skip-bad-samples`` the next readable pair takes its place (with its own index). Reads take
the augmentation's epoch, ``get(index, epoch)``; ``shuffled_epochs`` gives each training
position its pair and epoch.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from megatron_tempnet.models.clip.data.captions import (
    no_eod_message,
    noisy_caption,
    tokenize_captions,
)
from megatron_tempnet.models.clip.data.pair_table import IMAGE_SUFFIXES, PairTable, shard_index
from megatron_tempnet.models.clip.data.transforms import DECODE_ERRORS, image_tensor
from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.flags import derived, option
from megatron_tempnet.utils.logging import get_logger, warn_rank0

logger = get_logger(__name__)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's RGB normalisation
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
GRAY_MEAN, GRAY_STD = (0.5,), (0.5,)
MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl")
SKIP_HINT = "fix or remove it, or pass --skip-bad-samples"


class ImageTextDataError(UserError, ValueError):
    """Bad image-text input; the message names the file, the line (manifest) or member (tar),
    and what to do."""


@dataclass
class ImageTextDataConfig:
    """Where the pairs are and how a pair becomes tensors (validated by ``validate``)."""

    paths: list[str] = option(name="--train-data", metavar="PATH")
    """Training pairs: manifests (.csv, .tsv, .jsonl: an image path and a caption per row) and/or
    .tar shards; a directory stands for its sorted .tar files."""
    image_key: str = "image"
    """The manifest column (JSON key) with the image path; relative paths are relative to the
    manifest's directory."""
    caption_key: str = "caption"
    """The manifest column (JSON key) with the caption."""
    label_key: str | None = None
    """A class name or image id per pair, for retrieval and zero-shot evaluation; in tar shards
    the KEY.json field of that name, else KEY.cls."""
    image_size: int = derived(224)
    """The model's --image-size: images become [C, image_size, image_size]."""
    image_channels: int = derived(3)
    """The model's --image-channels: 3 = RGB, 1 = grayscale."""
    image_mean: tuple[float, ...] | None = None
    """Normalisation mean per channel, or one value for all (default: OpenAI CLIP's for RGB, 0.5
    for grayscale)."""
    image_std: tuple[float, ...] | None = None
    """Normalisation standard deviation per channel, or one value for all (default: OpenAI
    CLIP's for RGB, 0.5 for grayscale)."""
    augment: bool = option(False, name="--image-augment")
    """Random resized crops (area 0.9-1.0, aspect 3/4-4/3) seeded by (seed, epoch, index), so
    independent of the data-parallel layout and the worker."""
    context_length: int = derived(77)
    """The model's --context-length: caption tokens, the end-of-text token included."""
    caption_noise: float = option(0.0, metavar="P")
    """Delete a word or substitute 'random' in P% (0-100) of the training captions (the TempNet
    paper, Sec. 6.2); evaluation sets get none."""
    skip_bad_samples: bool = False
    """Count and report bad rows and images instead of stopping."""
    data_cache_path: str | None = None
    """Where tar shards' member indexes are cached (default: beside each shard, as
    SHARD.tar.idx.json); reused while a shard's size and modification time are unchanged."""
    seed: int = derived(1234)
    """The run's --seed: caption noise and augmentation draws."""

    def resolve_normalisation(self) -> None:
        """Fill the default mean/std for the channel count; check the given ones fit it."""
        if self.image_channels not in (1, 3):
            raise ImageTextDataError(
                f"--image-channels ({self.image_channels}) must be 3 (RGB) or 1 (grayscale)"
            )
        rgb = self.image_channels == 3
        if self.image_mean is None:
            self.image_mean = CLIP_MEAN if rgb else GRAY_MEAN
        if self.image_std is None:
            self.image_std = CLIP_STD if rgb else GRAY_STD
        for flag, values in (("--image-mean", self.image_mean), ("--image-std", self.image_std)):
            if len(values) not in (1, self.image_channels):
                raise ImageTextDataError(
                    f"{flag} has {len(values)} values: give 1 or {self.image_channels} (the "
                    "model's --image-channels)"
                )
        if min(self.image_std) <= 0:
            raise ImageTextDataError(f"--image-std {self.image_std} must be > 0")

    def validate(self) -> None:
        """Normalisation defaults (``resolve_normalisation``) and every field's range."""
        self.resolve_normalisation()
        if not self.paths:
            raise ImageTextDataError("no image-text data: give --train-data (or --valid-data)")
        if self.image_size < 1:
            raise ImageTextDataError(f"--image-size ({self.image_size}) must be >= 1")
        if self.context_length < 1:
            raise ImageTextDataError(
                f"--context-length ({self.context_length}) must be >= 1 (the end-of-text token)"
            )
        if not 0.0 <= self.caption_noise <= 100.0:
            raise ImageTextDataError(
                f"--caption-noise ({self.caption_noise}) is a percentage: give 0-100"
            )


class ImageTextDataset:
    """Map-style dataset of image-text pairs (usable by ``torch.utils.data.DataLoader``).

    ``dataset[i]`` / ``dataset.get(i, epoch)`` -> ``{"image": [C, S, S] float32 normalised,
    "tokens": [context_length] int64, "length": int64 scalar (real tokens, end-of-text at
    length - 1), "index": int64 scalar (the pair read: ``i``, or the replacement of an
    undecodable image), "label": str ("" without --label-key)}``.

    Args:
        config: the data config; ``validate()`` is called on it.
        tokenizer: ``tokenize(str) -> list[int]``, ``eod`` (the end-of-text id) and
            ``vocab_size``, like ``megatron_tempnet.data.tokenizers``'.
        epoch_of: ``index -> epoch`` for the augmentation of ``dataset[index]`` (default: epoch
            0). ``get(index, epoch)`` ignores it.

    ``skipped`` counts bad pairs in this process: rows dropped at construction plus images
    replaced when read (each DataLoader worker counts its own).
    """

    def __init__(
        self,
        config: ImageTextDataConfig,
        tokenizer,
        *,
        epoch_of: Callable[[int], int] | None = None,
    ):
        self._files: dict[str, io.BufferedReader] = {}  # tar shard handles of this process
        self._files_pid = os.getpid()
        config.validate()
        if tokenizer.eod is None:
            raise ImageTextDataError(no_eod_message(tokenizer))
        self.config, self.tokenizer, self.epoch_of = config, tokenizer, epoch_of
        reasons: list[str] = []
        self.pairs = PairTable()
        for path in _expand(config.paths):
            read = _read_tar if path.endswith(".tar") else _read_manifest
            read(path, self.pairs, config, reasons)
        self.pairs.freeze()
        self.skipped = len(reasons)
        if reasons:
            total = len(reasons) + len(self.pairs)
            msg = "--skip-bad-samples: skipped %d of %d pairs; the first: %s"
            warn_rank0(msg, len(reasons), total, reasons[0])
        if not len(self.pairs):
            raise ImageTextDataError(
                f"{', '.join(config.paths)}: no image-text pairs"
                + (f" ({len(reasons)} bad ones skipped)" if reasons else "")
            )
        self.unique_description_hash = _description_hash(self.pairs, config)

    def __len__(self) -> int:
        return len(self.pairs)

    def raw_caption(self, index: int) -> str:
        """The caption as written in the source."""
        return self.pairs.caption(index)

    def caption(self, index: int) -> str:
        """The caption as trained (after ``--caption-noise``)."""
        c = self.config
        return noisy_caption(self.pairs.caption(index), c.caption_noise, c.seed, index)

    def label(self, index: int) -> str:
        """The ``--label-key`` value ("" without one)."""
        return self.pairs.label(index)

    def __getitem__(self, index: int) -> dict:
        return self.get(index, self.epoch_of(index) if self.epoch_of is not None else 0)

    def get(self, index: int, epoch: int) -> dict:
        """Pair ``index`` with the augmentation of ``epoch`` (see the class docstring)."""
        n = len(self.pairs)
        if not -n <= index < n:
            raise IndexError(f"image-text pair {index} of a dataset of {n}")
        index %= n
        for i in [(index + k) % n for k in range(n)]:
            try:
                image = self._image(i, epoch)
            except ImageTextDataError as e:
                if not self.config.skip_bad_samples:
                    raise
                self.skipped += 1
                # on the process that read it: any rank or worker may meet a bad image
                logger.warning("--skip-bad-samples: %s; pair %d takes its place", e, (i + 1) % n)
                continue
            tokens, lengths = tokenize_captions(
                self.tokenizer, [self.caption(i)], self.config.context_length
            )
            return {
                "image": image,  # [C, S, S] float32
                "tokens": tokens[0],  # [L] int64
                "length": lengths[0],  # int64 scalar
                "index": torch.tensor(i, dtype=torch.int64),
                "label": self.pairs.label(i),
            }
        raise ImageTextDataError(f"{', '.join(self.config.paths)}: no image can be decoded")

    def _image(self, index: int, epoch: int) -> torch.Tensor:
        """``[C, S, S]`` float32 of pair ``index``; ImageTextDataError when undecodable."""
        image, c = self.pairs.image(index), self.config
        seed = (c.seed, epoch, index) if c.augment else None
        try:
            data = self._read(image)
            return image_tensor(
                io.BytesIO(data), c.image_size, c.image_channels, c.image_mean, c.image_std, seed
            )
        except DECODE_ERRORS as e:
            what = image if isinstance(image, str) else "the image member"
            raise ImageTextDataError(
                f"{self.pairs.where(index)}: sample {index}: cannot read {what} ({e}); {SKIP_HINT}"
            ) from None

    def _read(self, image: str | tuple[str, int, int]) -> bytes:
        if isinstance(image, str):
            with open(image, "rb") as f:
                return f.read()
        shard, offset, size = image
        if self._files_pid != os.getpid():  # a forked worker: its own handles, own offsets
            self._files, self._files_pid = {}, os.getpid()
        if shard not in self._files:
            self._files[shard] = open(shard, "rb")  # noqa: SIM115 (kept open, read by offset)
        handle = self._files[shard]
        handle.seek(offset)
        return handle.read(size)

    def close(self) -> None:
        """Close the tar shard handles this process opened (a later read reopens them)."""
        if self._files_pid == os.getpid():
            for handle in self._files.values():
                handle.close()
        self._files = {}

    __del__ = close

    def __getstate__(self) -> dict:  # spawned DataLoader workers open their own shard handles
        return {**self.__dict__, "_files": {}}


def _description_hash(pairs: PairTable, config: ImageTextDataConfig) -> str:
    """Hex digest of the pairs and the config fields that change what a sample holds."""
    digest = hashlib.sha256()
    for i in range(len(pairs)):
        image = pairs.image(i)
        image = image if isinstance(image, str) else f"{image[1]}+{image[2]}"
        line = f"{pairs.where(i)}\t{image}\t{pairs.caption(i)}\t{pairs.label(i)}\n"
        digest.update(line.encode("utf-8", "surrogateescape"))
    ignored = ("skip_bad_samples", "data_cache_path")
    fields = {k: v for k, v in asdict(config).items() if k not in ignored}
    digest.update(repr(sorted(fields.items())).encode())
    return digest.hexdigest()[:16]


def _expand(paths: list[str]) -> list[str]:
    """The sources in order: a directory becomes its sorted .tar shards."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".tar"))
            if not shards:
                raise ImageTextDataError(f"{path}: a directory without .tar shards")
            out += shards
        elif not os.path.isfile(path):
            raise ImageTextDataError(f"{path}: no such file (--train-data/--valid-data)")
        elif not path.endswith((*MANIFEST_SUFFIXES, ".tar")):
            raise ImageTextDataError(
                f"{path}: unsupported file: expected a manifest ({', '.join(MANIFEST_SUFFIXES)}),"
                " a .tar shard or a directory of them"
            )
        else:
            out.append(path)
    return out


def _bad(problem: str, config: ImageTextDataConfig, reasons: list[str]) -> None:
    """Stop on a bad row/member, or (--skip-bad-samples) record it for the warning."""
    if not config.skip_bad_samples:
        raise ImageTextDataError(f"{problem}; {SKIP_HINT}")
    reasons.append(problem)


def _manifest_rows(path: str, config: ImageTextDataConfig):
    """``(line number, row dict | problem str)`` per row; line numbers are 1-based."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        if path.endswith(".jsonl"):
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield number, _json_row(line)
            return
        reader = csv.DictReader(f, delimiter="\t" if path.endswith(".tsv") else ",")
        header = reader.fieldnames or []
        keys = [(config.image_key, "--image-key"), (config.caption_key, "--caption-key")]
        for key, flag in keys + ([(config.label_key, "--label-key")] if config.label_key else []):
            if key not in header:
                raise ImageTextDataError(
                    f"{path}:1: the header has no column {key!r} (it has {header}): name the "
                    f"column with {flag}"
                )
        for row in reader:
            yield reader.line_num, row  # the row's last line (quoted fields may span lines)


def _json_row(line: str) -> dict | str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg}, column {e.colno})"
    return row if isinstance(row, dict) else "not a JSON object"


def _read_manifest(
    path: str, pairs: PairTable, config: ImageTextDataConfig, reasons: list[str]
) -> None:
    base, source = os.path.dirname(os.path.abspath(path)), pairs.source(path)
    flags = {config.image_key: "--image-key", config.caption_key: "--caption-key"}
    if config.label_key:
        flags[config.label_key] = "--label-key"
    try:
        for number, row in _manifest_rows(path, config):
            where = f"{path}:{number}"
            if isinstance(row, str):
                _bad(f"{where}: {row}", config, reasons)
                continue
            values = {k: row.get(k) for k in flags}
            empty = [k for k, v in values.items() if v is None or not str(v).strip()]
            if empty:
                _bad(f"{where}: no {empty[0]!r} value ({flags[empty[0]]})", config, reasons)
                continue
            image = os.path.join(base, str(values[config.image_key]).strip())
            if not os.path.isfile(image):
                _bad(f"{where}: image {image} does not exist", config, reasons)
                continue
            label = str(values[config.label_key]).strip() if config.label_key else ""
            caption = str(values[config.caption_key]).strip()
            pairs.add(source, str(number), image, caption, label)
    except UnicodeDecodeError as e:
        raise ImageTextDataError(f"{path}: not UTF-8 text ({e}); re-save it as UTF-8") from None


def _tar_pair(where: str, texts: dict[str, str], has_image: bool, problem: str,
              config: ImageTextDataConfig) -> tuple[str, str] | str:  # fmt: skip
    """``(caption, label)`` of a sample, or what is wrong with it."""
    if problem:
        return f"{where}: {problem}"
    try:
        text = {k: v.encode("utf-8").decode("utf-8").strip() for k, v in texts.items()}
        meta = json.loads(text[".json"]) if ".json" in text else {}
    except UnicodeEncodeError:  # bytes that were not UTF-8 (kept as surrogates by the index)
        return f"{where}: a text member is not UTF-8"
    except json.JSONDecodeError as e:
        return f"{where}.json: not JSON ({e.msg})"
    if not has_image:
        return f"{where}: the sample has no image ({', '.join(IMAGE_SUFFIXES)})"
    if not text.get(".txt"):
        return f"{where}: the sample has no caption (a non-empty {where}.txt)"
    label = ""
    if config.label_key:
        found = meta.get(config.label_key) if isinstance(meta, dict) else None
        label = str(found).strip() if found is not None else text.get(".cls", "")
        if not label:
            return f"{where}: no label (--label-key {config.label_key}: .json field or .cls)"
    return text[".txt"], label


def _read_tar(path: str, pairs: PairTable, config: ImageTextDataConfig, reasons: list[str]) -> None:
    try:
        groups = shard_index(path, config.data_cache_path)
    except (tarfile.TarError, OSError) as e:
        raise ImageTextDataError(f"{path}: not a readable uncompressed tar shard ({e})") from None
    source = pairs.source(path)
    for key, offset, size, texts, problem in groups:
        pair = _tar_pair(f"{path}:{key}", texts, offset >= 0, problem, config)
        if isinstance(pair, str):
            _bad(pair, config, reasons)
        else:
            pairs.add(source, key, (offset, size), *pair)
