"""Image transforms for CLIP's data, written with PIL, numpy and torch (no torchvision).

Evaluation, and training without ``--image-augment``: resize the shorter side to the model's
``--image-size`` (bicubic), centre crop to a square, scale to [0, 1], normalise per channel.
With ``--image-augment``: a random resized crop (90-100% of the area, aspect ratio 3/4 to 4/3)
resized to the square. Its draw comes from a numpy ``Generator`` seeded by ``(seed, epoch,
index)``, so a sample's crop does not depend on the data-parallel layout, the DataLoader worker
or whether the run was resumed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image

CROP_SCALE = (0.9, 1.0)  # fraction of the image's area kept by a random crop
CROP_RATIO = (3 / 4, 4 / 3)  # its width / height
_CROP_TRIES = 10

# What PIL raises for a file that exists but is not a decodable image.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)

Box = tuple[int, int, int, int]  # (left, top, right, bottom), PIL's crop convention


def augment_generator(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random resized crop's generator for one read of sample ``index`` in ``epoch``."""
    # % 2**64: numpy's SeedSequence takes non-negative words (identity for the usual seeds)
    return np.random.default_rng([int(v) % (1 << 64) for v in (seed, epoch, index)])


def random_crop_box(width: int, height: int, rng: np.random.Generator) -> Box:
    """A box of ``CROP_SCALE`` of the area with aspect ratio in ``CROP_RATIO``.

    Up to ten draws; when none fits (a very wide or tall image) the central box with the aspect
    ratio clamped to ``CROP_RATIO``.
    """
    area = width * height
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(_CROP_TRIES):
        target = area * rng.uniform(*CROP_SCALE)
        ratio = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    ratio = min(max(width / height, CROP_RATIO[0]), CROP_RATIO[1])
    w, h = min(width, round(height * ratio)), min(height, round(width / ratio))
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def resize_center_crop(img: Image.Image, size: int) -> Image.Image:
    """Shorter side to ``size`` (bicubic), then the central ``size x size`` square."""
    scale = size / min(img.size)
    w, h = max(size, round(img.size[0] * scale)), max(size, round(img.size[1] * scale))
    img = img.resize((w, h), Image.Resampling.BICUBIC)
    left, top = (w - size) // 2, (h - size) // 2
    return img.crop((left, top, left + size, top + size))


def normalise(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``pixels [S, S]`` or ``[S, S, C]`` uint8 -> ``[C, S, S]`` float32, ``(x / 255 - mean) /
    std`` per channel (one mean/std value applies to every channel)."""
    x = torch.from_numpy(np.asarray(pixels, dtype=np.float32) / 255.0)
    x = (x.unsqueeze(-1) if x.dim() == 2 else x).permute(2, 0, 1)  # [C, S, S]
    m = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
    return ((x - m) / s).contiguous()


def image_tensor(
    file: BinaryIO,
    size: int,
    channels: int,
    mean: Sequence[float],
    std: Sequence[float],
    augment_seed: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """An encoded image -> ``[channels, size, size]`` float32, normalised.

    Args:
        file: a binary file object holding the encoded image (any format PIL decodes).
        size: ``--image-size``.
        channels: ``--image-channels``: 3 converts to RGB, 1 to grayscale (PIL's ``"L"``).
        mean, std: ``--image-mean``/``--image-std``: ``channels`` values, or one for all.
        augment_seed: ``(seed, epoch, index)`` for a random resized crop; None for the
            resize + centre crop of evaluation.

    Raises:
        ValueError: mean/std of the wrong length (before anything is decoded).
        One of ``DECODE_ERRORS``: the bytes are not a decodable image.
    """
    if channels not in (1, 3):
        raise ValueError(f"--image-channels ({channels}) must be 1 (grayscale) or 3 (RGB)")
    if len(mean) not in (1, channels) or len(std) not in (1, channels):
        raise ValueError(
            f"--image-mean/--image-std need 1 or {channels} values, got {len(mean)} and {len(std)}"
        )
    with Image.open(file) as img:
        img = img.convert("L" if channels == 1 else "RGB")
    if augment_seed is None:
        img = resize_center_crop(img, size)
    else:
        box = random_crop_box(*img.size, augment_generator(*augment_seed))
        img = img.crop(box).resize((size, size), Image.Resampling.BICUBIC)
    return normalise(np.asarray(img), mean, std)
