"""Perplexity and T-LLM perplexity of token streams, on vocabulary-parallel logits.

For every predicted token (target ``y`` after a context):

    CE       = -log softmax(L)_y                       (cross-entropy perplexity: exp(mean CE))
    T-LLM CE = -log softmax(L / tau)_y                  (the paper's T-LLM perplexity)

with tau from TempNet (or a fixed value). Both come from the fused output stage
(``losses.output_stage``: the final hidden states and the output weight, chunk by chunk, never the
whole ``[tokens, V_pad/tp]`` logits), or with ``fused_output_stage=False`` from
``temperature_scaled_cross_entropy`` on each TP rank's whole ``[b, s, V_pad/tp]`` slice.
"""

from __future__ import annotations

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


@dataclass
class TokenScores:
    """Per predicted token (``targets[i]`` after ``tokens[: i + 1]``), float64 lists."""

    targets: list[int] = field(default_factory=list)
    ce: list[float] = field(default_factory=list)
    tllm_ce: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    """The target is the model's most likely token."""


def windows(tokens: list[int], window: int) -> list[list[int]]:
    """``tokens`` cut into sequences of ``window`` predictions (``window + 1`` tokens; the last
    may be shorter); they do not overlap: a window's first token is predicted from it alone."""
    return [tokens[start : start + window + 1] for start in range(0, len(tokens) - 1, window)]


def merge(parts: list[TokenScores]) -> TokenScores:
    """One ``TokenScores`` of consecutive parts (a document's windows)."""
    merged = TokenScores()
    for part in parts:
        for name in ("targets", "ce", "tllm_ce", "tau", "greedy"):
            getattr(merged, name).extend(getattr(part, name))
    return merged


@torch.no_grad()
def score_tokens(
    model: InferenceModel,
    tokens: list[int],
    *,
    window: int,
    fixed_tau: float | None = None,
    fused_output_stage: bool = True,
    chunk_size: int | None = None,
    micro_batch_size: int = 8,
) -> TokenScores:
    """CE and T-LLM CE of every token after the first, in windows of ``window`` predictions
    (``windows``), ``micro_batch_size`` windows per forward pass.

    With ``fused_output_stage`` (default) the values come from the final hidden states chunk by
    chunk (``losses.output_stage``, ``chunk_size`` tokens at a time); otherwise from the whole
    logits of a window.
    """
    parts = score_sequences(
        model,
        windows(tokens, window),
        fixed_tau=fixed_tau,
        fused_output_stage=fused_output_stage,
        chunk_size=chunk_size,
        micro_batch_size=micro_batch_size,
    )
    return merge(parts)


@torch.no_grad()
def score_sequences(
    model: InferenceModel,
    sequences: list[list[int]],
    *,
    fixed_tau: float | None = None,
    fused_output_stage: bool = True,
    chunk_size: int | None = None,
    micro_batch_size: int = 8,
    first: list[int] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> list[TokenScores]:
    """Scores of every sequence's tokens from index ``first[i]`` on (default 1: all but the
    first), each predicted from the tokens before it in its sequence; ``on_tokens(n)``: ``n``
    more tokens are scored (progress).

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
        score = _fused_scores if fused_output_stage else _unfused_scores
        ce, tllm, tau, best = score(model, inputs, targets, scored, fixed_tau, chunk_size)
        counts = scored.sum(1).tolist()
        pieces = [t.double().tolist() for t in (ce, tllm, tau)]
        hits = (best == targets[scored]).tolist()
        kept = targets[scored].tolist()
        offset = 0
        for row, i in enumerate(batch):
            n = counts[row]
            part = slice(offset, offset + n)
            results[i] = TokenScores(kept[part], pieces[0][part], pieces[1][part],
                                     pieces[2][part], hits[part])  # fmt: skip
            offset += n
        if on_tokens is not None:
            on_tokens(sum(counts))
    return results


def _fused_scores(model: InferenceModel, inputs, targets, scored, fixed_tau, chunk_size):
    """``(ce, T-LLM ce, tau, greedy id)`` of the ``scored`` targets (``[n]`` each, in
    sequence-major order) from the fused output stage."""
    final = model.final_hidden(inputs)  # [s, b, h]
    hidden = final.hidden.transpose(0, 1)[scored]  # [n, h]
    source = {"tau": float(fixed_tau)} if fixed_tau is not None else {"tempnet": model.tempnet}
    out = fused_output_stage(
        hidden,
        final.weight,
        targets[scored],
        loss="ce",
        vocab_size=model.vocab_size,
        tp_group=model.tp_group,
        chunk_size=chunk_size,
        eval_terms=True,
        **source,
    )
    return out.ce, out.ts_ce, out.tau, out.argmax


def _unfused_scores(model: InferenceModel, inputs, targets, scored, fixed_tau, chunk_size):
    """``(ce, T-LLM ce, tau, greedy id)`` of the ``scored`` targets from the whole logits."""
    tp = resolve_tp_group(model.tp_group)
    padded = model.model.padded_vocab_size(tp.size)
    part = vocab_partition(padded // tp.size, tp.rank, model.vocab_size)
    logits = model.logits(inputs)[scored]  # [n, V_pad/tp]
    rows = targets[scored]
    if fixed_tau is not None:
        tau = torch.full(rows.shape, float(fixed_tau), device=logits.device)
    else:
        tau = model.tempnet(logits)
    common = {"vocab_size": model.vocab_size, "tp_group": model.tp_group}
    ce = temperature_scaled_cross_entropy(logits, rows, 1.0, **common)
    tllm = temperature_scaled_cross_entropy(logits, rows, tau, **common)
    best = parallel_argmax(logits[:, : part.n_true], part.start, tp)  # [n]
    return ce, tllm, tau, best


def summarise(all_scores: list[TokenScores]) -> dict:
    """Token-weighted means over documents: losses, perplexities, tau statistics (the std over
    every token)."""
    import math

    ce = [x for s in all_scores for x in s.ce]
    tllm = [x for s in all_scores for x in s.tllm_ce]
    tau = [x for s in all_scores for x in s.tau]
    n = len(ce)
    if n == 0:
        raise InferenceError("nothing to evaluate: every document is shorter than 2 tokens")
    mean_ce, mean_tllm = sum(ce) / n, sum(tllm) / n
    tau_mean = sum(tau) / n
    return {
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
