"""Image-text pairs for CLIP: manifests and WebDataset-style tar shards, with a stable index.

Sources, in the order given:

- a manifest ``.csv``/``.tsv`` (header row naming the columns) or ``.jsonl``: one pair per row,
  ``--image-key`` holds the image path (relative paths are relative to the manifest's
  directory), ``--caption-key`` the caption, ``--label-key`` (optional) a class name or an
  image id for evaluation;
- a ``.tar`` shard (or a directory of them): members grouped by key, the name up to its first
  dot (``KEY.jpg``/``.png``/... with ``KEY.txt``, optional ``KEY.json`` holding the label key or
  ``KEY.cls``); images are read by offset, never the whole shard.

Sample ``i`` is the ``i``-th pair over the sources: the per-sample state is keyed by it. A bad
row or member (missing column, empty caption, missing image, a caption without an image...)
stops with an error naming the file and the line or member; with ``--skip-bad-samples`` it is
dropped, counted and reported once. An image that cannot be decoded is reported when read; with
``--skip-bad-samples`` the next readable pair takes its place (with its own index).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass

import torch

from megatron_tempnet.data.image_transforms import image_tensor, noisy_caption
from megatron_tempnet.utils.logging import get_logger, warn_rank0

logger = get_logger(__name__)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's RGB normalisation
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
MANIFEST_SUFFIXES = (".csv", ".tsv", ".jsonl")


class ImageTextDataError(ValueError):
    """Bad image-text input: names the file, the line or member, and what to do."""


@dataclass
class ImageTextDataConfig:
    paths: list[str]
    """--train-data (or --valid-data, --ood-data): manifests and/or .tar shards."""
    image_key: str = "image"
    """--image-key: the manifest column (JSON key) with the image path."""
    caption_key: str = "caption"
    """--caption-key"""
    label_key: str | None = None
    """--label-key: a class name or image id per pair (retrieval and zero-shot evaluation)."""
    image_size: int = 224
    """The model's --image-size: images become [C, size, size]."""
    image_channels: int = 3
    """The model's --image-channels: 3 = RGB, 1 = grayscale."""
    image_mean: tuple[float, ...] | None = None
    """--image-mean: per channel, or one value for all (default: OpenAI CLIP's for RGB, 0.5
    for grayscale)."""
    image_std: tuple[float, ...] | None = None
    """--image-std (default: OpenAI CLIP's for RGB, 0.5 for grayscale)."""
    augment: bool = False
    """--image-augment: random resized crops seeded by (seed, epoch, index), not by rank."""
    context_length: int = 77
    """The model's --context-length: caption tokens, end-of-text token included."""
    caption_noise: float = 0.0
    """--caption-noise P: delete a word or substitute 'random' in P% of captions."""
    skip_bad_samples: bool = False
    """--skip-bad-samples: count and report bad rows and images instead of stopping."""
    seed: int = 1234
    """--seed"""

    def resolve_normalisation(self) -> None:
        """Fill the default mean/std for the channel count; check the given ones fit it."""
        rgb = self.image_channels == 3
        if self.image_mean is None:
            self.image_mean = CLIP_MEAN if rgb else (0.5,)
        if self.image_std is None:
            self.image_std = CLIP_STD if rgb else (0.5,)
        for flag, values in (("--image-mean", self.image_mean), ("--image-std", self.image_std)):
            if len(values) not in (1, self.image_channels):
                raise ImageTextDataError(
                    f"{flag} has {len(values)} values: give 1 or {self.image_channels} (the "
                    f"model's --image-channels)"
                )
        if min(self.image_std) <= 0:
            raise ImageTextDataError(f"--image-std {self.image_std} must be > 0")


@dataclass
class _Pair:
    where: str  # "file:line" or "shard.tar:member", for messages
    image: str | tuple[str, int, int]  # a path, or (shard, offset, size)
    caption: str
    label: str


def tokenize_captions(tokenizer, texts: list[str], context_length: int):
    """``tokens [n, context_length]`` int64 (caption, end-of-text, zero padding; long captions
    are cut so the end-of-text token stays) and ``lengths [n]`` (end-of-text at length - 1)."""
    if tokenizer.eod is None:
        raise ImageTextDataError(
            f"the tokenizer {tokenizer!r} has no end-of-text token: the text tower pools there"
        )
    tokens = torch.zeros(len(texts), context_length, dtype=torch.int64)
    lengths = torch.zeros(len(texts), dtype=torch.int64)
    for row, ids in enumerate(tokenizer.tokenize_batch(list(texts))):
        ids = list(ids[: context_length - 1]) + [tokenizer.eod]
        tokens[row, : len(ids)] = torch.tensor(ids)
        lengths[row] = len(ids)
    return tokens, lengths


class ImageTextDataset:
    """Map-style dataset of pairs: ``get(index, epoch)`` -> ``{"image" [C, S, S] float32,
    "tokens" [L] int64, "length", "index" (int64 scalars), "label" (str)}``."""

    def __init__(self, config: ImageTextDataConfig, tokenizer):
        config.resolve_normalisation()
        self.config, self.tokenizer = config, tokenizer
        self.skipped, self._files = 0, {}
        reasons: list[str] = []
        self.pairs: list[_Pair] = []
        for path in _expand(config.paths):
            reader = _read_tar if path.endswith(".tar") else _read_manifest
            self.pairs += reader(path, config, reasons)
        if reasons:
            self.skipped = len(reasons)
            warn_rank0("--skip-bad-samples: skipped %d of %d pairs; the first: %s", len(reasons),
                       len(reasons) + len(self.pairs), reasons[0])  # fmt: skip
        if not self.pairs:
            raise ImageTextDataError(f"{', '.join(config.paths)}: no image-text pairs")
        tokenize_captions(tokenizer, [], config.context_length)  # checks the end-of-text token
        digest = hashlib.sha256()
        for p in self.pairs:
            digest.update(f"{p.where}\t{p.caption}\t{p.label}\n".encode())
        fields = (
            config.image_size,
            config.image_channels,
            config.image_mean,
            config.image_std,
            config.augment,
            config.context_length,
            config.caption_noise,
            config.seed,
        )
        digest.update(repr(fields).encode())  # fmt: skip
        self.unique_description_hash = digest.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.pairs)

    def raw_caption(self, index: int) -> str:
        return self.pairs[index].caption

    def caption(self, index: int) -> str:
        """The caption as trained (after ``--caption-noise``)."""
        c = self.config
        return noisy_caption(self.pairs[index].caption, c.caption_noise, c.seed, index)

    def label(self, index: int) -> str:
        return self.pairs[index].label

    def __getitem__(self, index: int) -> dict:
        return self.get(index, 0)

    def get(self, index: int, epoch: int) -> dict:
        for offset in range(len(self.pairs)):
            i = (index + offset) % len(self.pairs)
            try:
                image = self._image(i, epoch)
            except ImageTextDataError as e:
                if not self.config.skip_bad_samples:
                    raise
                self.skipped += 1
                # on the rank that read it (not only rank 0)
                logger.warning("--skip-bad-samples: %s; the next pair takes its place", e)
                continue
            tokens, lengths = tokenize_captions(self.tokenizer, [self.caption(i)],
                                                self.config.context_length)  # fmt: skip
            return {"image": image, "tokens": tokens[0], "length": lengths[0],
                    "index": torch.tensor(i), "label": self.pairs[i].label}  # fmt: skip
        raise ImageTextDataError("no image of the dataset can be decoded")

    def _image(self, index: int, epoch: int) -> torch.Tensor:
        pair, c = self.pairs[index], self.config
        try:
            if isinstance(pair.image, str):
                with open(pair.image, "rb") as f:
                    data = f.read()
            else:
                shard, offset, size = pair.image
                handle = self._files.get(shard) or self._files.setdefault(shard, open(shard, "rb"))
                handle.seek(offset)
                data = handle.read(size)
            rng = (c.seed, epoch, index) if c.augment else None
            return image_tensor(io.BytesIO(data), c.image_size, c.image_channels, c.image_mean,
                                c.image_std, rng)  # fmt: skip
        except (OSError, ValueError) as e:
            raise ImageTextDataError(
                f"{pair.where}: sample {index}: cannot read image {pair.image!r} ({e}); "
                "fix or remove it, or pass --skip-bad-samples"
            ) from None

    def __getstate__(self):  # DataLoader workers open their own shard handles
        return {**self.__dict__, "_files": {}}


def _expand(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        if os.path.isdir(path):
            shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".tar"))
            if not shards:
                raise ImageTextDataError(f"{path}: a directory without .tar shards")
            out += shards
        elif not os.path.isfile(path):
            raise ImageTextDataError(f"{path}: no such file")
        elif not path.endswith((*MANIFEST_SUFFIXES, ".tar")):
            raise ImageTextDataError(
                f"{path}: expected a manifest ({', '.join(MANIFEST_SUFFIXES)}) or a .tar shard"
            )
        else:
            out.append(path)
    return out


def _rows(path: str):
    """(line number, dict or an error string) per manifest row."""
    with open(path, newline="", encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    row = f"not JSON ({e.msg})"
                yield number, row if isinstance(row, (dict, str)) else "not a JSON object"
            return
        reader = csv.DictReader(f, delimiter="\t" if path.endswith(".tsv") else ",")
        for row in reader:
            yield reader.line_num, row


def _keep(problem: str, config: ImageTextDataConfig, reasons: list[str]) -> None:
    if not config.skip_bad_samples:
        raise ImageTextDataError(f"{problem}; fix the row or pass --skip-bad-samples")
    reasons.append(problem)


def _read_manifest(path: str, config: ImageTextDataConfig, reasons: list[str]) -> list[_Pair]:
    base, pairs = os.path.dirname(os.path.abspath(path)), []
    for number, row in _rows(path):
        where = f"{path}:{number}"
        if isinstance(row, str):
            _keep(f"{where}: {row}", config, reasons)
            continue
        keys = [config.image_key, config.caption_key] + (
            [config.label_key] if config.label_key else []
        )
        missing = [k for k in keys if not str(row.get(k) or "").strip()]
        if missing:
            _keep(f"{where}: no {missing[0]!r} value (--{_flag(missing[0], config)})", config,
                  reasons)  # fmt: skip
            continue
        image = os.path.join(base, str(row[config.image_key]))
        if not os.path.isfile(image):
            _keep(f"{where}: image {image} does not exist", config, reasons)
            continue
        label = str(row[config.label_key]) if config.label_key else ""
        pairs.append(_Pair(where, image, str(row[config.caption_key]).strip(), label))
    return pairs


def _flag(key: str, config: ImageTextDataConfig) -> str:
    if key == config.image_key:
        return f"image-key {key}"
    return f"caption-key {key}" if key == config.caption_key else f"label-key {key}"


def _read_tar(path: str, config: ImageTextDataConfig, reasons: list[str]) -> list[_Pair]:
    groups: dict[str, dict] = {}
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, suffix = os.path.basename(member.name).partition(".")
                key = os.path.join(os.path.dirname(member.name), key)
                group = groups.setdefault(key, {})
                suffix = "." + suffix.lower()
                if suffix in IMAGE_SUFFIXES:
                    group["image"] = (path, member.offset_data, member.size)
                elif suffix in (".txt", ".json", ".cls"):
                    group[suffix] = tar.extractfile(member).read().decode("utf-8").strip()
    except (tarfile.TarError, UnicodeDecodeError) as e:
        raise ImageTextDataError(f"{path}: not a readable tar shard ({e})") from None
    pairs = []
    for key, group in groups.items():
        where = f"{path}:{key}"
        if "image" not in group or not group.get(".txt"):
            what = "an image" if "image" not in group else "a caption (.txt)"
            _keep(f"{where}: the sample has no {what}", config, reasons)
            continue
        label = group.get(".cls", "")
        if config.label_key and ".json" in group:
            label = str(json.loads(group[".json"]).get(config.label_key, label))
        if config.label_key and not label:
            _keep(f"{where}: no label (--label-key {config.label_key})", config, reasons)
            continue
        pairs.append(_Pair(where, group["image"], group[".txt"], label))
    return pairs


class EpochShuffledDataset:
    """Training positions over repeated epochs of ``dataset``.

    Epoch ``e`` is a permutation of the pairs seeded by ``(seed, e)``, cut to a whole number of
    global batches (the rest of the permutation is dropped), so no global batch holds a pair
    twice. Position ``p`` reads pair ``perm_e[p % per_epoch]`` with ``e = p // per_epoch``, and
    the augmentation of that read is seeded by ``e``.
    """

    def __init__(self, dataset: ImageTextDataset, *, global_batch_size: int, num_positions: int,
                 seed: int, shuffle: bool = True):  # fmt: skip
        if len(dataset) < global_batch_size:
            raise ImageTextDataError(
                f"--train-data has {len(dataset)} pairs, fewer than one global batch "
                f"(--global-batch-size {global_batch_size})"
            )
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.per_epoch = len(dataset) // global_batch_size * global_batch_size
        self.num_positions = num_positions
        self._epoch, self._perm = -1, None
        self.unique_description_hash = hashlib.sha256(repr((
            dataset.unique_description_hash, global_batch_size, seed, shuffle)).encode()
        ).hexdigest()[:16]  # fmt: skip

    def __len__(self) -> int:
        return self.num_positions

    def index_at(self, position: int) -> tuple[int, int]:
        """(epoch, pair index) of a position."""
        epoch = position // self.per_epoch
        if epoch != self._epoch:
            n = len(self.dataset)
            gen = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            self._perm = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
            self._epoch = epoch
        return epoch, int(self._perm[position % self.per_epoch])

    def __getitem__(self, position: int) -> dict:
        epoch, index = self.index_at(position)
        return self.dataset.get(index, epoch)
