"""scikit-learn's handwritten digits as an image-text dataset (the CPU demo and the tests).

1797 grayscale 8 x 8 scans (values 0-16) written as PNG files (values scaled to 0-255, upscaled
with nearest neighbour) with English captions from templates ("a handwritten digit seven", ...),
in CSV manifests with the columns ``image,caption,label`` (label = the digit's name): a
stratified held-out split (``train.csv``, ``test.csv``) and its digits 0-4 / 5-9 subsets
(``train_0-4.csv``, ``test_0-4.csv``, ``test_5-9.csv``) for the out-of-distribution experiment.
Captions hold no commas, so a naive split of a manifest line works too.
"""

from __future__ import annotations

import csv
import os

import numpy as np

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# {name}: the digit's name ("seven"); {digit}: its numeral ("7")
CAPTION_TEMPLATES = (
    "a handwritten digit {name}",
    "the number {digit} written by hand",
    "a scan of the digit {name}",
    "a small grey picture of a handwritten {name}",
    "someone wrote the number {name}",
    "a blurry {name} drawn with a pen",
    "the digit {digit} on a form",
    "a pixelated handwritten {digit}",
)
# zero-shot classification prompts: {} = a digit's name
CLASSIFICATION_TEMPLATES = ("a handwritten digit {}", "a scan of the digit {}", "the number {}")
SUBSETS = ("train", "test", "train_0-4", "test_0-4", "test_5-9")
_MAX_PIXEL = 16.0  # load_digits' scale


def _write_manifest(path: str, rows: list[tuple[str, str, str]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "caption", "label"])
        writer.writerows(rows)


def _held_out(target: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """``[n]`` bool: ``round(fraction * count)`` images of each digit, drawn with ``rng``."""
    is_test = np.zeros(len(target), dtype=bool)
    for digit in range(10):
        members = np.flatnonzero(target == digit)
        is_test[rng.permutation(members)[: round(len(members) * fraction)]] = True
    return is_test


def digit_png(pixels: np.ndarray, image_scale: int) -> np.ndarray:
    """``[8, 8]`` float (0-16) -> ``[8 * image_scale, 8 * image_scale]`` uint8 (0-255),
    each pixel repeated ``image_scale x image_scale`` times (nearest neighbour)."""
    img = np.round(pixels * (255.0 / _MAX_PIXEL)).astype(np.uint8)
    return np.kron(img, np.ones((image_scale, image_scale), dtype=np.uint8))


def write_digits_dataset(
    out_dir: str, *, test_fraction: float = 0.2, seed: int = 0, image_scale: int = 2
) -> dict:
    """Write ``out_dir/images/digit_NNNN.png`` and the manifests (overwriting earlier ones).

    Args:
        out_dir: created if needed.
        test_fraction: the held-out share of each digit, in (0, 1).
        seed: the split and each image's caption template.
        image_scale: nearest-neighbour upscaling (2: 16 x 16 PNG files).

    Returns:
        ``{subset: manifest path, subset + "_count": rows}`` for ``SUBSETS``, plus
        ``"images"`` (the image folder) and ``"total_count"`` (1797).
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction ({test_fraction}) must lie in (0, 1)")
    if image_scale < 1:
        raise ValueError(f"image_scale ({image_scale}) must be >= 1")
    digits = load_digits()
    images_dir = os.path.join(out_dir, "images")
    os.makedirs(images_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    is_test = _held_out(digits.target, test_fraction, rng)
    rows = []
    for i, (pixels, digit) in enumerate(zip(digits.images, digits.target)):
        name = f"images/digit_{i:04d}.png"
        Image.fromarray(digit_png(pixels, image_scale)).save(os.path.join(out_dir, name))
        template = CAPTION_TEMPLATES[int(rng.integers(len(CAPTION_TEMPLATES)))]
        caption = template.format(name=DIGIT_NAMES[digit], digit=int(digit))
        rows.append((name, caption, DIGIT_NAMES[digit]))
    low = digits.target < 5
    masks = (~is_test, is_test, ~is_test & low, is_test & low, is_test & ~low)
    out: dict = {"images": images_dir, "total_count": len(rows)}
    for subset, mask in zip(SUBSETS, masks):
        out[subset] = os.path.join(out_dir, f"{subset}.csv")
        _write_manifest(out[subset], [row for row, keep in zip(rows, mask) if keep])
        out[f"{subset}_count"] = int(mask.sum())
    return out
