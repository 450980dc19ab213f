"""Zero-shot metrics for CLIP models on embeddings: retrieval, classification, AUROC, tau.

Pure tensor math on local tensors (no model, no process group); ``evaluation`` gathers the
embeddings and feeds them here. Every ranking metric uses one deterministic order: candidates
sorted by descending score, equal scores by ascending index (a stable sort), so a metric never
depends on how a kernel breaks ties.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch


class MetricError(ValueError):
    """Inputs a metric cannot be computed on; the message names the input and the fix."""


def _check_ks(ks: Sequence[int]) -> list[int]:
    """``ks`` as a list of positive ints, or MetricError."""
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise MetricError(f"ks={ks!r} must be a non-empty list of positive ints, e.g. (1, 5, 10)")
    return ks


def _check_embeddings(name: str, emb: torch.Tensor) -> None:
    """``emb`` must be a non-empty ``[n, d]`` floating tensor of finite values."""
    if emb.dim() != 2 or emb.shape[0] == 0:
        raise MetricError(f"{name} must be [n, d] with n > 0, got shape {tuple(emb.shape)}")
    if not emb.is_floating_point():
        raise MetricError(f"{name} must be float32/float64 (L2-normalised), got {emb.dtype}")
    if not torch.isfinite(emb).all():
        raise MetricError(f"{name} contains NaN or inf: check the encoder's outputs")


def _as_common_dtype(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tensors in the wider of their dtypes (float32 @ float64 does not multiply)."""
    if a.shape[1] != b.shape[1]:
        raise MetricError(f"embedding widths differ: {a.shape[1]} vs {b.shape[1]}")
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def _first_correct_rank(scores: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """0-based rank ``[q]`` (int64) of each row's best-ranked correct candidate.

    ``scores [q, m]`` float, ``correct [q, m]`` bool. The rank counts the candidates that come
    first in the stable descending order: scored strictly higher, or equal and lower-indexed.
    A row with no correct candidate gets ``m``, past every clamped ``k``.
    """
    masked = scores.masked_fill(~correct, float("-inf"))
    first = masked.argmax(dim=1, keepdim=True)  # [q, 1]: on ties argmax returns the lowest index
    best = scores.gather(1, first)  # [q, 1]
    idx = torch.arange(scores.shape[1], device=scores.device)[None]  # [1, m]
    ahead = (scores > best) | ((scores == best) & (idx < first))  # [q, m]
    rank = ahead.sum(dim=1)
    return torch.where(correct.any(dim=1), rank, torch.full_like(rank, scores.shape[1]))


def _recall_percent(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    correct_block: Callable[[int, int], torch.Tensor],
    ks: list[int],
    block_size: int,
) -> list[float]:
    """Per ``k``, the percent of queries with a correct candidate among their top ``k``.

    ``queries [n, d]``, ``candidates [m, d]``; ``correct_block(start, stop)`` is the bool mask
    ``[stop - start, m]`` of the correct candidates of queries ``start:stop``. Scores are made
    ``block_size`` queries at a time, so memory is ``O(block_size * m)``; ``k`` is clamped to
    ``m``.
    """
    n, m = queries.shape[0], candidates.shape[0]
    hits = torch.zeros(len(ks), dtype=torch.int64)
    clamped = torch.tensor([min(k, m) for k in ks])[:, None]  # [len(ks), 1]
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        scores = queries[start:stop] @ candidates.t()  # [block, m]
        rank = _first_correct_rank(scores, correct_block(start, stop)).cpu()  # [block]
        hits += (rank[None] < clamped).sum(dim=1)
    return [100.0 * int(h) / n for h in hits]


def _key_ids(
    image_keys: Sequence[Hashable], text_keys: Sequence[Hashable]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys as int64 ids shared by both sides (any hashable key: a str, an int image id)."""
    vocabulary: dict[Hashable, int] = {}
    for key in [*image_keys, *text_keys]:
        vocabulary.setdefault(key, len(vocabulary))
    return (
        torch.tensor([vocabulary[k] for k in image_keys], dtype=torch.int64),
        torch.tensor([vocabulary[k] for k in text_keys], dtype=torch.int64),
    )


def _pair_mask(device: torch.device, m: int) -> Callable[[int, int], torch.Tensor]:
    """``correct_block`` for pairs: query ``i`` is correct on candidate ``i`` only."""

    def correct(start: int, stop: int) -> torch.Tensor:
        rows = torch.arange(start, stop, device=device)[:, None]
        return rows == torch.arange(m, device=device)[None]

    return correct


def _key_mask(
    query_ids: torch.Tensor, cand_ids: torch.Tensor
) -> Callable[[int, int], torch.Tensor]:
    """``correct_block`` for keys: a candidate is correct when its key is the query's."""
    return lambda start, stop: query_ids[start:stop, None] == cand_ids[None, :]


def retrieval_recalls(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    *,
    image_keys: Sequence[Hashable] | None = None,
    text_keys: Sequence[Hashable] | None = None,
    ks: Sequence[int] = (1, 5, 10),
    block_size: int = 1024,
) -> dict[str, float]:
    """Zero-shot image-text retrieval recalls, in percent.

    ``image_emb [n, d]`` and ``text_emb [m, d]``: L2-normalised float32/float64 (cosine
    similarity is their dot product). ``ir@k``: a text queries the images; ``tr@k``: an image
    queries the texts; a query is a hit at ``k`` when a correct item is among its first ``k``
    candidates in the stable descending order (equal scores: lower index first).

    Without keys, row ``i`` of each is a pair (``n == m``) and only the own pair is correct.
    With keys (a COCO image id; a class name where captions describe only the class), an item
    is correct when its key equals the query's, so a text of key ``c`` is right on any image of
    key ``c``; a query whose key no candidate carries counts as a miss. ``k`` larger than the
    number of candidates is clamped to it (the name stays ``@k``). Queries are scored
    ``block_size`` at a time: memory ``O(block_size * max(n, m))``, never ``[n, m]`` at once.

    Returns ``{"ir@1", "ir@5", "ir@10", "tr@1", "tr@5", "tr@10", "mean_recall"}`` (one
    ``ir@k``/``tr@k`` per entry of ``ks``; ``mean_recall`` is the mean of all of them).
    """
    _check_embeddings("image_emb", image_emb)
    _check_embeddings("text_emb", text_emb)
    image_emb, text_emb = _as_common_dtype(image_emb, text_emb)
    ks = _check_ks(ks)
    if block_size < 1:
        raise MetricError(f"block_size ({block_size}) must be >= 1")
    n, m = image_emb.shape[0], text_emb.shape[0]
    if (image_keys is None) != (text_keys is None):
        raise MetricError("give both image_keys and text_keys, or neither")
    if image_keys is None:
        if n != m:
            raise MetricError(
                f"{n} images and {m} texts are not pairs: pass image_keys/text_keys saying "
                "which texts belong to which images"
            )
        text_correct = image_correct = _pair_mask(image_emb.device, n)
    else:
        if len(image_keys) != n or len(text_keys) != m:
            raise MetricError(
                f"need one key per image and per text: {len(image_keys)} image_keys for {n} "
                f"images, {len(text_keys)} text_keys for {m} texts"
            )
        img_ids, txt_ids = (ids.to(image_emb.device) for ids in _key_ids(image_keys, text_keys))
        text_correct, image_correct = _key_mask(txt_ids, img_ids), _key_mask(img_ids, txt_ids)
    ir = _recall_percent(text_emb, image_emb, text_correct, ks, block_size)
    tr = _recall_percent(image_emb, text_emb, image_correct, ks, block_size)
    out = {f"ir@{k}": v for k, v in zip(ks, ir)}
    out.update({f"tr@{k}": v for k, v in zip(ks, tr)})
    out["mean_recall"] = sum(ir + tr) / (2 * len(ks))
    return out


def zero_shot_accuracy(
    image_emb: torch.Tensor,
    class_emb: torch.Tensor,
    labels: torch.Tensor,
    ks: Sequence[int] = (1, 5),
    *,
    block_size: int = 1024,
) -> dict[str, float]:
    """Zero-shot classification accuracy in percent: ``{"top1": ..., "top5": ...}``.

    ``image_emb [n, d]`` and ``class_emb [C, d]`` (one row per class, see
    ``class_embeddings``) L2-normalised floats; ``labels [n]`` int64 class ids in ``[0, C)``.
    An image is right at ``k`` when its class is among the ``k`` best-scoring classes (stable
    order, lower class id first on ties); ``k`` is clamped to ``C``.
    """
    _check_embeddings("image_emb", image_emb)
    _check_embeddings("class_emb", class_emb)
    image_emb, class_emb = _as_common_dtype(image_emb, class_emb)
    ks = _check_ks(ks)
    n, num_classes = image_emb.shape[0], class_emb.shape[0]
    labels = torch.as_tensor(labels, device=image_emb.device)
    if labels.shape != (n,) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise MetricError(
            f"labels must be [n={n}] integer class ids, got shape {tuple(labels.shape)} "
            f"dtype {labels.dtype}"
        )
    if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
        raise MetricError(
            f"labels must lie in [0, {num_classes}) (one class_emb row per class), got "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    classes = torch.arange(num_classes, device=image_emb.device)[None]  # [1, C]
    hits = _recall_percent(image_emb, class_emb, _key_mask(labels, classes[0]), ks, block_size)
    return {f"top{k}": v for k, v in zip(ks, hits)}


def _check_template(template: str) -> None:
    """``template`` must format one class name through a ``{}``."""
    sentinel = "\x00class\x00"
    try:
        ok = sentinel in template.format(sentinel)
    except (IndexError, KeyError, ValueError):
        ok = False
    if not ok:
        raise MetricError(
            f"zero-shot template {template!r} must contain one '{{}}' for the class name "
            "(and no other braces), e.g. 'a photo of a {}.'"
        )


def class_embeddings(
    encode_texts: Callable[[list[str]], torch.Tensor],
    class_names: Sequence[str],
    templates: Sequence[str],
) -> torch.Tensor:
    """CLIP's prompt ensemble: one L2-normalised embedding per class, ``[C, d]``.

    For each class, ``encode_texts([template.format(name) for template in templates])`` gives
    ``[t, d]`` normalised float embeddings; their mean, re-normalised, is the class's row. The
    prompts are normalised again first (a no-op for a normalised encoder). The dtype is the
    encoder's.
    """
    if not class_names or not templates:
        raise MetricError(
            f"need at least one class name and one template, got {len(class_names)} and "
            f"{len(templates)}"
        )
    for template in templates:
        _check_template(template)
    rows = []
    for name in class_names:
        prompts = encode_texts([template.format(name) for template in templates])
        if prompts.dim() != 2 or prompts.shape[0] != len(templates):
            raise MetricError(
                f"encode_texts must return [{len(templates)}, d] for {len(templates)} prompts, "
                f"got shape {tuple(prompts.shape)}"
            )
        if not prompts.is_floating_point():
            raise MetricError(f"encode_texts must return float embeddings, got {prompts.dtype}")
        prompts = torch.nn.functional.normalize(prompts, dim=-1)  # [t, d]
        rows.append(torch.nn.functional.normalize(prompts.mean(dim=0), dim=0))
    return torch.stack(rows)  # [C, d]


def _vector(name: str, values: torch.Tensor | Sequence) -> torch.Tensor:
    """``values`` as a 1-D CPU tensor of its own dtype (``[n]`` or ``[n, 1]`` accepted)."""
    t = torch.as_tensor(values).detach().cpu()
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 1:
        raise MetricError(f"{name} must be 1-D [n], got shape {tuple(t.shape)}")
    return t


def auroc(
    scores: torch.Tensor | Sequence[float], is_positive: torch.Tensor | Sequence[bool]
) -> float:
    """Area under the ROC curve of ``scores [n]`` (higher = more likely positive).

    ``is_positive [n]`` bool (or 0/1), e.g. positive = out-of-distribution and score = the
    predicted temperature as an uncertainty. Exact, ties counted as 1/2: the Mann-Whitney
    ``U / (n_pos * n_neg)``, with ``U`` from the positives' average ranks (float64, one sort,
    ``O(n log n)``).
    """
    s = _vector("scores", scores).to(torch.float64)
    pos = _vector("is_positive", is_positive)
    if pos.dtype != torch.bool:
        if not ((pos == 0) | (pos == 1)).all():
            raise MetricError(f"is_positive must be bool or 0/1 labels, got dtype {pos.dtype}")
        pos = pos == 1
    if s.shape != pos.shape:
        raise MetricError(f"{s.numel()} scores but {pos.numel()} is_positive labels")
    if torch.isnan(s).any():
        raise MetricError("scores contain NaN: check the model's outputs")
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        raise MetricError(
            f"AUROC needs both classes, got {n_pos} positive and {n_neg} negative: give "
            "in- and out-of-distribution samples"
        )
    _, inverse, counts = torch.unique(s, sorted=True, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)  # 1-based rank of each value's last copy
    average_rank = ends - (counts.to(torch.float64) - 1) / 2  # ties share their mean rank
    u = average_rank[inverse][pos].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def _quantiles(sorted_t: torch.Tensor, ps: Sequence[float]) -> list[float]:
    """Linear-interpolation quantiles (numpy's default) of an ascending 1-D tensor."""
    out = []
    for p in ps:
        pos = p * (sorted_t.numel() - 1)
        lo = int(pos)
        hi = min(lo + 1, sorted_t.numel() - 1)
        out.append(float(sorted_t[lo] + (pos - lo) * (sorted_t[hi] - sorted_t[lo])))
    return out


def tau_statistics(tau: torch.Tensor, prefix: str = "tau") -> dict[str, float]:
    """Summary of per-sample temperatures ``tau [n]`` (any float dtype; computed in float64).

    Returns ``{prefix}_mean``, ``_std`` (population, ``correction=0``), ``_min``, ``_max`` and
    the linear-interpolation quantiles ``_p10``, ``_p50``, ``_p90``. NaN in ``tau`` makes every
    statistic NaN.
    """
    t = _vector("tau", tau).to(torch.float64)
    if t.numel() == 0:
        raise MetricError("tau is empty: no temperatures to summarise")
    names = ["mean", "std", "min", "max", "p10", "p50", "p90"]
    if torch.isnan(t).any():
        return {f"{prefix}_{name}": float("nan") for name in names}
    ordered = torch.sort(t).values
    values = [float(t.mean()), float(t.std(correction=0)), float(ordered[0]), float(ordered[-1])]
    values += _quantiles(ordered, (0.1, 0.5, 0.9))
    return {f"{prefix}_{name}": v for name, v in zip(names, values)}
