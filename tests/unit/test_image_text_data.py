"""Image-text data: manifests and tar shards give the same samples, tokens end with the
end-of-text token, transforms match a PIL reference, caption noise and shuffled epochs behave
as documented, bad rows and images are reported (or counted), the digits writer."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import tarfile
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_tempnet.models.clip.data.captions import noisy_caption, tokenize_captions
from megatron_tempnet.models.clip.data.digits import DIGIT_NAMES, SUBSETS, write_digits_dataset
from megatron_tempnet.models.clip.data.image_text import (
    ImageTextDataConfig,
    ImageTextDataError,
    ImageTextDataset,
)
from megatron_tempnet.models.clip.data.shuffled_epochs import EpochShuffledDataset
from megatron_tempnet.models.clip.data.transforms import augment_generator, random_crop_box

EOD = 1


class WordTokenizer:
    """word -> a fixed id in [2, 1000); end of text = 1, padding = 0."""

    eod, vocab_size = EOD, 1000

    def tokenize(self, text: str) -> list[int]:
        return [2 + zlib.crc32(w.encode()) % 998 for w in text.split()]


CAPTIONS = ["a red square", 'two "blue", dots\nhere', "one", "a long caption " * 5]
SIZES = [(12, 14), (16, 9), (10, 10), (7, 13)]  # (height, width): both orientations


@pytest.fixture()
def sources(tmp_path):
    """The same four pairs as m.csv, m.tsv, m.jsonl and shard.tar (labels in .cls/.json)."""
    rng = np.random.default_rng(0)
    rows = []
    for i, (caption, hw) in enumerate(zip(CAPTIONS, SIZES)):
        Image.fromarray(rng.integers(0, 255, (*hw, 3), dtype=np.uint8)).save(tmp_path / f"s{i}.png")
        rows.append({"image": f"s{i}.png", "caption": caption, "label": f"c{i % 2}"})
    for name, delimiter in (("m.csv", ","), ("m.tsv", "\t")):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.DictWriter(f, ["image", "caption", "label"], delimiter=delimiter)
            writer.writeheader()
            writer.writerows(rows)
    with open(tmp_path / "m.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for i, r in enumerate(rows):
            tar.add(tmp_path / r["image"], arcname=f"sample{i:03d}.png")
            label = (".cls", r["label"]) if i % 2 else (".json", json.dumps({"label": r["label"]}))
            _add_member(tar, f"sample{i:03d}.txt", r["caption"])
            _add_member(tar, f"sample{i:03d}{label[0]}", label[1])
    return tmp_path


def _add_member(tar: tarfile.TarFile, name: str, text: str | bytes) -> None:
    data = text.encode() if isinstance(text, str) else text
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _dataset(paths, **kw) -> ImageTextDataset:
    cfg = dict(paths=[str(p) for p in paths], label_key="label", image_size=8, context_length=6)
    return ImageTextDataset(ImageTextDataConfig(**{**cfg, **kw}), WordTokenizer())


def _reference(path, size: int, mean, std, channels: int = 3) -> torch.Tensor:
    """Resize the shorter side with PIL, centre crop by hand, normalise in numpy."""
    img = Image.open(path).convert("RGB" if channels == 3 else "L")
    w, h = img.size
    new = (size, round(h * size / w)) if w <= h else (round(w * size / h), size)
    arr = np.asarray(img.resize(new, Image.Resampling.BICUBIC), dtype=np.float64) / 255
    top, left = (new[1] - size) // 2, (new[0] - size) // 2
    arr = arr[top : top + size, left : left + size].reshape(size, size, channels)
    arr = (arr - np.asarray(mean)) / np.asarray(std)
    return torch.from_numpy(arr.transpose(2, 0, 1)).float()


def test_manifests_and_tar_shards_give_the_same_samples(sources):
    names = ("m.csv", "m.tsv", "m.jsonl", "shard.tar")
    sets = [_dataset([sources / name]) for name in names]
    for i in range(len(CAPTIONS)):
        samples = [ds[i] for ds in sets]
        for ds, s in zip(sets, samples):
            assert torch.equal(s["image"], samples[0]["image"])
            assert torch.equal(s["tokens"], samples[0]["tokens"])
            assert (s["label"], int(s["index"]), ds.raw_caption(i)) == (
                f"c{i % 2}",
                i,
                CAPTIONS[i].strip(),
            )
    both = _dataset([sources / "m.csv", sources / "shard.tar"])
    assert len(both) == 8 and both.label(5) == "c1" and int(both[6]["index"]) == 6
    assert torch.equal(both[6]["image"], sets[0][2]["image"])
    folder = _dataset([sources])  # a directory: its .tar shards
    assert len(folder) == 4 and folder.raw_caption(1) == CAPTIONS[1]


def test_tokens_end_with_end_of_text(sources):
    ds = _dataset([sources / "m.csv"])
    ids = [WordTokenizer().tokenize(c) for c in CAPTIONS]
    one = ds[1]  # 4 words + end of text, padded to 6
    assert one["tokens"].dtype == torch.int64 and one["tokens"].shape == (6,)
    assert one["tokens"].tolist() == ids[1] + [EOD, 0] and int(one["length"]) == 5
    assert int(ds[2]["length"]) == 2 and ds[2]["tokens"].tolist() == ids[2] + [EOD, 0, 0, 0, 0]
    long = ds[3]  # 15 words cut to 5 so the end-of-text token stays last
    assert long["tokens"].tolist() == ids[3][:5] + [EOD] and int(long["length"]) == 6
    tokens, lengths = tokenize_captions(WordTokenizer(), CAPTIONS, 3)
    assert tokens[:, -1].tolist() == [EOD, EOD, 0, EOD] and lengths.tolist() == [3, 3, 2, 3]

    class NoEod(WordTokenizer):
        eod = None

    with pytest.raises(ImageTextDataError, match="no end-of-text token"):
        ImageTextDataset(ImageTextDataConfig(paths=[str(sources / "m.csv")]), NoEod())


def test_centre_crop_matches_pil(sources):
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    ds = _dataset([sources / "m.csv"], image_mean=mean, image_std=std)
    for i in range(len(SIZES)):
        got = ds[i]["image"]
        assert got.dtype == torch.float32 and got.shape == (3, 8, 8)
        torch.testing.assert_close(got, _reference(sources / f"s{i}.png", 8, mean, std))
    gray = _dataset([sources / "m.csv"], image_channels=1, image_size=5)
    assert gray.config.image_mean == (0.5,)
    torch.testing.assert_close(gray[0]["image"], _reference(sources / "s0.png", 5, 0.5, 0.5, 1))
    assert _dataset([sources / "m.csv"]).config.image_std[0] == pytest.approx(0.26862954)
    with pytest.raises(ImageTextDataError, match=r"--image-mean has 2 values: give 1 or 3"):
        _dataset([sources / "m.csv"], image_mean=(0.1, 0.2))


def test_random_crop_boxes_stay_in_range():
    for seed in range(200):
        width, height = 40 + seed % 9, 40 + seed % 7  # aspect in [3/4, 4/3]
        left, top, right, bottom = random_crop_box(width, height, augment_generator(seed, 0, 1))
        w, h = right - left, bottom - top
        assert 0 <= left and right <= width and 0 <= top and bottom <= height
        assert 0.9 - 0.05 <= w * h / (width * height) <= 1.0
        assert 3 / 4 - 0.05 <= w / h <= 4 / 3 + 0.05  # rounding to whole pixels
    assert random_crop_box(100, 10, augment_generator(0, 0, 0)) == (43, 0, 56, 10)  # fallback


def test_augmentation_is_seeded_by_seed_epoch_index(sources):
    a = _dataset([sources / "m.csv"], augment=True)
    b = _dataset([sources / "m.csv"], augment=True)
    assert torch.equal(a.get(0, 3)["image"], b.get(0, 3)["image"])
    assert not torch.equal(a.get(0, 3)["image"], a.get(0, 4)["image"])
    assert not torch.equal(a.get(0, 3)["image"], _dataset([sources / "m.csv"]).get(0, 3)["image"])
    assert torch.equal(a[0]["image"], a.get(0, 0)["image"])  # no epoch_of: epoch 0
    c = _dataset([sources / "m.csv"], augment=True, seed=99)
    assert not torch.equal(a.get(0, 3)["image"], c.get(0, 3)["image"])
    d = ImageTextDataset(a.config, WordTokenizer(), epoch_of=lambda index: 3)
    assert torch.equal(d[0]["image"], a.get(0, 3)["image"])
    # the shuffled epochs read position p with its own epoch
    shuffled = EpochShuffledDataset(a, global_batch_size=2, num_positions=12, seed=5)
    for position in (1, 5, 9):
        epoch, index = shuffled.epoch_of_position(position), shuffled.index_at(position)
        assert epoch == position // 4
        assert torch.equal(shuffled[position]["image"], b.get(index, epoch)["image"])


def test_caption_noise(sources):
    caption = "a handwritten digit seven on paper"
    noisy = [noisy_caption(caption, 15.0, 1, i) for i in range(2000)]
    assert noisy == [noisy_caption(caption, 15.0, 1, i) for i in range(2000)]
    changed = [n for n in noisy if n != caption]
    assert abs(len(changed) - 300) < 3 * math.sqrt(2000 * 0.15 * 0.85)
    words = caption.split()
    deleted = {" ".join(words[:i] + words[i + 1 :]) for i in range(len(words))}
    replaced = {" ".join(words[:i] + ["random"] + words[i + 1 :]) for i in range(len(words))}
    assert all(n in deleted | replaced for n in changed)
    assert 0.35 < sum(n in deleted for n in changed) / len(changed) < 0.65
    assert {noisy_caption("seven", 100.0, 0, i) for i in range(50)} == {"random"}
    assert all(noisy_caption(caption, 100.0, 2, i) != caption for i in range(50))
    assert noisy_caption(caption, 0.0, 1, 7) == caption
    with pytest.raises(ValueError, match="--caption-noise"):
        noisy_caption(caption, 120.0, 1, 0)
    ds = _dataset([sources / "m.csv"], caption_noise=100.0, seed=4)
    expected_captions = [noisy_caption(c.strip(), 100, 4, i) for i, c in enumerate(CAPTIONS)]
    assert [ds.caption(i) for i in range(4)] == expected_captions
    expected = tokenize_captions(WordTokenizer(), [ds.caption(0)], 6)[0][0]
    assert torch.equal(ds[0]["tokens"], expected) and ds.raw_caption(0) == CAPTIONS[0]


def test_bad_rows_stop_or_are_counted(sources, caplog):
    (sources / "bad.csv").write_text(
        'image,caption,label\ns0.png,"a caption,\nover two lines",c0\ns1.png,,c1\n'
        "missing.png,x,c0\ns3.png,fine,c1\n"
    )
    with pytest.raises(ImageTextDataError, match=r"bad.csv:4: no 'caption' value.*skip-bad"):
        _dataset([sources / "bad.csv"])
    (sources / "bad2.csv").write_text("image,caption,label\nmissing.png,x,c0\n")
    with pytest.raises(ImageTextDataError, match=r"bad2.csv:2: image .*missing.png does not"):
        _dataset([sources / "bad2.csv"])
    with caplog.at_level(logging.WARNING, logger="megatron_tempnet"):
        ds = _dataset([sources / "bad.csv"], skip_bad_samples=True)
    assert len(ds) == 2 and ds.skipped == 2 and ds.raw_caption(1) == "fine"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 2 of 4 pairs; the first: " in warnings[0]
    assert "bad.csv:4" in warnings[0]
    (sources / "nocol.csv").write_text("image,text,label\ns0.png,a,c0\n")
    with pytest.raises(
        ImageTextDataError, match=r"nocol.csv:1: .*no column 'caption'.*caption-key"
    ):
        _dataset([sources / "nocol.csv"])
    (sources / "bad.jsonl").write_text(
        '{"image": "s0.png", "caption": "ok", "label": "a"}\n{oops\n'
    )
    with pytest.raises(ImageTextDataError, match=r"bad.jsonl:2: not JSON"):
        _dataset([sources / "bad.jsonl"])
    with pytest.raises(ImageTextDataError, match="unsupported file"):
        _dataset([sources / "s0.png"])
    (sources / "empty.csv").write_text("image,caption,label\n")
    with pytest.raises(ImageTextDataError, match="no image-text pairs"):
        _dataset([sources / "empty.csv"])


def test_bad_tar_samples(sources):
    with tarfile.open(sources / "bad.tar", "w") as tar:
        tar.add(sources / "s0.png", arcname="a.png")
        _add_member(tar, "a.txt", "fine")
        tar.add(sources / "s1.png", arcname="b.png")  # no caption
        _add_member(tar, "c.txt", "no image")
        _add_member(tar, "c.cls", "c0")
    with pytest.raises(ImageTextDataError, match=r"bad.tar:b: the sample has no caption"):
        _dataset([sources / "bad.tar"], label_key=None)
    ds = _dataset([sources / "bad.tar"], label_key=None, skip_bad_samples=True)
    assert len(ds) == 1 and ds.skipped == 2 and ds.raw_caption(0) == "fine"
    assert ds[0]["label"] == ""
    with pytest.raises(ImageTextDataError, match=r"bad.tar:a: no label \(--label-key label"):
        _dataset([sources / "bad.tar"])


def test_undecodable_images(sources, caplog):
    (sources / "s2.png").write_bytes(b"not an image")
    with pytest.raises(ImageTextDataError, match=r"m.csv:5: sample 2: cannot read .*s2.png"):
        _dataset([sources / "m.csv"])[2]
    ds = _dataset([sources / "m.csv"], skip_bad_samples=True)
    with caplog.at_level(logging.WARNING, logger="megatron_tempnet"):
        got = ds[2]
    assert int(got["index"]) == 3 and ds.skipped == 1
    assert torch.equal(got["image"], ds[3]["image"]) and torch.equal(got["tokens"], ds[3]["tokens"])
    assert any("s2.png" in r.getMessage() for r in caplog.records)
    with tarfile.open(sources / "garbage.tar", "w") as tar:
        _add_member(tar, "k.png", b"\x89PNG garbage")
        _add_member(tar, "k.txt", "a caption")
        _add_member(tar, "k.cls", "c0")
    with pytest.raises(ImageTextDataError, match=r"garbage.tar:k: sample 0: cannot read"):
        _dataset([sources / "garbage.tar"])[0]


def test_tar_reads_in_forked_workers(sources):
    ds = _dataset([sources / "shard.tar"])
    expected = [ds[i]["image"] for i in (3, 0, 2, 1)]  # the main process opens its handle first
    loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(ds, [3, 0, 2, 1]),
        batch_size=1,
        num_workers=2,
        multiprocessing_context="fork",
    )
    for want, batch in zip(expected, loader):
        assert torch.equal(batch["image"][0], want)


def test_description_hash(sources):
    base = _dataset([sources / "m.csv"])
    assert base.unique_description_hash == _dataset([sources / "m.csv"]).unique_description_hash
    assert (
        base.unique_description_hash
        == _dataset([sources / "m.csv"], skip_bad_samples=True).unique_description_hash
    )
    for change in ({"caption_noise": 10.0}, {"seed": 1}, {"image_size": 9}, {"augment": True}):
        assert _dataset([sources / "m.csv"], **change).unique_description_hash != (
            base.unique_description_hash
        ), change
    assert _dataset([sources / "m.tsv"]).unique_description_hash != base.unique_description_hash


class _Indices:
    """A stand-in dataset of ``n`` indices (the sampler needs only len, get and the hash)."""

    unique_description_hash = "x"

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get(self, index: int, epoch: int) -> dict:
        return {"index": index, "epoch": epoch}


def test_epochs_are_permutations_cut_to_whole_batches():
    n, batch = 23, 5
    ds = EpochShuffledDataset(_Indices(n), global_batch_size=batch, num_positions=100, seed=3)
    assert ds.per_epoch == 20 and len(ds) == 100
    epochs = [[ds.index_at(p) for p in range(e * 20, e * 20 + 20)] for e in range(5)]
    for order in epochs:
        assert len(set(order)) == 20 and set(order) <= set(range(n))
        for b in range(0, 20, batch):
            assert len(set(order[b : b + batch])) == batch
    assert epochs[0] != epochs[1]
    assert [ds[p]["epoch"] for p in (0, 19, 20, 99)] == [0, 0, 1, 4]
    again = EpochShuffledDataset(_Indices(n), global_batch_size=batch, num_positions=100, seed=3)
    assert [again.index_at(p) for p in range(100)] == sum(epochs, [])
    other = EpochShuffledDataset(_Indices(n), global_batch_size=batch, num_positions=100, seed=4)
    assert [other.index_at(p) for p in range(20)] != epochs[0]
    assert other.unique_description_hash != ds.unique_description_hash
    plain = EpochShuffledDataset(
        _Indices(n), global_batch_size=batch, num_positions=40, seed=3, shuffle=False
    )
    assert [plain.index_at(p) for p in range(40)] == list(range(20)) * 2
    with pytest.raises(IndexError):
        plain.index_at(40)
    with pytest.raises(ImageTextDataError, match=r"has 23 pairs.*--global-batch-size 24"):
        EpochShuffledDataset(_Indices(n), global_batch_size=24, num_positions=24, seed=0)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digits_dataset(str(tmp_path_factory.mktemp("digits")))


def _rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_digits_writer(digits):
    from sklearn.datasets import load_digits

    sk = load_digits()
    counts = np.bincount(sk.target)
    assert digits["total_count"] == 1797 == digits["train_count"] + digits["test_count"]
    assert digits["test_count"] == sum(round(c * 0.2) for c in counts)
    rows = {subset: _rows(digits[subset]) for subset in SUBSETS}
    assert {k: len(v) for k, v in rows.items()} == {k: digits[f"{k}_count"] for k in SUBSETS}
    assert {r["label"] for r in rows["test_5-9"]} == set(DIGIT_NAMES[5:])
    assert {r["label"] for r in rows["train_0-4"] + rows["test_0-4"]} == set(DIGIT_NAMES[:5])
    assert len(rows["test_0-4"]) + len(rows["test_5-9"]) == len(rows["test"])
    for row in rows["test"][:50]:
        index = int(row["image"].split("_")[1].split(".")[0])
        digit = int(sk.target[index])
        assert row["label"] == DIGIT_NAMES[digit] and "," not in row["caption"]
        assert DIGIT_NAMES[digit] in row["caption"].split() or str(digit) in row["caption"]
        png = np.asarray(Image.open(os.path.join(os.path.dirname(digits["images"]), row["image"])))
        expected = np.kron(np.round(sk.images[index] * 255 / 16), np.ones((2, 2)))
        assert png.shape == (16, 16) and np.array_equal(png, expected)


def test_digits_read_back_as_grayscale_pairs(digits):
    config = ImageTextDataConfig(
        paths=[digits["test_5-9"]], label_key="label", image_size=16, image_channels=1
    )
    ds = ImageTextDataset(config, WordTokenizer())
    assert len(ds) == digits["test_5-9_count"]
    row = _rows(digits["test_5-9"])[0]
    png = np.asarray(Image.open(os.path.join(os.path.dirname(digits["images"]), row["image"])))
    png = png.astype(np.float32)
    expected = torch.from_numpy((png / 255 - 0.5) / 0.5)[None]
    assert torch.equal(ds[0]["image"], expected) and ds[0]["label"] == row["label"]


def _samples(ds) -> list:
    return [(s["tokens"].tolist(), s["label"], s["image"].sum().item()) for s in ds]


def test_a_shard_index_is_built_once_and_reused_while_the_shard_is_unchanged(
    sources, tmp_path, monkeypatch, caplog
):
    from megatron_tempnet.models.clip.data import pair_table

    shard = sources / "shard.tar"
    first = _dataset([shard])
    beside = sources / "shard.tar.idx.json"
    assert beside.is_file() and json.loads(beside.read_text())["size"] == shard.stat().st_size
    expected = _samples(first)

    def no_scan(path):
        raise AssertionError(f"{path} scanned again")

    with monkeypatch.context() as m:  # unchanged: read from the index, no header scanned
        m.setattr(pair_table, "scan_shard", no_scan)
        assert _samples(_dataset([shard])) == expected
    scans = []
    real_scan = pair_table.scan_shard
    monkeypatch.setattr(pair_table, "scan_shard", lambda p: scans.append(p) or real_scan(p))
    os.utime(shard, ns=(1, 1))  # another modification time: scanned anew
    assert _samples(_dataset([shard])) == expected and len(scans) == 1
    cache = tmp_path / "cache"  # --data-cache-path: the index goes there
    assert _samples(_dataset([shard], data_cache_path=str(cache))) == expected
    assert len(list((cache / "clip_shard_index").glob("*-shard.tar.json"))) == 1
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):  # cannot be written: a warning, the data still loads
        assert _samples(_dataset([shard], data_cache_path=str(blocked))) == expected
    assert "cannot write its member index" in caplog.text and "--data-cache-path" in caplog.text


def test_pair_table_holds_the_pairs_without_python_objects():
    from megatron_tempnet.models.clip.data.pair_table import PairTable

    table = PairTable()
    shard, manifest = table.source("a.tar"), table.source("b.csv")
    table.add(shard, "k1", (512, 100), "a red dog", "dog")
    table.add(manifest, "7", "/data/x.jpg", "ünïcode caption", "")
    table.freeze()
    assert len(table) == 2 and table.caption(1) == "ünïcode caption" and table.label(0) == "dog"
    assert table.image(0) == ("a.tar", 512, 100) and table.image(1) == "/data/x.jpg"
    assert table.where(0) == "a.tar:k1" and table.where(1) == "b.csv:7"
    text = len("a red dogdogk1") + len("ünïcode caption".encode()) + len("7/data/x.jpg")
    assert table.nbytes() == 2 * (4 + 8 + 8) + 4 * 2 * 8 + text
