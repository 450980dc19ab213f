"""Perplexity and T-LLM perplexity of token streams, on vocabulary-parallel logits.

For every predicted token (target ``y`` after a context):

    CE       = -log softmax(L)_y                       (cross-entropy perplexity: exp(mean CE))
    T-LLM CE = -log softmax(L / tau)_y                  (the paper's T-LLM perplexity)

with tau from TempNet (or a fixed value). Both come from ``temperature_scaled_cross_entropy``
on each TP rank's ``[b, s, V_pad/tp]`` slice (two SUM/MAX all-reduces of ``[tokens, 3]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_tempnet.inference.model import InferenceError, InferenceModel
from megatron_tempnet.losses import temperature_scaled_cross_entropy


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
    model: InferenceModel, tokens: list[int], *, window: int, fixed_tau: float | None = None
) -> TokenScores:
    """CE and T-LLM CE of every token after the first, in windows of ``window`` predictions.

    Windows do not overlap: the first token of a window is predicted from that window only.
    """
    from megatron_tempnet.distributed.groups import resolve_tp_group, vocab_partition
    from megatron_tempnet.inference.sampling import parallel_argmax

    tp = resolve_tp_group(model.tp_group)
    padded = model.model.padded_vocab_size(tp.size)
    part = vocab_partition(padded // tp.size, tp.rank, model.vocab_size)
    scores = TokenScores()
    device = next(model.lm.parameters()).device
    for start in range(0, len(tokens) - 1, window):
        chunk = torch.tensor([tokens[start : start + window + 1]], device=device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]  # [1, s]
        logits = model.logits(inputs)  # [1, s, V_pad/tp]
        if fixed_tau is not None:
            tau = torch.full(targets.shape, float(fixed_tau), device=device)
        else:
            tau = model.tempnet(logits)
        common = {"vocab_size": model.vocab_size, "tp_group": model.tp_group}
        ce = temperature_scaled_cross_entropy(logits, targets, 1.0, **common)
        tllm = temperature_scaled_cross_entropy(logits, targets, tau, **common)
        scores.targets += targets[0].tolist()
        scores.ce += ce[0].double().tolist()
        scores.tllm_ce += tllm[0].double().tolist()
        scores.tau += tau[0].double().tolist()
        best = parallel_argmax(logits[0, :, : part.n_true], part.start, tp)  # [s]
        scores.greedy += (best == targets[0]).tolist()
    return scores


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
