"""Zero-shot metrics for CLIP models on embeddings: retrieval, classification, AUROC, tau.

Pure tensor math (no model, no process group); ``clip_evaluation`` feeds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class MetricError(ValueError):
    """Inputs a metric cannot be computed on; says which and why."""


def _hits_at(scores: torch.Tensor, correct: torch.Tensor, ks: Sequence[int]) -> list[float]:
    """Per k, the number of queries (rows) with a correct item among their top k.

    The rank of the first correct item counts the candidates scored strictly higher plus the
    earlier-indexed ones scored equally (a stable descending order, lower index first).
    """
    best = scores.masked_fill(~correct, float("-inf"))
    first = best.argmax(dim=1)  # the correct candidate that ranks first: the highest score,
    top = best.gather(1, first[:, None])  # and among ties the lowest index (argmax's choice)
    idx = torch.arange(scores.shape[1], device=scores.device)[None]
    ahead = (scores > top) | ((scores == top) & (idx < first[:, None]))
    rank = ahead.sum(dim=1)  # 0-based position of the first correct item
    has = correct.any(dim=1)
    return [float(((rank < k) & has).sum()) for k in ks]


def _recall(queries, candidates, query_keys, candidate_keys, ks, block_size) -> list[float]:
    hits = [0.0] * len(ks)
    n = queries.shape[0]
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        scores = queries[start:stop] @ candidates.t()  # [block, m]
        if query_keys is None:  # the own pair only
            correct = torch.zeros_like(scores, dtype=torch.bool)
            correct[torch.arange(stop - start), torch.arange(start, stop)] = True
        else:
            correct = query_keys[start:stop, None] == candidate_keys[None, :]
        for i, h in enumerate(_hits_at(scores, correct, ks)):
            hits[i] += h
    return [100.0 * h / n for h in hits]


def _key_ids(image_keys, text_keys) -> tuple[torch.Tensor, torch.Tensor]:
    vocabulary = {k: i for i, k in enumerate(sorted(set(image_keys) | set(text_keys)))}
    return (torch.tensor([vocabulary[k] for k in image_keys]),
            torch.tensor([vocabulary[k] for k in text_keys]))  # fmt: skip


def retrieval_recalls(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    *,
    image_keys: Sequence[str] | None = None,
    text_keys: Sequence[str] | None = None,
    ks: Sequence[int] = (1, 5, 10),
    block_size: int = 1024,
) -> dict[str, float]:
    """Zero-shot retrieval recalls in percent: ``ir@k`` (text query -> images) and ``tr@k``
    (image query -> texts), and ``mean_recall`` (their mean).

    ``image_emb [n, d]`` and ``text_emb [m, d]`` are L2-normalised. Without keys, row ``i`` of
    each is a pair (``n == m``) and only the own pair is correct. With keys (a COCO image id; a
    class name where captions describe the class only), an item is correct when its key equals
    the query's. ``k`` larger than the number of candidates counts every query with a correct
    item. Queries are scored ``block_size`` at a time (memory ``O(block_size * n)``).
    """
    if (image_keys is None) != (text_keys is None):
        raise MetricError("give keys for both images and texts, or for neither")
    if image_keys is None:
        if image_emb.shape[0] != text_emb.shape[0]:
            raise MetricError(
                f"{image_emb.shape[0]} images and {text_emb.shape[0]} texts are not pairs: "
                "give keys saying which texts belong to which images"
            )
        img_ids = txt_ids = None
    else:
        if len(image_keys) != image_emb.shape[0] or len(text_keys) != text_emb.shape[0]:
            raise MetricError("one key per image and one per text")
        img_ids, txt_ids = _key_ids(image_keys, text_keys)
    ks = list(ks)
    ir = _recall(text_emb, image_emb, txt_ids, img_ids, ks, block_size)
    tr = _recall(image_emb, text_emb, img_ids, txt_ids, ks, block_size)
    out = {f"ir@{k}": v for k, v in zip(ks, ir)}
    out.update({f"tr@{k}": v for k, v in zip(ks, tr)})
    out["mean_recall"] = sum(ir + tr) / (2 * len(ks))
    return out


def zero_shot_accuracy(image_emb: torch.Tensor, class_emb: torch.Tensor, labels: torch.Tensor,
                       ks: Sequence[int] = (1, 5)) -> dict[str, float]:  # fmt: skip
    """``image_emb [n, d]`` and ``class_emb [C, d]`` normalised, ``labels [n]`` class ids ->
    ``{"top1": %, "top5": %}`` (``k`` clamped to ``C``)."""
    scores = image_emb @ class_emb.t()  # [n, C]
    correct = torch.zeros_like(scores, dtype=torch.bool)
    correct[torch.arange(len(labels)), labels] = True
    hits = _hits_at(scores, correct, [min(k, class_emb.shape[0]) for k in ks])
    return {f"top{k}": 100.0 * h / len(labels) for k, h in zip(ks, hits)}


def class_embeddings(
    encode_texts: Callable[[list[str]], torch.Tensor],
    class_names: Sequence[str],
    templates: Sequence[str],
) -> torch.Tensor:
    """CLIP's prompt ensemble: per class, the normalised mean of its prompts' normalised
    embeddings ``encode_texts([template.format(name) ...]) -> [t, d]``; returns ``[C, d]``."""
    for template in templates:
        if "{}" not in template:
            raise MetricError(f"zero-shot template {template!r} has no '{{}}' for the class name")
    rows = []
    for name in class_names:
        prompts = torch.nn.functional.normalize(
            encode_texts([t.format(name) for t in templates]).float(), dim=-1
        )
        rows.append(torch.nn.functional.normalize(prompts.mean(dim=0), dim=0))
    return torch.stack(rows)


def auroc(scores, is_positive) -> float:
    """Area under the ROC curve of ``scores`` (higher = more likely positive), ties counted
    as 1/2: the Mann-Whitney U statistic over ``n_pos * n_neg``, from average ranks."""
    s = torch.as_tensor(scores, dtype=torch.float64).flatten()
    pos = torch.as_tensor(is_positive, dtype=torch.bool).flatten()
    if s.shape != pos.shape:
        raise MetricError(f"{s.numel()} scores but {pos.numel()} labels")
    if torch.isnan(s).any():
        raise MetricError("the scores contain NaN")
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        raise MetricError(f"AUROC needs both classes (got {n_pos} positive, {n_neg} negative)")
    values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based ranks, ties averaged
    rank_sum = average_rank[inverse][pos].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def tau_statistics(tau: torch.Tensor, prefix: str = "tau") -> dict[str, float]:
    """Mean, population std, min, max and the 10/50/90% quantiles of ``tau [n]``."""
    t = torch.as_tensor(tau, dtype=torch.float64).flatten()
    if t.numel() == 0:
        raise MetricError("no temperatures to summarise")
    q = torch.quantile(t, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return {
        f"{prefix}_mean": float(t.mean()), f"{prefix}_std": float(t.std(correction=0)),
        f"{prefix}_min": float(t.min()), f"{prefix}_max": float(t.max()),
        f"{prefix}_p10": float(q[0]), f"{prefix}_p50": float(q[1]), f"{prefix}_p90": float(q[2]),
    }  # fmt: skip
