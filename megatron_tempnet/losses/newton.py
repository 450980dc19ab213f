"""Individually optimised temperature (the paper's Baseline 2, Appendix B).

Per token, minimise the convex f(z, tau) of eq. (2) over ``tau >= tau_min`` by Newton's method on
``df/dtau = 0`` started from tau = 1. ``df/dtau`` increases monotonically from
``log(m/|C|) + rho`` (tau -> 0, m = number of maximal logits) to ``rho`` (tau -> inf), so:

* it is safeguarded: every evaluated point narrows a bracket around the root, and a Newton step
  that leaves the bracket is replaced by a bisection in log tau (or by a jump to a bound);
* it is projected: if ``df/dtau >= 0`` at ``tau_min``, the minimiser is ``tau_min``.

Newton steps are taken in ``log tau`` (``tau <- tau * exp(-g / (tau g'))``), which keeps tau
positive. Sums are accumulated in float64 so that ``|df/dtau|`` can be driven to 1e-7.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tempnet.distributed.groups import resolve_tp_group, vocab_partition
from megatron_tempnet.losses import dro_math
from megatron_tempnet.utils.logging import get_logger

logger = get_logger(__name__)


@torch.no_grad()
def optimal_tau(
    vocab_parallel_logits: torch.Tensor,
    *,
    rho: float,
    tau_min: float,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    max_iter: int = 30,
    tol: float = 1e-7,
    tau_max: float | None = None,
) -> torch.Tensor:
    """Per-token minimiser of f(z, tau) over ``tau_min <= tau (<= tau_max)``.

    f's minimiser over tau does not depend on the target (the target only adds ``M - L_+``), so
    only the logits are needed.

    Args:
        vocab_parallel_logits: ``[b, s, V_pad/tp]`` (any leading shape) this rank's vocabulary
            slice.
        rho: ``> 0``, or ``>= 0`` with ``tau_max`` (for rho = 0, f decreases for all tau).
        tau_min: lower bound tau0 > 0.
        vocab_size: true vocabulary size |C| (padded columns are ignored).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        max_iter: iteration cap; tokens not converged by then keep their last iterate (logged).
        tol: stop when ``|df/dtau| <= tol``.
        tau_max: optional upper bound.
    Returns:
        ``[b, s]`` tau, float64 for float64 logits else float32, no gradient, identical on all TP
        ranks. One SUM all-reduce of ``[T, 3]`` per iteration, one MAX all-reduce in all.
    """
    _check_bounds(rho, tau_min, tau_max)
    tp = resolve_tp_group(tp_group)
    n_cols = vocab_parallel_logits.shape[-1]
    if not 1 <= vocab_size <= n_cols * tp.size:
        raise ValueError(f"vocab_size ({vocab_size}) must be in [1, {n_cols * tp.size}]")
    part = vocab_partition(n_cols, tp.rank, vocab_size)
    x = vocab_parallel_logits.detach().reshape(-1, n_cols)[:, : part.n_true]
    n_rows = x.shape[0]
    f64 = dict(dtype=torch.float64, device=x.device)

    row_max = torch.full((n_rows,), -math.inf, **f64)
    if part.n_true:
        row_max = torch.amax(x, dim=1).to(torch.float64)
    tp.all_reduce(row_max, op=dist.ReduceOp.MAX)

    log_c = math.log(vocab_size)
    upper = math.inf if tau_max is None else float(tau_max)
    tau = torch.full((n_rows,), min(max(1.0, tau_min), upper), **f64)
    lo = torch.full((n_rows,), tau_min, **f64)  # root >= lo
    hi = torch.full((n_rows,), upper, **f64)  # root <= hi
    lo_seen = torch.zeros(n_rows, dtype=torch.bool, device=x.device)  # g(lo) < 0 observed
    hi_seen = torch.zeros_like(lo_seen)  # g(hi) > 0 observed
    done = torch.zeros_like(lo_seen)
    g = torch.zeros(n_rows, **f64)

    for it in range(max_iter):
        sums = dro_math.newton_sums(x, row_max, tau)
        tp.all_reduce(sums)
        s, mean_z, mean_z2 = sums[:, 0], sums[:, 1] / sums[:, 0], sums[:, 2] / sums[:, 0]
        g = dro_math.dro_dtau(torch.log(s), mean_z, log_c, rho)
        h = dro_math.dro_d2tau(mean_z, mean_z2, tau)

        done |= (g.abs() <= tol) | ((tau <= tau_min) & (g >= 0)) | ((tau >= upper) & (g <= 0))
        if bool(done.all()) or it == max_iter - 1:  # host sync, once per iteration
            break
        below, above = g < 0, g > 0
        lo = torch.where(below, tau, lo)
        lo_seen |= below
        hi = torch.where(above, tau, hi)
        hi_seen |= above
        tau = torch.where(done, tau, _next_tau(tau, g, h, lo, hi, lo_seen, hi_seen))
    _warn_unconverged(g, done, tol)
    out_dtype = torch.float64 if vocab_parallel_logits.dtype == torch.float64 else torch.float32
    return tau.to(out_dtype).view(vocab_parallel_logits.shape[:-1])


def _check_bounds(rho: float, tau_min: float, tau_max: float | None) -> None:
    if not tau_min > 0:
        raise ValueError(f"tau_min ({tau_min}) must be > 0")
    if tau_max is not None and not tau_max > tau_min:
        raise ValueError(f"tau_max ({tau_max}) must be > tau_min ({tau_min})")
    if rho < 0 or (rho == 0 and tau_max is None):
        raise ValueError(
            f"rho ({rho}) must be > 0 (or >= 0 with tau_max): with rho = 0, f(tau) decreases for "
            f"all tau and has no finite minimiser"
        )


def _next_tau(tau, g, h, lo, hi, lo_seen, hi_seen):
    """Newton step in log tau, replaced by a bound or a log-bisection when it leaves (lo, hi)."""
    cand = tau * torch.exp(-g / (tau * h))  # h = 0 gives inf/nan: caught by isfinite below
    ok = torch.isfinite(cand) & (h > 0) & (cand > lo) & (cand < hi)
    # Outside the bracket: try an untested bound first (that is where a projected minimiser
    # lies), otherwise bisect the bracket in log space, or expand it if still open above.
    to_lo = ~ok & (cand <= lo) & ~lo_seen
    to_hi = ~ok & (cand >= hi) & ~hi_seen & torch.isfinite(hi)
    bisect = torch.sqrt(lo * hi)
    expand = tau * 8.0
    fallback = torch.where(torch.isfinite(hi), bisect, expand)
    fallback = torch.where(to_lo, lo, torch.where(to_hi, hi, fallback))
    return torch.where(ok, cand, fallback)


def _warn_unconverged(g: torch.Tensor, done: torch.Tensor, tol: float) -> None:
    left = int((~done).sum())
    if left:
        worst = float(g[~done].abs().max())
        logger.warning(
            "optimal_tau: %d token(s) not converged (max |df/dtau| = %.3g > tol %.3g); "
            "raise max_iter",
            left,
            worst,
            tol,
        )
