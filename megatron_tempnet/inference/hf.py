"""Personal temperatures in plain Hugging Face ``generate``.

    from transformers import AutoModelForCausalLM, LogitsProcessorList
    from megatron_tempnet.inference.hf import TempNetLogitsProcessor

    tempnet = TempNetLogitsProcessor("exported_tempnet/", tau_max_eval=1.0)
    out = model.generate(ids, logits_processor=LogitsProcessorList([tempnet]),
                         do_sample=True, temperature=1.0, top_p=0.9)
    tempnet.taus  # [batch, generated tokens]: the tau every token was chosen with

    tempnet.fit_mean(model(ids).logits, 0.7)  # the paper's Table 1: mean tau 0.7 on a sample

``transformers`` applies user processors after its own (repetition penalty and the like) and
before its sampling warpers (temperature, top-k, top-p): the logits are divided by TempNet's tau
first, then filtered. Leave ``temperature`` at 1.0 (some models' ``generation_config`` set
another), or it divides the logits a second time.
"""

from __future__ import annotations

import torch

from megatron_tempnet.tempnet.export import load_tempnet
from megatron_tempnet.tempnet.layers import upper_bound_for_mean

try:
    from transformers import LogitsProcessor
except ImportError:  # transformers is a dependency; this keeps the module importable without
    LogitsProcessor = object


class TempNetLogitsProcessor(LogitsProcessor):
    """Divides each step's next-token logits by the tau an exported TempNet predicts from them.

    Args:
        tempnet_dir: a directory written by ``tools/export_tempnet.py``.
        tau_max_eval: the upper bound of tau at inference (Figure 9; default: the trained one).
        record: keep every step's tau in ``self.taus``.

    The scores may have more columns than TempNet's vocabulary (a padded embedding): TempNet reads
    the first ``vocab_size`` and every column is divided. ``transformers`` runs its own processors
    first: tokens they set to ``-inf`` (``min_new_tokens``, ``bad_words_ids``,
    ``suppress_tokens``) reach TempNet as the lowest finite score of their row (an ``-inf`` would
    make TempNet's normalised input, and every score, NaN).

    A step waits for nothing on the host: the recorded taus stay on the scores' device until
    ``taus`` is read.
    """

    def __init__(self, tempnet_dir: str, *, tau_max_eval: float | None = None, record: bool = True):
        self.tempnet = load_tempnet(tempnet_dir, tau_max_eval=tau_max_eval)
        self.record = record
        self._taus: list[torch.Tensor] = []

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = self.tempnet.vocab_size
        if scores.shape[-1] < vocab:
            raise ValueError(
                f"TempNetLogitsProcessor: the model scores {scores.shape[-1]} tokens, TempNet was "
                f"trained on a vocabulary of {vocab}: not the same tokenizer?"
            )
        if self.tempnet.weight1.device != scores.device:
            self.tempnet.to(scores.device)
        logits = scores[:, :vocab].float()
        # tokens an earlier processor forbade (min_new_tokens, ...) read as their row's lowest
        # finite score; computed for every row, so that no step asks the host whether any is
        finite = torch.isfinite(logits)
        floor = logits.masked_fill(~finite, float("inf")).amin(dim=1, keepdim=True)
        tau = self.tempnet(torch.where(finite, logits, floor))  # [b]
        if self.record:
            self._taus.append(tau.detach())
        return scores / tau[:, None].to(scores.dtype)

    @torch.no_grad()
    def fit_mean(self, sample_logits: torch.Tensor, target: float) -> float:
        """The paper's inference-time scaling (its Table 1): sets the upper bound of tau so that
        TempNet's mean tau over ``sample_logits`` (``[..., V]``: the next-token logits of a
        sample's tokens, e.g. a model's ``logits`` on a few prompts) is ``target``; returns the
        bound (``tempnet.layers.upper_bound_for_mean``)."""
        logits = sample_logits[..., : self.tempnet.vocab_size].float()
        self.tempnet.to(logits.device)
        self.tempnet.tau_max_eval = None
        taus = self.tempnet(logits.reshape(-1, logits.shape[-1]))
        bound = upper_bound_for_mean(taus, self.tempnet.tau_min, self.tempnet.tau_max, target)
        self.tempnet.tau_max_eval = bound
        return bound

    @property
    def taus(self) -> torch.Tensor:
        """``[batch, steps]`` tau of every generated token so far (float32, CPU; one copy from
        the device)."""
        if not self._taus:
            return torch.empty(0, 0)
        return torch.stack(self._taus, dim=1).cpu()

    def reset(self) -> None:
        """Forget the recorded taus (before the next ``generate``)."""
        self._taus.clear()
