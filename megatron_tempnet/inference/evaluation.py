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


@torch.no_grad()
def score_tokens(
    model: InferenceModel,
    tokens: list[int],
    *,
    window: int,
    fixed_tau: float | None = None,
    fused_output_stage: bool = True,
    chunk_size: int | None = None,
) -> TokenScores:
    """CE and T-LLM CE of every token after the first, in windows of ``window`` predictions.

    Windows do not overlap: the first token of a window is predicted from that window only.
    With ``fused_output_stage`` (default) the values come from the final hidden states chunk by
    chunk (``losses.output_stage``, ``chunk_size`` tokens at a time); otherwise from the whole
    logits of a window.
    """
    scores = TokenScores()
    device = next(model.lm.parameters()).device
    for start in range(0, len(tokens) - 1, window):
        chunk = torch.tensor([tokens[start : start + window + 1]], device=device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]  # [1, s]
        if fused_output_stage:
            ce, tllm, tau, best = _fused_scores(model, inputs, targets, fixed_tau, chunk_size)
        else:
            ce, tllm, tau, best = _unfused_scores(model, inputs, targets, fixed_tau)
        scores.targets += targets[0].tolist()
        scores.ce += ce.double().tolist()
        scores.tllm_ce += tllm.double().tolist()
        scores.tau += tau.double().tolist()
        scores.greedy += (best == targets[0]).tolist()
    return scores


def _fused_scores(model: InferenceModel, inputs, targets, fixed_tau, chunk_size):
    """``(ce, T-LLM ce, tau, greedy id)``, each ``[s]``, from the fused output stage."""
    final = model.final_hidden(inputs)  # [s, 1, h]
    source = {"tau": float(fixed_tau)} if fixed_tau is not None else {"tempnet": model.tempnet}
    out = fused_output_stage(
        final.hidden[:, 0],
        final.weight,
        targets[0],
        loss="ce",
        vocab_size=model.vocab_size,
        tp_group=model.tp_group,
        chunk_size=chunk_size,
        eval_terms=True,
        **source,
    )
    return out.ce, out.ts_ce, out.tau, out.argmax


def _unfused_scores(model: InferenceModel, inputs, targets, fixed_tau):
    """``(ce, T-LLM ce, tau, greedy id)``, each ``[s]``, from the window's whole logits."""
    tp = resolve_tp_group(model.tp_group)
    padded = model.model.padded_vocab_size(tp.size)
    part = vocab_partition(padded // tp.size, tp.rank, model.vocab_size)
    logits = model.logits(inputs)  # [1, s, V_pad/tp]
    if fixed_tau is not None:
        tau = torch.full(targets.shape, float(fixed_tau), device=logits.device)
    else:
        tau = model.tempnet(logits)
    common = {"vocab_size": model.vocab_size, "tp_group": model.tp_group}
    ce = temperature_scaled_cross_entropy(logits, targets, 1.0, **common)
    tllm = temperature_scaled_cross_entropy(logits, targets, tau, **common)
    best = parallel_argmax(logits[0, :, : part.n_true], part.start, tp)  # [s]
    return ce[0], tllm[0], tau[0], best


def summarise(all_scores: list[TokenScores]) -> dict:
    """Token-weighted means over documents: losses, perplexities, tau statistics."""
    import math

    ce = [x for s in all_scores for x in s.ce]
    tllm = [x for s in all_scores for x in s.tllm_ce]
    tau = [x for s in all_scores for x in s.tau]
    n = len(ce)
    if n == 0:
        raise InferenceError("nothing to evaluate: every document is shorter than 2 tokens")
    mean_ce, mean_tllm = sum(ce) / n, sum(tllm) / n
    return {
        "tokens": n,
        "ce_loss": mean_ce,
        "ppl": math.exp(mean_ce),
        "tllm_loss": mean_tllm,
        "tllm_ppl": math.exp(mean_tllm),
        "tau_mean": sum(tau) / n,
        "tau_min": min(tau),
        "tau_max": max(tau),
    }
