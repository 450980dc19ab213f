"""The fused output stage's passes over a chunk of logits, each one read of them when compiled.

On a chunk's true logits ``[c, V_true_local]`` (``output_chunks``):

- ``row_stats``: each row's maximum and, for TempNet's input, its squared norm;
- ``exp_sums``: ``S`` at tau = 1 (the reported cross-entropy), ``S`` and ``Q`` at tau
  (``dro_math``'s notation);
- ``tempered_softmax_``: in place, ``row_scale * exp((L - M) / tau) [+ logit_coef * L]`` (the
  loss's gradient before the target's term).

Eager, these are ``dro_math``'s block-wise loops: 2, up to 10 and 4 elementwise passes over each
cache-sized block. Where a compiler is present, ``torch.compile`` (inductor: C++ on a CPU, Triton
on a GPU) makes each one loop over the logits, computing every sum from one read; the results
are the eager ones within float32 rounding (the same operations, the sums in another order).
Compiled for float32 only: float64 (the tests' references) stays eager, as does a rank whose
vocabulary shard has no true column.

``MEGATRON_TEMPNET_COMPILE=0`` in the environment turns the compiled passes off. A compiler that
fails on a pass's first call turns them off for the process, with one warning naming the error;
the run goes on eager (inductor compiles before it runs anything, so nothing was written).
"""

from __future__ import annotations

import functools
import os

import torch

from megatron_tempnet.losses import dro_math
from megatron_tempnet.utils.compilers import compile_error, compiler_missing
from megatron_tempnet.utils.logging import warn_rank0

ENV = "MEGATRON_TEMPNET_COMPILE"
"""Set to ``0`` to run the passes eager."""


def _eager_row_stats(logits: torch.Tensor, need_norm: bool):
    norm_sq = torch.linalg.vector_norm(logits, dim=1).square() if need_norm else None
    return torch.amax(logits, dim=1), norm_sq


def _eager_exp_sums(logits, row_max, tau, at_tau: bool, need_q: bool):
    s_one, _ = dro_math.tempered_sums(logits, row_max, torch.ones_like(tau), need_q=False)
    if not at_tau:
        return s_one, None, None
    s_tau, q_tau = dro_math.tempered_sums(logits, row_max, tau, need_q=need_q)
    return s_one, s_tau, q_tau


def _fused_row_stats(logits: torch.Tensor, need_norm: bool):
    norm_sq = (logits * logits).sum(dim=1) if need_norm else None
    return torch.amax(logits, dim=1), norm_sq


def _fused_exp_sums(logits, row_max, tau, at_tau: bool, need_q: bool):
    shifted = logits - row_max[:, None]
    s_one = torch.exp(shifted).sum(dim=1)
    if not at_tau:
        return s_one, None, None
    z = shifted / tau[:, None]  # subtract, then divide, as dro_math.exp_shifted_ does
    e = torch.exp(z)
    return s_one, e.sum(dim=1), (e * z).sum(dim=1) if need_q else None


def _fused_softmax(logits, row_max, tau, row_scale, logit_coef):
    grad = torch.exp((logits - row_max[:, None]) / tau[:, None]) * row_scale[:, None]
    if logit_coef is not None:
        grad = grad + logit_coef[:, None] * logits
    logits.copy_(grad)  # inductor writes the one loop's result into the input
    return logits


class _Pass:
    """One pass: its compiled form where allowed and working, else its eager form."""

    failed: str | None = None
    """Why the compiled passes are off in this process (a compiler failed), or None."""

    def __init__(self, fused, eager):
        self.fused, self.eager = fused, eager
        self.compiled = None
        self.proven = False

    def __call__(self, logits: torch.Tensor, *args):
        if not compiled_passes(logits):
            return self.eager(logits, *args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fused, dynamic=True)
        if self.proven:
            return self.compiled(logits, *args)
        try:
            out = self.compiled(logits, *args)
        except Exception as e:  # any compiler failure: the eager passes compute the same
            _Pass.failed = compile_error(e)
            warn_rank0(
                "torch.compile failed on the output stage's logit passes (%s): they run eager, "
                "computing the same (%s=0 silences this)",
                _Pass.failed,
                ENV,
            )
            return self.eager(logits, *args)
        self.proven = True
        return out


@functools.cache
def _compiler_missing(cuda: bool) -> str | None:
    return compiler_missing(cuda)


def compiled_passes(logits: torch.Tensor) -> bool:
    """Whether the passes over ``logits`` run compiled (module docstring)."""
    return (
        logits.dtype == torch.float32
        and logits.shape[-1] > 0
        and os.environ.get(ENV, "1") != "0"
        and _Pass.failed is None
        and _compiler_missing(logits.is_cuda) is None
    )


_row_stats = _Pass(_fused_row_stats, _eager_row_stats)
_exp_sums = _Pass(_fused_exp_sums, _eager_exp_sums)
_softmax = _Pass(_fused_softmax, dro_math.tempered_softmax_)


def row_stats(logits: torch.Tensor, *, need_norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[c, n]`` logits (``n >= 1``) -> each row's maximum ``[c]`` and, with ``need_norm``,
    its squared norm ``[c]`` (else None); partial over this rank's columns."""
    return _row_stats(logits, need_norm)


def exp_sums(
    logits: torch.Tensor, row_max: torch.Tensor, tau: torch.Tensor, *, at_tau: bool, need_q: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Local partial ``S`` at tau = 1 and, with ``at_tau``, ``S`` and (``need_q``) ``Q`` at
    ``tau``, each ``[c]`` (None where not asked), for ``z = (L - M) / tau``; ``M``: ``row_max``,
    the global row maxima. The logits are not modified."""
    return _exp_sums(logits, row_max, tau, at_tau, need_q)


def tempered_softmax_(
    logits: torch.Tensor,
    row_max: torch.Tensor,
    tau: torch.Tensor,
    row_scale: torch.Tensor,
    logit_coef: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dro_math.tempered_softmax_``: in place, ``L -> row_scale * exp((L - M) / tau)
    [+ logit_coef * L]``; returns ``logits``."""
    return _softmax(logits, row_max, tau, row_scale, logit_coef)
