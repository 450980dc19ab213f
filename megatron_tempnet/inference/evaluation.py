"""Perplexity and T-LLM perplexity of token streams, on vocabulary-parallel logits.

For every predicted token (target ``y`` after a context):

    CE       = -log softmax(L)_y                       (cross-entropy perplexity: exp(mean CE))
    T-LLM CE = -log softmax(L / tau)_y                  (the paper's T-LLM perplexity)

with tau from TempNet, a fixed value, or each token's minimiser of the DRO loss over tau
(``losses.tau_source``; ``NewtonTau``: the paper's Baseline 2, what TempNet approximates; with
a TempNet loaded its tau is recorded beside it). All come from the fused output stage
(``losses.output_stage``: the final hidden states and the output weight, chunk by chunk, never the
whole ``[tokens, V_pad/tp]`` logits), or with ``fused_output_stage=False`` from
``temperature_scaled_cross_entropy`` on each TP rank's whole ``[b, s, V_pad/tp]`` slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_tempnet.distributed.groups import (
    parallel_argmax,
    resolve_tp_group,
    vocab_partition,
)
from megatron_tempnet.inference.model import InferenceError, InferenceModel
from megatron_tempnet.losses import fused_output_stage, temperature_scaled_cross_entropy
from megatron_tempnet.losses.calibration import calibration_terms, expected_calibration_error
from megatron_tempnet.losses.tau_source import FixedTau, NewtonTau, TauSource, TempNetTau
from megatron_tempnet.tempnet.layers import upper_bound_for_mean


@dataclass
class TokenScores:
    """Per predicted token (``targets[i]`` after ``tokens[: i + 1]``), float64 lists."""

    targets: list[int] = field(default_factory=list)
    ce: list[float] = field(default_factory=list)
    tllm_ce: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    """The target is the model's most likely token."""
    tempnet_tau: list[float] = field(default_factory=list)
    """TempNet's tau when another source scores (``NewtonTau`` with a TempNet loaded)."""
    tempnet_tllm_ce: list[float] = field(default_factory=list)
    """The T-LLM CE with TempNet's tau, beside ``tempnet_tau``."""
    grid_tllm_ce: list[list[float]] = field(default_factory=list)
    """Per token, the T-LLM CE at each temperature of the ``grid`` asked for."""
    top_prob: list[float] = field(default_factory=list)
    """With ``calibration``: the top-1 probability at the scored tau (``losses.calibration``)."""
    sum_p2: list[float] = field(default_factory=list)
    """With ``calibration``: ``sum_k p_k^2`` at the scored tau."""
    top_prob_1: list[float] = field(default_factory=list)
    sum_p2_1: list[float] = field(default_factory=list)
    """The same at tau = 1."""
    tempnet_top_prob: list[float] = field(default_factory=list)
    tempnet_sum_p2: list[float] = field(default_factory=list)
    """The same at TempNet's tau, beside another source."""
    grid_top_prob: list[list[float]] = field(default_factory=list)
    grid_sum_p2: list[list[float]] = field(default_factory=list)
    """The same at each ``grid`` temperature."""


_FIELDS = tuple(f for f in TokenScores.__dataclass_fields__)


def windows(tokens: list[int], window: int) -> list[list[int]]:
    """``tokens`` cut into sequences of ``window`` predictions (``window + 1`` tokens; the last
    may be shorter); they do not overlap: a window's first token is predicted from it alone."""
    return [tokens[start : start + window + 1] for start in range(0, len(tokens) - 1, window)]


def merge(parts: list[TokenScores]) -> TokenScores:
    """One ``TokenScores`` of consecutive parts (a document's windows)."""
    merged = TokenScores()
    for part in parts:
        for name in _FIELDS:
            getattr(merged, name).extend(getattr(part, name))
    return merged


@torch.no_grad()
def score_sequences(
    model: InferenceModel,
    sequences: list[list[int]],
    *,
    tau: TauSource | None = None,
    grid: tuple[float, ...] = (),
    fused_output_stage: bool = True,
    chunk_size: int | None = None,
    micro_batch_size: int = 8,
    first: list[int] | None = None,
    on_tokens: Callable[[int], None] | None = None,
    calibration: bool = False,
) -> list[TokenScores]:
    """Scores of every sequence's tokens from index ``first[i]`` on (default 1: all but the
    first), each predicted from the tokens before it in its sequence; ``on_tokens(n)``: ``n``
    more tokens are scored (progress).

    ``tau``: where tau comes from (``losses.tau_source``; None: the loaded TempNet); with
    ``NewtonTau`` (each token's DRO optimum) TempNet's tau and T-LLM CE are recorded beside it
    when a TempNet is loaded. ``grid``: the T-LLM CE at
    each of these fixed temperatures too, from the same forward pass. ``calibration``: the
    top-1 probability and ``sum_k p_k^2`` at every tau scored, and at tau = 1 (from the whole
    logits: the unfused path, whatever ``fused_output_stage`` says).

    Sequences are scored ``micro_batch_size`` at a time, longest first, right-padded: causal
    attention keeps the padding out of every real position. With the fused output stage only
    the scored positions go through the output layer.
    """
    if micro_batch_size < 1:
        raise InferenceError(f"--micro-batch-size ({micro_batch_size}) must be >= 1")
    first = [1] * len(sequences) if first is None else first
    for i, (sequence, start) in enumerate(zip(sequences, first)):
        if not 1 <= start <= len(sequence):
            raise InferenceError(f"sequence {i}: nothing to score from token {start} of "
                                 f"{len(sequence)}")  # fmt: skip
    sources = _tau_sources(model, tau)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    results: list[TokenScores | None] = [None] * len(sequences)
    device = next(model.lm.parameters()).device
    for begin in range(0, len(order), micro_batch_size):
        batch = order[begin : begin + micro_batch_size]
        width = max(len(sequences[i]) for i in batch)
        padded = torch.zeros(len(batch), width, dtype=torch.long)
        scored = torch.zeros(len(batch), width - 1, dtype=torch.bool)  # [b, s]: targets kept
        for row, i in enumerate(batch):
            padded[row, : len(sequences[i])] = torch.tensor(sequences[i])
            scored[row, first[i] - 1 : len(sequences[i]) - 1] = True
        padded, scored = padded.to(device), scored.to(device)
        inputs, targets = padded[:, :-1], padded[:, 1:]
        if calibration or not fused_output_stage:
            values = _unfused_scores(model, inputs, targets, scored, sources, grid, calibration)
        else:
            values = _fused_scores(model, inputs, targets, scored, sources, grid, chunk_size)
        values["greedy"] = values["greedy"] == targets[scored]
        values["targets"] = targets[scored]
        columns = {k: v.double().tolist() if v.is_floating_point() else v.tolist()
                   for k, v in values.items()}  # fmt: skip
        counts = scored.sum(1).tolist()
        offset = 0
        for row, i in enumerate(batch):
            part = slice(offset, offset + counts[row])
            results[i] = TokenScores(**{k: v[part] for k, v in columns.items()})
            offset += counts[row]
        if on_tokens is not None:
            on_tokens(sum(counts))
    return results


def fit_tau_max_eval(
    model: InferenceModel,
    sequences: list[list[int]],
    target: float,
    *,
    every_position: bool,
    micro_batch_size: int = 8,
    chunk_size: int | None = None,
) -> dict:
    """The paper's inference-time scaling (its Table 1): sets ``model.tempnet.tau_max_eval`` so
    that TempNet's mean tau over the sample ``sequences`` is ``target``
    (``tempnet.layers.upper_bound_for_mean``), the tau of every token that ``score_sequences``
    scores (all but each sequence's last), or with ``every_position`` of every token.

    Returns ``tau_target_mean``, ``tokens`` (the sample's), ``tau_mean_trained`` (the mean at
    the trained upper bound) and the ``tau_max_eval`` set."""
    tempnet = model.tempnet
    if tempnet is None:
        raise InferenceError("--tau-target-mean: no TempNet loaded (it scales TempNet's tau)")
    tempnet.tau_max_eval = None
    if every_position:  # a placeholder target after the last token: its tau is scored too
        sequences = [list(s) + [0] for s in sequences]
    parts = score_sequences(
        model, sequences, micro_batch_size=micro_batch_size, chunk_size=chunk_size
    )
    taus = torch.tensor([t for part in parts for t in part.tau], dtype=torch.float64)
    try:
        upper = upper_bound_for_mean(taus, tempnet.tau_min, tempnet.tau_max, target)
    except ValueError as e:
        raise InferenceError(f"--tau-target-mean {target:g}: {e}") from None
    tempnet.tau_max_eval = upper
    return {
        "tau_target_mean": target,
        "tokens": taus.numel(),
        "tau_mean_trained": float(taus.mean()),
        "tau_max_eval": upper,
    }


def _tau_sources(model: InferenceModel, tau: TauSource | None) -> tuple:
    """The source scored and the one recorded beside it (TempNet's beside Newton's, or None)."""
    tempnet = None if model.tempnet is None else TempNetTau(model.tempnet)
    if tau is None:
        if tempnet is None:
            raise InferenceError("no TempNet loaded: give a fixed tau or the per-token optimum")
        return tempnet, None
    return tau, tempnet if isinstance(tau, NewtonTau) else None


def _fused_scores(model: InferenceModel, inputs, targets, scored, sources, grid, chunk_size):
    """The ``scored`` targets' values (``[n]`` each, sequence-major; ``grid_tllm_ce`` ``[n,
    len(grid)]``) from the fused output stage: the LM's final hidden states once, the output
    layer once per temperature source."""
    final = model.final_hidden(inputs)  # [s, b, h]
    hidden = final.hidden.transpose(0, 1)[scored]  # [n, h]
    rows = targets[scored]
    source, beside = sources

    def stage(tau: TauSource):
        return fused_output_stage(hidden, final.weight, rows, loss="ce", eval_terms=True,
                                  vocab_size=model.vocab_size, tp_group=model.tp_group,
                                  chunk_size=chunk_size, tau=tau)  # fmt: skip

    out = stage(source)
    values = {"ce": out.ce, "tllm_ce": out.ts_ce, "tau": out.tau, "greedy": out.argmax}
    if beside is not None:
        other = stage(beside)
        values.update(tempnet_tau=other.tau, tempnet_tllm_ce=other.ts_ce)
    if grid:
        values["grid_tllm_ce"] = torch.stack([stage(FixedTau(t)).ts_ce for t in grid], dim=1)
    return values


def _unfused_scores(
    model: InferenceModel, inputs, targets, scored, sources, grid, calibration: bool
):
    """As ``_fused_scores``, from each window's whole logits; with ``calibration`` the
    calibration terms at each tau too."""
    tp = resolve_tp_group(model.tp_group)
    padded = model.model.padded_vocab_size(tp.size)
    part = vocab_partition(padded // tp.size, tp.rank, model.vocab_size)
    logits = model.logits(inputs)[scored]  # [n, V_pad/tp]
    rows = targets[scored]
    common = {"vocab_size": model.vocab_size, "tp_group": model.tp_group}
    source, beside = sources

    def tllm(tau):
        return temperature_scaled_cross_entropy(logits, rows, tau, **common)

    values = {}
    tau = source.tau_of(logits, **common)
    if beside is not None:
        values["tempnet_tau"] = beside.tau_of(logits, **common)
        values["tempnet_tllm_ce"] = tllm(values["tempnet_tau"])
    values.update(ce=tllm(1.0), tllm_ce=tllm(tau), tau=tau)
    values["greedy"] = parallel_argmax(logits[:, : part.n_true], part.start, tp)  # [n]
    if grid:
        values["grid_tllm_ce"] = torch.stack([tllm(float(t)) for t in grid], dim=1)
    if calibration:
        values.update(_calibration(logits, tau, values.get("tempnet_tau"), grid, common))
    return values


def _calibration(logits, tau, tempnet_tau, grid, common: dict) -> dict:
    """The top-1 probability and ``sum_k p_k^2`` at tau, at 1, at TempNet's tau beside
    another source, and at each ``grid`` temperature (``[n]``, grid ``[n, len(grid)]``)."""
    out = {}
    for suffix, at in (("", tau), ("_1", 1.0)):
        out[f"top_prob{suffix}"], out[f"sum_p2{suffix}"] = calibration_terms(logits, at, **common)
    if tempnet_tau is not None:
        out["tempnet_top_prob"], out["tempnet_sum_p2"] = calibration_terms(
            logits, tempnet_tau, **common
        )
    if grid:
        pairs = [calibration_terms(logits, float(t), **common) for t in grid]
        out["grid_top_prob"] = torch.stack([top for top, _ in pairs], dim=1)
        out["grid_sum_p2"] = torch.stack([sq for _, sq in pairs], dim=1)
    return out


def summarise(all_scores: list[TokenScores], grid: tuple[float, ...] = ()) -> dict:
    """Token-weighted means over documents: losses, perplexities, tau statistics (the std over
    every token); TempNet's beside another source; the T-LLM perplexity at each ``grid``
    temperature and the best of them."""

    ce = [x for s in all_scores for x in s.ce]
    tllm = [x for s in all_scores for x in s.tllm_ce]
    tau = [x for s in all_scores for x in s.tau]
    n = len(ce)
    if n == 0:
        raise InferenceError("nothing to evaluate: every document is shorter than 2 tokens")
    mean_ce, mean_tllm = sum(ce) / n, sum(tllm) / n
    tau_mean = sum(tau) / n
    summary = {
        "tokens": n,
        "ce_loss": mean_ce,
        "ppl": math.exp(mean_ce),
        "tllm_loss": mean_tllm,
        "tllm_ppl": math.exp(mean_tllm),
        "tau_mean": tau_mean,
        "tau_std": math.sqrt(sum((t - tau_mean) ** 2 for t in tau) / n),
        "tau_min": min(tau),
        "tau_max": max(tau),
    }
    second = [x for s in all_scores for x in s.tempnet_tau]
    if second:  # TempNet's tau beside the one scored: how well it follows it
        summary.update(_tempnet_beside(tau, second))
        tempnet_tllm = sum(x for s in all_scores for x in s.tempnet_tllm_ce) / n
        summary["tempnet_tllm_ppl"] = math.exp(tempnet_tllm)
    if grid:
        rows = [r for s in all_scores for r in s.grid_tllm_ce]
        ppl = {t: math.exp(sum(r[j] for r in rows) / n) for j, t in enumerate(grid)}
        best = min(ppl, key=ppl.get)
        summary.update(tau_grid={f"{t:g}": v for t, v in ppl.items()}, best_fixed_tau=best,
                       best_fixed_tllm_ppl=ppl[best])  # fmt: skip
    if any(s.top_prob for s in all_scores):
        summary["calibration"] = _calibration_summary(all_scores, grid, summary)
    return summary


def _calibration_summary(all_scores: list[TokenScores], grid, summary: dict) -> dict:
    """ECE (15 bins), Brier score and NLL of the top-1 prediction per tau source: ``tau_1``,
    ``scored`` (the source evaluated), ``tempnet`` beside it, ``best_fixed`` (the grid's best),
    each with its reliability bins."""

    def column(name: str, j: int | None = None) -> list[float]:
        rows = (x for s in all_scores for x in getattr(s, name))
        return list(rows) if j is None else [r[j] for r in rows]

    correct = column("greedy")
    sources = {
        "tau_1": (column("top_prob_1"), column("sum_p2_1"), column("ce")),
        "scored": (column("top_prob"), column("sum_p2"), column("tllm_ce")),
    }
    if any(s.tempnet_top_prob for s in all_scores):
        sources["tempnet"] = (column("tempnet_top_prob"), column("tempnet_sum_p2"),
                              column("tempnet_tllm_ce"))  # fmt: skip
    if grid:
        j = list(grid).index(summary["best_fixed_tau"])
        sources["best_fixed"] = (column("grid_top_prob", j), column("grid_sum_p2", j),
                                 column("grid_tllm_ce", j))  # fmt: skip
    return {name: calibration_metrics(*values, correct) for name, values in sources.items()}


def calibration_metrics(
    top: list[float], square: list[float], nll: list[float], correct: list[bool]
) -> dict:
    """ECE of the top-1 confidences ``top`` against ``correct`` (15 bins), the Brier score
    ``mean(square - 2 p_y + 1)`` with ``p_y = exp(-nll)``, the mean NLL, and the bins."""
    n = len(top)
    ece, bins = expected_calibration_error(top, correct)
    brier = sum(sq - 2.0 * math.exp(-x) + 1.0 for sq, x in zip(square, nll)) / n
    return {"ece": ece, "brier": brier, "nll": sum(nll) / n, "bins": bins}


def _tempnet_beside(tau: list[float], tempnet_tau: list[float]) -> dict:
    """TempNet's tau statistics and its Pearson correlation with the scored tau."""

    n = len(tau)
    mean_a, mean_b = sum(tau) / n, sum(tempnet_tau) / n
    var_a = sum((a - mean_a) ** 2 for a in tau) / n
    var_b = sum((b - mean_b) ** 2 for b in tempnet_tau) / n
    cov = sum((a - mean_a) * (b - mean_b) for a, b in zip(tau, tempnet_tau)) / n
    spread = math.sqrt(var_a * var_b)
    return {
        "tempnet_tau_mean": mean_b,
        "tempnet_tau_std": math.sqrt(var_b),
        "tau_correlation": cov / spread if spread > 0 else None,
    }
