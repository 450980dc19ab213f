"""CLIP's zero-shot metrics against brute-force references written here and scikit-learn."""

from __future__ import annotations

import pytest
import torch
from sklearn.metrics import roc_auc_score

from megatron_tempnet.inference.clip_metrics import (
    MetricError,
    auroc,
    class_embeddings,
    retrieval_recalls,
    tau_statistics,
    zero_shot_accuracy,
)


def _normalised(n, d, seed):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=1)


def _brute_recall(queries, candidates, correct, k) -> float:
    """Percent of queries with a correct candidate in the top k of a stable descending sort."""
    hits = 0
    for q in range(queries.shape[0]):
        scores = [float(queries[q] @ candidates[c]) for c in range(candidates.shape[0])]
        order = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
        hits += any(correct(q, c) for c in order[:k])
    return 100.0 * hits / queries.shape[0]


@pytest.mark.parametrize("keyed", [False, True])
def test_retrieval_against_brute_force(keyed):
    img, txt = _normalised(37, 8, 0), _normalised(37, 8, 1)
    keys = [f"c{i % 5}" for i in range(37)] if keyed else None
    got = retrieval_recalls(img, txt, image_keys=keys, text_keys=keys)
    blocked = retrieval_recalls(img, txt, image_keys=keys, text_keys=keys, block_size=4)
    assert got == blocked
    same = (lambda q, c: keys[q] == keys[c]) if keyed else (lambda q, c: q == c)
    for k in (1, 5, 10):
        assert got[f"ir@{k}"] == pytest.approx(_brute_recall(txt, img, same, k))
        assert got[f"tr@{k}"] == pytest.approx(_brute_recall(img, txt, same, k))
    assert got["mean_recall"] == pytest.approx(sum(got[k] for k in got if "@" in k) / 6)


def test_retrieval_by_hand_with_ties():
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    txt = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    got = retrieval_recalls(img, txt, ks=(1, 2))
    # text 0 ties images 0 and 2 (image 0 first: hit); text 1 -> image 1 (hit); text 2 -> image
    # 1 then 0 (image 2 is third: miss at 1 and 2)
    assert got["ir@1"] == pytest.approx(200 / 3) and got["ir@2"] == pytest.approx(200 / 3)
    # image 0 -> text 0 (hit); image 1 ties texts 1, 2 (text 1 first: hit); image 2 -> text 0
    # first, text 2 (score 0) ties text 1 behind it: miss at 1 and 2
    assert got["tr@1"] == pytest.approx(200 / 3) and got["tr@2"] == pytest.approx(200 / 3)
    with pytest.raises(MetricError, match="not pairs"):
        retrieval_recalls(img, txt[:2])


def test_auroc_against_sklearn_and_pairs():
    gen = torch.Generator().manual_seed(3)
    for ties in (False, True):
        scores = torch.randn(300, generator=gen)
        scores = scores.round(decimals=0) if ties else scores
        labels = torch.rand(300, generator=gen) < 0.3
        assert auroc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    s, y = [0.1, 0.4, 0.4, 0.9, 0.2], [False, True, False, True, False]
    pairs = [(a, b) for a, ya in zip(s, y) if ya for b, yb in zip(s, y) if not yb]
    brute = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs)
    assert auroc(s, y) == pytest.approx(brute)
    assert auroc([1, 2, 3, 4], [False, False, True, True]) == 1.0
    assert auroc([4, 3, 2, 1], [False, False, True, True]) == 0.0
    assert auroc([1, 1, 1, 1], [False, True, False, True]) == 0.5
    with pytest.raises(MetricError, match="both classes"):
        auroc([1, 2], [True, True])
    with pytest.raises(MetricError, match="NaN"):
        auroc([1, float("nan")], [True, False])


def test_zero_shot_and_prompt_ensemble():
    img, classes = _normalised(40, 6, 4), _normalised(7, 6, 5)
    labels = torch.randint(0, 7, (40,), generator=torch.Generator().manual_seed(6))
    got = zero_shot_accuracy(img, classes, labels)
    rows = [img[i] @ classes.t() for i in range(40)]
    ranks = [(row > row[labels[i]]).sum() for i, row in enumerate(rows)]
    assert got["top1"] == pytest.approx(100 * sum(int(r) < 1 for r in ranks) / 40)
    assert got["top5"] == pytest.approx(100 * sum(int(r) < 5 for r in ranks) / 40)

    def encode(texts):  # deterministic fake text encoder
        return torch.stack([torch.tensor([len(t), t.count("a") + 1.0, ord(t[-1])]) for t in texts])

    templates = ["a {}.", "the {} here"]
    got = class_embeddings(encode, ["cat", "zebra"], templates)
    for row, name in zip(got, ["cat", "zebra"]):
        prompts = [torch.nn.functional.normalize(encode([t.format(name)])[0], dim=0)
                   for t in templates]  # fmt: skip
        mean = (prompts[0] + prompts[1]) / 2
        torch.testing.assert_close(row, mean / mean.norm())
    with pytest.raises(MetricError, match="has no"):
        class_embeddings(encode, ["cat"], ["no placeholder"])


def test_tau_statistics_against_numpy():
    import numpy as np

    tau = torch.rand(101, generator=torch.Generator().manual_seed(7)) * 0.05
    got = tau_statistics(tau, prefix="tau_image")
    t = tau.double().numpy()
    assert got["tau_image_mean"] == pytest.approx(t.mean())
    assert got["tau_image_std"] == pytest.approx(t.std())
    assert got["tau_image_p90"] == pytest.approx(np.quantile(t, 0.9))
    assert got["tau_image_min"] == pytest.approx(t.min())
