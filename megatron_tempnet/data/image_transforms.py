"""Image transforms (PIL + torch) and the caption-noise injector for CLIP's data.

Evaluation, and training without ``--image-augment``: resize the shorter side to the model's
size (bicubic), centre crop, scale to [0, 1], normalise per channel. With augmentation: a random
resized crop (area 90-100% of the image, aspect ratio 3/4-4/3) whose draw is seeded by
``(seed, epoch, index)``, so it does not depend on the data-parallel layout or the worker.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image


def _generator(seed: tuple[int, ...]) -> np.random.Generator:
    return np.random.default_rng([abs(int(s)) for s in seed])


def _random_box(width: int, height: int, seed: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A crop box of 90-100% of the area with aspect ratio in [3/4, 4/3]; when ten draws do not
    fit (a very wide or tall image), the central crop with the aspect ratio clamped to that
    range."""
    rng = _generator(seed)
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.9, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    ratio = min(max(width / height, 3 / 4), 4 / 3)
    w, h = min(width, round(height * ratio)), min(height, round(width / ratio))
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def image_tensor(file, size: int, channels: int, mean, std,
                 augment_seed: tuple[int, ...] | None = None) -> torch.Tensor:  # fmt: skip
    """An encoded image (file object) -> ``[channels, size, size]`` float32, normalised."""
    with Image.open(file) as img:
        img = img.convert("L" if channels == 1 else "RGB")
        if augment_seed is not None:
            img = img.crop(_random_box(*img.size, augment_seed)).resize((size, size), Image.BICUBIC)
        else:
            scale = size / min(img.size)
            w, h = max(size, round(img.size[0] * scale)), max(size, round(img.size[1] * scale))
            img = img.resize((w, h), Image.BICUBIC)
            left, top = (w - size) // 2, (h - size) // 2
            img = img.crop((left, top, left + size, top + size))
        pixels = np.asarray(img, dtype=np.float32) / 255.0
    x = torch.from_numpy(pixels.copy()).reshape(size, size, channels).permute(2, 0, 1)
    m = torch.tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
    if m.numel() not in (1, channels) or s.numel() not in (1, channels):
        raise ValueError(
            f"--image-mean/--image-std need 1 or {channels} values, got {m.numel()} and {s.numel()}"
        )
    return ((x - m) / s).contiguous()


def noisy_caption(caption: str, percent: float, seed: int, index: int) -> str:
    """The paper's caption noise (Section 6.2): with probability ``percent / 100``, one random
    word is deleted or replaced by 'random' (even odds; a one-word caption is replaced).
    Deterministic in ``(seed, index)``."""
    if percent <= 0:
        return caption
    rng = _generator((seed, index, 7919))
    if rng.uniform(0.0, 100.0) >= percent:
        return caption
    words = caption.split()
    if not words:
        return caption
    position = int(rng.integers(0, len(words)))
    if len(words) > 1 and rng.uniform() < 0.5:
        del words[position]
    else:
        words[position] = "random"
    return " ".join(words)
