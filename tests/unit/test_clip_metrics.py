"""CLIP's zero-shot metrics against independent references written here, numpy and scikit-learn.

The references never call the code under test: retrieval and classification rank every
candidate of every query in a Python loop (float64, ties to the lower index), AUROC counts
pairs, and the prompt ensemble is averaged by hand.
"""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from megatron_tempnet.models.clip.zero_shot_metrics import (
    MetricError,
    auroc,
    class_embeddings,
    retrieval_recalls,
    tau_statistics,
    zero_shot_accuracy,
)


def _normalised(n: int, d: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x / x.norm(dim=1, keepdim=True)


def _noisy_pairs(n: int, m: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``[n, d]`` and texts ``[m, d]`` (m <= n), text i a noisy copy of image i, so that
    recalls fall strictly between 0 and 100."""
    img = _normalised(n, d, seed)
    txt = img[:m] + 1.2 * _normalised(m, d, seed + 1000)
    return img, txt / txt.norm(dim=1, keepdim=True)


def _brute_topk_hits(queries, candidates, is_correct, k: int) -> float:
    """Percent of queries with a correct candidate among the first k of a stable descending sort
    of all candidates' dot products, in Python floats."""
    q_rows, c_rows = queries.tolist(), candidates.tolist()
    hits = 0
    for qi, q in enumerate(q_rows):
        scores = [sum(a * b for a, b in zip(q, c)) for c in c_rows]
        order = sorted(range(len(c_rows)), key=lambda c: (-scores[c], c))
        hits += any(is_correct(qi, c) for c in order[:k])
    return 100.0 * hits / len(q_rows)


# (n images, m texts, image keys, text keys): pairs; shared repeated keys; int keys, some texts
# with a key no image has (always a miss) and m != n.
RETRIEVAL_CASES = {
    "pairs": (37, 37, None, None),
    "shared_keys": (37, 37, [f"c{i % 5}" for i in range(37)], [f"c{i % 5}" for i in range(37)]),
    "int_keys_unmatched": (37, 29, [i % 6 for i in range(37)], [(3 * i) % 8 for i in range(29)]),
}


@pytest.mark.parametrize("case", RETRIEVAL_CASES)
def test_retrieval_against_brute_force(case):
    n, m, image_keys, text_keys = RETRIEVAL_CASES[case]
    img, txt = _noisy_pairs(n, m, 8, 0)
    got = retrieval_recalls(img, txt, image_keys=image_keys, text_keys=text_keys)
    if image_keys is None:
        text_ok = image_ok = lambda q, c: q == c  # noqa: E731
    else:
        text_ok = lambda q, c: text_keys[q] == image_keys[c]  # noqa: E731
        image_ok = lambda q, c: image_keys[q] == text_keys[c]  # noqa: E731
    assert sorted(got) == sorted(["ir@1", "ir@5", "ir@10", "tr@1", "tr@5", "tr@10", "mean_recall"])
    for k in (1, 5, 10):
        assert got[f"ir@{k}"] == pytest.approx(_brute_topk_hits(txt, img, text_ok, k), abs=1e-12)
        assert got[f"tr@{k}"] == pytest.approx(_brute_topk_hits(img, txt, image_ok, k), abs=1e-12)
    six = [got[f"{side}@{k}"] for side in ("ir", "tr") for k in (1, 5, 10)]
    assert got["mean_recall"] == pytest.approx(sum(six) / 6, abs=1e-12)
    for side in ("ir", "tr"):  # the data are not degenerate
        assert 0.0 < got[f"{side}@1"] < 100.0
        assert got[f"{side}@1"] <= got[f"{side}@5"] <= got[f"{side}@10"]


@pytest.mark.parametrize("case", RETRIEVAL_CASES)
def test_retrieval_blocks_equal_one_block(case):
    n, m, image_keys, text_keys = RETRIEVAL_CASES[case]
    img, txt = _noisy_pairs(n, m, 8, 2)
    one = retrieval_recalls(img, txt, image_keys=image_keys, text_keys=text_keys, block_size=10**6)
    for block in (1, 4, 36):
        blocked = retrieval_recalls(
            img, txt, image_keys=image_keys, text_keys=text_keys, block_size=block
        )
        assert blocked == one


# Rows of image/text embeddings; dot products image i . text j:
#   image 0: [1, 0, 0.6]   image 1: [0, 1, 0.8]   image 2 (= image 0): [1, 0, 0.6]
HAND_IMG = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
HAND_TXT = [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_retrieval_by_hand_pairs_with_ties(dtype):
    img, txt = torch.tensor(HAND_IMG, dtype=dtype), torch.tensor(HAND_TXT, dtype=dtype)
    got = retrieval_recalls(img, txt, ks=(1, 2, 5))
    # Text queries: text 0 ties images 0, 2 at 1 -> image 0 first (hit@1); text 1 -> image 1
    # (hit@1); text 2 -> image 1 (0.8), then images 0, 2 tied at 0.6 -> image 2 third (hit@3).
    # k = 5 > 3 images is clamped to 3.
    assert got["ir@1"] == pytest.approx(200 / 3)
    assert got["ir@2"] == pytest.approx(200 / 3)
    assert got["ir@5"] == 100.0
    # Image queries: image 0 -> text 0 (hit@1); image 1 -> text 1 (hit@1); image 2 -> text 0,
    # then text 2 (hit@2).
    assert got["tr@1"] == pytest.approx(200 / 3)
    assert got["tr@2"] == 100.0
    assert got["tr@5"] == 100.0
    assert got["mean_recall"] == pytest.approx((200 / 3 * 3 + 100 * 3) / 6)


def test_retrieval_by_hand_with_keys():
    img, txt = torch.tensor(HAND_IMG), torch.tensor(HAND_TXT)
    got = retrieval_recalls(
        img, txt, image_keys=["x", "y", "x"], text_keys=["y", "x", "z"], ks=(1, 2, 3)
    )
    # Text 0 (y): images 0 (x), 2 (x), 1 (y) -> hit@3. Text 1 (x): images 1 (y), 0 (x) -> hit@2.
    # Text 2 (z): no image has key z -> never a hit.
    assert [got["ir@1"], got["ir@2"], got["ir@3"]] == pytest.approx([0.0, 100 / 3, 200 / 3])
    # Image 0 (x): texts 0 (y), 2 (z), 1 (x) -> hit@3; image 1 (y): texts 1 (x), 2 (z), 0 (y)
    # -> hit@3; image 2 as image 0.
    assert [got["tr@1"], got["tr@2"], got["tr@3"]] == pytest.approx([0.0, 0.0, 100.0])
    assert got["mean_recall"] == pytest.approx(100 / 3)


def test_retrieval_errors():
    img, txt = _normalised(4, 3, 0), _normalised(4, 3, 1)
    with pytest.raises(MetricError, match="not pairs"):
        retrieval_recalls(img, txt[:3])
    with pytest.raises(MetricError, match="both image_keys and text_keys"):
        retrieval_recalls(img, txt, image_keys=list("abcd"))
    with pytest.raises(MetricError, match="one key per image"):
        retrieval_recalls(img, txt, image_keys=list("abc"), text_keys=list("abcd"))
    with pytest.raises(MetricError, match="widths differ"):
        retrieval_recalls(img, _normalised(4, 5, 1))
    with pytest.raises(MetricError, match=r"image_emb must be \[n, d\]"):
        retrieval_recalls(img[0], txt)
    with pytest.raises(MetricError, match="NaN"):
        retrieval_recalls(img, torch.full((4, 3), float("nan"), dtype=torch.float64))
    with pytest.raises(MetricError, match="ks="):
        retrieval_recalls(img, txt, ks=(0, 5))
    with pytest.raises(MetricError, match="block_size"):
        retrieval_recalls(img, txt, block_size=0)
    assert issubclass(MetricError, ValueError)


def _brute_auroc(scores, labels) -> float:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("ties", [False, True])
def test_auroc_against_sklearn_and_pair_count(ties):
    gen = torch.Generator().manual_seed(11 + ties)
    scores = torch.randn(300, generator=gen, dtype=torch.float64)
    if ties:
        scores = torch.round(scores * 2) / 2  # ~10 distinct values: many ties across classes
        assert len(set(scores.tolist())) < 20
    labels = torch.rand(300, generator=gen) < 0.3
    got = auroc(scores, labels)
    assert got == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-12)
    assert got == pytest.approx(_brute_auroc(scores.tolist(), labels.tolist()), abs=1e-12)
    # float32 scores, 0/1 int labels and an [n, 1] column give the same number
    column = auroc(scores.float()[:, None], labels.long())
    assert column == pytest.approx(roc_auc_score(labels.numpy(), scores.float().numpy()))


def test_auroc_by_hand_and_edge_values():
    s, y = [0.1, 0.4, 0.4, 0.9, 0.2], [False, True, False, True, False]
    # positives 0.4, 0.9 against negatives 0.1, 0.4, 0.2: 0.4 wins 2 and ties 1, 0.9 wins 3
    assert auroc(s, y) == pytest.approx((2 + 0.5 + 3) / 6)
    assert auroc([1, 2, 3, 4], [False, False, True, True]) == 1.0
    assert auroc([4, 3, 2, 1], [False, False, True, True]) == 0.0
    assert auroc([1, 1, 1, 1], [False, True, False, True]) == 0.5
    assert auroc([-math.inf, 0.0, math.inf], [False, True, True]) == 1.0


def test_auroc_errors():
    with pytest.raises(MetricError, match="both classes"):
        auroc([1.0, 2.0], [True, True])
    with pytest.raises(MetricError, match="both classes"):
        auroc([1.0, 2.0], [False, False])
    with pytest.raises(MetricError, match="both classes"):
        auroc([], [])
    with pytest.raises(MetricError, match="3 scores but 2"):
        auroc([1.0, 2.0, 3.0], [True, False])
    with pytest.raises(MetricError, match="NaN"):
        auroc([1.0, float("nan")], [True, False])
    with pytest.raises(MetricError, match="0/1"):
        auroc([1.0, 2.0], [0, 2])
    with pytest.raises(MetricError, match="1-D"):
        auroc(torch.zeros(2, 2), [True, False])


def _brute_zero_shot(img, classes, labels, k: int) -> float:
    hits = 0
    for row, label in zip(img.tolist(), labels.tolist()):
        scores = [sum(a * b for a, b in zip(row, c)) for c in classes.tolist()]
        order = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
        hits += label in order[:k]
    return 100.0 * hits / len(labels)


def test_zero_shot_accuracy_against_loop():
    img, classes = _normalised(40, 6, 4), _normalised(7, 6, 5)
    labels = torch.randint(0, 7, (40,), generator=torch.Generator().manual_seed(6))
    got = zero_shot_accuracy(img, classes, labels, ks=(1, 5, 10))
    for k in (1, 5):
        assert got[f"top{k}"] == pytest.approx(_brute_zero_shot(img, classes, labels, k))
    assert got["top10"] == 100.0  # clamped to C = 7 classes
    assert 0.0 < got["top1"] < got["top5"] < 100.0
    assert zero_shot_accuracy(img, classes, labels, ks=(1, 5), block_size=3) == {
        "top1": got["top1"],
        "top5": got["top5"],
    }


def test_zero_shot_ties_and_errors():
    classes = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # classes 0 and 1 identical
    img = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    # image 1 (class 1) ties classes 0 and 1 -> class 0 first: a top-1 miss, a top-2 hit
    got = zero_shot_accuracy(img, classes, torch.tensor([0, 1, 2]), ks=(1, 2))
    assert got == {"top1": pytest.approx(200 / 3), "top2": 100.0}
    with pytest.raises(MetricError, match=r"labels must lie in \[0, 3\)"):
        zero_shot_accuracy(img, classes, torch.tensor([0, 1, 3]))
    with pytest.raises(MetricError, match="integer class ids"):
        zero_shot_accuracy(img, classes, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(MetricError, match="integer class ids"):
        zero_shot_accuracy(img, classes, torch.tensor([0, 1]))


def _hash_encoder(calls: list):
    """A deterministic fake text encoder: sha256 bytes of each text -> a normalised [n, 4]."""

    def encode(texts: list[str]) -> torch.Tensor:
        calls.append(list(texts))
        rows = []
        for text in texts:
            digest = hashlib.sha256(text.encode()).digest()
            v = [digest[i] - 127.5 for i in range(4)]
            norm = math.sqrt(sum(x * x for x in v))
            rows.append([x / norm for x in v])
        return torch.tensor(rows, dtype=torch.float64)

    return encode


def test_class_embeddings_is_the_normalised_prompt_mean():
    calls: list = []
    encode = _hash_encoder(calls)
    names, templates = ["cat", "zebra", "digit 7"], ["a {}.", "the {} here", "{}"]
    got = class_embeddings(encode, names, templates)
    assert got.shape == (3, 4) and got.dtype == torch.float64
    assert calls == [[t.format(name) for t in templates] for name in names]
    for row, name in zip(got.tolist(), names):
        prompts = [encode([t.format(name)])[0].tolist() for t in templates]
        mean = [sum(p[j] for p in prompts) / len(prompts) for j in range(4)]
        norm = math.sqrt(sum(x * x for x in mean))
        assert row == pytest.approx([x / norm for x in mean], abs=1e-12)


def test_class_embeddings_errors():
    encode = _hash_encoder([])
    with pytest.raises(MetricError, match=re.escape("'a photo of a cat'")):
        class_embeddings(encode, ["cat"], ["a {}", "a photo of a cat"])
    with pytest.raises(MetricError, match=re.escape("'a {} and {}'")):
        class_embeddings(encode, ["cat"], ["a {} and {}"])
    with pytest.raises(MetricError, match="at least one class name"):
        class_embeddings(encode, [], ["a {}"])
    with pytest.raises(MetricError, match=r"must return \[2, d\]"):
        class_embeddings(lambda texts: torch.ones(1, 4), ["cat"], ["a {}", "the {}"])


@pytest.mark.parametrize("n", [1, 10, 101])
def test_tau_statistics_against_numpy(n):
    tau = torch.rand(n, generator=torch.Generator().manual_seed(n)) * 0.05 + 0.01
    got = tau_statistics(tau, prefix="tau_image")
    t = tau.double().numpy()
    want = {
        "mean": t.mean(),
        "std": t.std(),
        "min": t.min(),
        "max": t.max(),
        "p10": np.quantile(t, 0.1),
        "p50": np.quantile(t, 0.5),
        "p90": np.quantile(t, 0.9),
    }
    assert sorted(got) == sorted(f"tau_image_{name}" for name in want)
    for name, value in want.items():
        assert got[f"tau_image_{name}"] == pytest.approx(float(value), abs=1e-15), name


def test_tau_statistics_edge_cases():
    with pytest.raises(MetricError, match="empty"):
        tau_statistics(torch.tensor([]))
    with pytest.raises(MetricError, match="1-D"):
        tau_statistics(torch.ones(2, 3))
    assert all(math.isnan(v) for v in tau_statistics(torch.tensor([0.5, float("nan")])).values())
    assert tau_statistics(torch.full((4, 1), 0.07))["tau_std"] == 0.0  # a [n, 1] column
