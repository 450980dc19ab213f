"""scikit-learn's handwritten digits as an image-text dataset (the CPU demo and the tests).

1797 grayscale 8 x 8 scans (values 0-16) written as PNG files (upscaled, nearest neighbour) with
English captions from templates ("a handwritten digit seven", ...), in CSV manifests with the
columns ``image,caption,label``: a stratified held-out split (``train.csv``, ``test.csv``) and
digits 0-4 / 5-9 subsets of it (``train_0-4.csv``, ``test_0-4.csv``, ``test_5-9.csv``) for the
out-of-distribution experiment.
"""

from __future__ import annotations

import csv
import os

import numpy as np

DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
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
CLASSIFICATION_TEMPLATES = ("a handwritten digit {}", "a scan of the digit {}", "the number {}")


def _write(path: str, rows: list[tuple[str, str, str]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "caption", "label"])
        writer.writerows(rows)


def write_digits_dataset(out_dir: str, *, test_fraction: float = 0.2, seed: int = 0,
                         image_scale: int = 2) -> dict:  # fmt: skip
    """Write the images and manifests under ``out_dir``; returns the manifests' paths (keys
    ``train``, ``test``, ``train_0-4``, ``test_0-4``, ``test_5-9``) and counts."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rng = np.random.default_rng(seed)
    rows, is_test = [], np.zeros(len(digits.target), dtype=bool)
    for digit in range(10):  # stratified split
        members = np.flatnonzero(digits.target == digit)
        is_test[rng.permutation(members)[: round(len(members) * test_fraction)]] = True
    for i, (pixels, digit) in enumerate(zip(digits.images, digits.target)):
        name = f"images/digit_{i:04d}.png"
        img = (pixels * (255.0 / 16.0)).round().astype(np.uint8)
        img = np.kron(img, np.ones((image_scale, image_scale), dtype=np.uint8))
        Image.fromarray(img, mode="L").save(os.path.join(out_dir, name))
        template = CAPTION_TEMPLATES[int(rng.integers(len(CAPTION_TEMPLATES)))]
        caption = template.format(name=DIGIT_NAMES[digit], digit=int(digit))
        rows.append((name, caption, DIGIT_NAMES[digit]))
    low = digits.target < 5
    subsets = {
        "train": ~is_test, "test": is_test, "train_0-4": ~is_test & low,
        "test_0-4": is_test & low, "test_5-9": is_test & ~low,
    }  # fmt: skip
    out = {}
    for key, mask in subsets.items():
        out[key] = os.path.join(out_dir, f"{key}.csv")
        _write(out[key], [row for row, keep in zip(rows, mask) if keep])
        out[f"{key}_count"] = int(mask.sum())
    return out
