"""Image-text data: manifests and tar shards give the same samples, tokens end with the
end-of-text token, transforms match a PIL reference, caption noise and epochs behave as
documented, bad rows and images are reported (or counted), the digits writer."""

from __future__ import annotations

import csv
import io
import json
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_tempnet.data.digits import DIGIT_NAMES, write_digits_dataset
from megatron_tempnet.data.image_text import (
    EpochShuffledDataset,
    ImageTextDataConfig,
    ImageTextDataError,
    ImageTextDataset,
)
from megatron_tempnet.data.image_transforms import image_tensor, noisy_caption


class WordTokenizer:
    """word -> id (3, 4, ...), end of text = 1."""

    eod, vocab_size = 1, 100

    def tokenize_batch(self, texts):
        return [[3 + sum(map(ord, w)) % 90 for w in t.split()] for t in texts]


CAPTIONS = ["a red square", "two blue dots here", "one", "a long caption " * 5]


@pytest.fixture()
def sources(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for i, caption in enumerate(CAPTIONS):
        img = Image.fromarray(rng.integers(0, 255, (12, 14, 3), dtype=np.uint8))
        img.save(tmp_path / f"s{i}.png")
        rows.append({"image": f"s{i}.png", "caption": caption, "label": f"c{i % 2}"})
    with open(tmp_path / "m.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["image", "caption", "label"])
        writer.writeheader(), writer.writerows(rows)
    with open(tmp_path / "m.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for i, r in enumerate(rows):
            tar.add(tmp_path / r["image"], arcname=f"sample{i:03d}.png")
            for suffix, text in ((".txt", r["caption"]), (".cls", r["label"])):
                data = text.encode()
                info = tarfile.TarInfo(f"sample{i:03d}{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return tmp_path


def _dataset(paths, **kw) -> ImageTextDataset:
    cfg = dict(paths=[str(p) for p in paths], label_key="label", image_size=8, context_length=6)
    return ImageTextDataset(ImageTextDataConfig(**{**cfg, **kw}), WordTokenizer())


def test_manifests_and_tar_shards_give_the_same_samples(sources):
    sets = [_dataset([sources / name]) for name in ("m.csv", "m.jsonl", "shard.tar")]
    for i in range(len(CAPTIONS)):
        samples = [ds[i] for ds in sets]
        for s in samples[1:]:
            assert torch.equal(s["image"], samples[0]["image"])
            assert torch.equal(s["tokens"], samples[0]["tokens"])
            assert (s["label"], int(s["index"])) == (samples[0]["label"], i)
    both = _dataset([sources / "m.csv", sources / "shard.tar"])
    assert len(both) == 8 and both.label(5) == "c1" and int(both[6]["index"]) == 6


def test_tokens_end_with_end_of_text(sources):
    ds = _dataset([sources / "m.csv"])
    ids = WordTokenizer().tokenize_batch(CAPTIONS)
    one = ds[1]  # 4 words + end of text, padded to 6
    assert one["tokens"].tolist() == ids[1] + [1, 0] and int(one["length"]) == 5
    long = ds[3]  # cut to 5 words so the end-of-text token stays last
    assert long["tokens"].tolist() == ids[3][:5] + [1] and int(long["length"]) == 6


def test_centre_crop_matches_pil_and_augmentation_is_seeded(sources):
    path = sources / "s0.png"
    got = image_tensor(open(path, "rb"), 8, 3, (0.5,), (0.25,))
    ref = Image.open(path).convert("RGB").resize((9, 8), Image.BICUBIC).crop((0, 0, 8, 8))
    expected = (torch.tensor(np.asarray(ref), dtype=torch.float32) / 255 - 0.5) / 0.25
    torch.testing.assert_close(got, expected.permute(2, 0, 1))
    a = _dataset([sources / "m.csv"], augment=True)
    b = _dataset([sources / "m.csv"], augment=True)
    assert torch.equal(a.get(0, 3)["image"], b.get(0, 3)["image"])
    assert not torch.equal(a.get(0, 3)["image"], a.get(0, 4)["image"])


def test_caption_noise():
    caption = "a handwritten digit seven on paper"
    noisy = [noisy_caption(caption, 15.0, 1, i) for i in range(2000)]
    assert noisy == [noisy_caption(caption, 15.0, 1, i) for i in range(2000)]
    changed = [n for n in noisy if n != caption]
    assert abs(len(changed) - 300) < 3 * np.sqrt(2000 * 0.15 * 0.85)
    words = caption.split()
    deleted = {" ".join(words[:i] + words[i + 1 :]) for i in range(len(words))}
    replaced = {" ".join(words[:i] + ["random"] + words[i + 1 :]) for i in range(len(words))}
    assert all(n in deleted | replaced for n in changed)
    assert 0.35 < sum(n in deleted for n in changed) / len(changed) < 0.65
    assert noisy_caption("seven", 100.0, 0, 0) == "random"


def test_bad_rows_and_images(sources):
    with open(sources / "bad.csv", "w") as f:
        f.write("image,caption,label\ns0.png,a caption,c0\ns1.png,,c1\nmissing.png,x,c0\n")
    with pytest.raises(ImageTextDataError, match=r"bad.csv:3: no 'caption' value"):
        _dataset([sources / "bad.csv"])
    ds = _dataset([sources / "bad.csv"], skip_bad_samples=True)
    assert len(ds) == 1 and ds.skipped == 2
    (sources / "s2.png").write_bytes(b"not an image")
    with pytest.raises(ImageTextDataError, match=r"m.csv:4: sample 2: cannot read image .*s2.png"):
        _dataset([sources / "m.csv"])[2]
    ds = _dataset([sources / "m.csv"], skip_bad_samples=True)
    assert int(ds[2]["index"]) == 3 and ds.skipped == 1
    with pytest.raises(ImageTextDataError, match="expected a manifest"):
        _dataset([sources / "s0.png"])


def test_epochs_are_permutations_cut_to_whole_batches(sources):
    base = _dataset([sources / "m.csv", sources / "m.jsonl", sources / "shard.tar"])  # 12
    ds = EpochShuffledDataset(base, global_batch_size=5, num_positions=40, seed=3)
    assert ds.per_epoch == 10
    epochs = [[ds.index_at(p)[1] for p in range(e * 10, e * 10 + 10)] for e in range(4)]
    for order in epochs:
        assert len(set(order)) == 10  # no pair twice in an epoch, hence in a global batch
    assert epochs[0] != epochs[1]
    again = EpochShuffledDataset(base, global_batch_size=5, num_positions=40, seed=3)
    assert [again.index_at(p)[1] for p in range(40)] == sum(epochs, [])
    with pytest.raises(ImageTextDataError, match="fewer than one global batch"):
        EpochShuffledDataset(base, global_batch_size=16, num_positions=16, seed=0)


def test_digits_writer(tmp_path):
    from sklearn.datasets import load_digits

    paths = write_digits_dataset(str(tmp_path))
    assert paths["train_count"] + paths["test_count"] == 1797
    assert paths["train_0-4_count"] + paths["test_0-4_count"] + paths["test_5-9_count"] < 1797
    with open(paths["test_5-9"]) as f:
        rows = list(csv.DictReader(f))
    assert {r["label"] for r in rows} == set(DIGIT_NAMES[5:])
    first = rows[0]
    index = int(first["image"].split("_")[1].split(".")[0])
    png = np.asarray(Image.open(os.path.join(tmp_path, first["image"])))
    expected = np.kron(np.round(load_digits().images[index] * 255 / 16), np.ones((2, 2)))
    assert png.shape == (16, 16) and np.array_equal(png, expected)
    assert first["label"] in first["caption"] or str(DIGIT_NAMES.index(first["label"])) in (
        first["caption"])  # fmt: skip


def test_normalisation_defaults_follow_the_channels(sources):
    gray = _dataset([sources / "m.csv"], image_channels=1)
    assert gray.config.image_mean == (0.5,) and gray[0]["image"].shape == (1, 8, 8)
    assert _dataset([sources / "m.csv"]).config.image_std[0] == pytest.approx(0.26862954)
    with pytest.raises(ImageTextDataError, match=r"--image-mean has 2 values: give 1 or 3"):
        _dataset([sources / "m.csv"], image_mean=(0.1, 0.2))
