"""Calibration of temperature-scaled probabilities on vocabulary-parallel logits.

For a token with logits ``L`` (true vocabulary only), temperature ``tau`` and ``p =
softmax(L / tau)``, with ``M`` the row maximum and ``z = (L - M) / tau``:

    top    = max_k p_k    = 1 / sum_k exp(z_k)                 (the top-1 confidence)
    square = sum_k p_k^2  = sum_k exp(2 z_k) / (sum_k exp(z_k))^2

The Brier score of a token with target ``y`` is ``square - 2 p_y + 1`` (``p_y = exp(-CE)`` of
the same tau). Two collectives over the TP group: a MAX of the row maxima, one SUM of ``[T, 2]``.
``expected_calibration_error`` bins the top-1 confidences as is usual (equal-width bins).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tempnet.distributed.groups import resolve_tp_group, vocab_partition


@torch.no_grad()
def calibration_terms(
    vocab_parallel_logits: torch.Tensor,
    tau: torch.Tensor | float,
    *,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top, square)`` per token, each of the logits' leading shape (``[b, s]`` for logits
    ``[b, s, V_pad/tp]``, this rank's vocabulary slice; padded columns excluded); ``tau`` a
    number or a tensor of that leading shape. Float32 (float64 logits: float64)."""
    tp = resolve_tp_group(tp_group)
    dtype = torch.float64 if vocab_parallel_logits.dtype == torch.float64 else torch.float32
    n_cols = vocab_parallel_logits.shape[-1]
    shape = vocab_parallel_logits.shape[:-1]
    x = vocab_parallel_logits.reshape(-1, n_cols).to(dtype)
    part = vocab_partition(n_cols, tp.rank, vocab_size)
    x = x[:, : part.n_true]  # [T, V_true on this rank]
    if isinstance(tau, torch.Tensor):
        tau = tau.to(dtype).expand(shape).reshape(-1, 1)
    if part.n_true:
        row_max = torch.amax(x, dim=1)
    else:
        row_max = torch.full((x.shape[0],), -math.inf, dtype=dtype, device=x.device)
    tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
    e = torch.exp((x - row_max[:, None]) / tau)  # [T, V_true on this rank], <= 1
    sums = torch.stack([e.sum(1), (e * e).sum(1)], dim=1)  # [T, 2]: the one SUM all-reduce
    tp.all_reduce(sums)
    top = 1.0 / sums[:, 0]
    return top.view(shape), (sums[:, 1] * top * top).view(shape)


def expected_calibration_error(
    confidence: list[float], correct: list[bool], bins: int = 15
) -> tuple[float, list[dict]]:
    """ECE over ``bins`` equal-width bins of the top-1 confidence (``(k/bins, (k+1)/bins]``,
    0 in the first): ``sum_b n_b / n |accuracy_b - confidence_b|``; and each non-empty bin's
    ``{"low", "high", "count", "confidence", "accuracy"}`` (a reliability diagram's points)."""
    n = len(confidence)
    groups: dict[int, list[tuple[float, bool]]] = {}
    for p, ok in zip(confidence, correct):
        k = min(bins - 1, max(0, math.ceil(p * bins) - 1))
        groups.setdefault(k, []).append((p, ok))
    ece, table = 0.0, []
    for k in sorted(groups):
        members = groups[k]
        conf = sum(p for p, _ in members) / len(members)
        acc = sum(ok for _, ok in members) / len(members)
        ece += len(members) / n * abs(acc - conf)
        table.append(dict(low=k / bins, high=(k + 1) / bins, count=len(members),
                          confidence=conf, accuracy=acc))  # fmt: skip
    return ece, table
