"""Row-wise math of the KL-DRO loss on local tensors (no communication here).

Notation of docs/design.md §2 for one token with logits ``L`` over the true vocabulary ``C``, the
global row maximum ``M`` and temperature ``tau``:

    z_k = (L_k - M) / tau            (<= 0: exp never overflows, whatever tau and |L|)
    S   = sum_k exp(z_k)             LSE(L / tau) = M / tau + log S
    Q   = sum_k exp(z_k) z_k         E_p[L] / tau = M / tau + Q / S
    R   = sum_k exp(z_k) z_k^2       Var_p[L] / tau^2 = R / S - (Q / S)^2

S, Q and R are sums over the vocabulary, so on a vocabulary shard they are partial sums that one
SUM all-reduce completes. Everything below that takes them is elementwise on ``[tokens]``.
"""

from __future__ import annotations

import torch

# Rows are processed in blocks of about this many elements so that the per-block temporaries
# stay in cache on CPU and kernel launches stay few on GPU.
_BLOCK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 22}


def _block_rows(n_rows: int, n_cols: int, device: torch.device) -> int:
    budget = _BLOCK_ELEMENTS.get(device.type, 1 << 24)
    return max(1, min(n_rows, budget // max(n_cols, 1)))


def exp_shifted_(
    logits_2d: torch.Tensor,
    row_max: torch.Tensor,
    tau: torch.Tensor,
    out: torch.Tensor | None,
    *,
    need_q: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write ``exp(z)`` into ``out`` (None: nowhere) and return the local partial sums ``(S, Q)``.

    Args:
        logits_2d: ``[T, V_true_local]`` logits, float32 or float64; may be ``out`` itself.
        row_max: ``[T]`` global maximum of each row.
        tau: ``[T]`` temperatures (> 0).
        out: ``[T, V_true_local]`` buffer for ``exp(z)``, same dtype; None keeps only the sums.
        need_q: also return ``Q`` (needed only for the gradient w.r.t. tau).
    Returns:
        ``S [T]`` and ``Q [T]`` (or None), partial over the local columns.
    """
    n_rows, n_cols = logits_2d.shape
    s_local = torch.zeros(n_rows, dtype=logits_2d.dtype, device=logits_2d.device)
    q_local = torch.zeros_like(s_local) if need_q else None
    if n_cols == 0:
        return s_local, q_local
    step = _block_rows(n_rows, n_cols, logits_2d.device)
    z_buf = torch.empty(step, n_cols, dtype=logits_2d.dtype, device=logits_2d.device)
    e_buf = torch.empty_like(z_buf) if out is None else None
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        z = z_buf[: r1 - r0]
        # Subtract, then divide: forming L / tau first would lose the small differences
        # near the maximum when |L| / tau is large (tau = 1e-3, |L| = 1e4).
        torch.sub(logits_2d[r0:r1], row_max[r0:r1, None], out=z)
        z.div_(tau[r0:r1, None])
        e = out[r0:r1] if out is not None else e_buf[: r1 - r0]
        torch.exp(z, out=e)
        torch.sum(e, dim=1, out=s_local[r0:r1])
        if need_q:
            z.mul_(e)  # z is a block temporary: reuse it for exp(z) * z
            torch.sum(z, dim=1, out=q_local[r0:r1])
    return s_local, q_local


def tempered_sums(
    logits_2d: torch.Tensor, row_max: torch.Tensor, tau: torch.Tensor, *, need_q: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Local partial ``(S, Q)`` of ``z = (L - M) / tau`` without writing ``exp(z)`` anywhere.

    The fused output stage's forward: its logits are recomputed in the backward pass, so only
    the sums are kept. ``logits_2d [T, V_true_local]`` is not modified; block temporaries only.
    """
    return exp_shifted_(logits_2d, row_max, tau, None, need_q=need_q)


def tempered_softmax_(
    logits_2d: torch.Tensor,
    row_max: torch.Tensor,
    tau: torch.Tensor,
    row_scale: torch.Tensor,
    logit_coef: torch.Tensor | None = None,
) -> torch.Tensor:
    """In place: ``L -> row_scale * exp((L - M) / tau) [+ logit_coef * L]``, block by block.

    With ``row_scale = g / S`` this is ``g * softmax(L / tau)`` (the fused output stage's
    backward, before the target's ``-g`` is subtracted). ``logit_coef [T]`` adds a multiple of
    the logits themselves (the gradient of TempNet's normalised input, without stop-gradient).
    """
    n_rows, n_cols = logits_2d.shape
    if n_cols == 0:
        return logits_2d
    step = _block_rows(n_rows, n_cols, logits_2d.device)
    keep = None
    if logit_coef is not None:
        keep = torch.empty(step, n_cols, dtype=logits_2d.dtype, device=logits_2d.device)
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        block = logits_2d[r0:r1]
        if keep is not None:
            linear = keep[: r1 - r0]
            torch.mul(block, logit_coef[r0:r1, None], out=linear)
        block.sub_(row_max[r0:r1, None]).div_(tau[r0:r1, None]).exp_()
        block.mul_(row_scale[r0:r1, None])
        if keep is not None:
            block.add_(linear)
    return logits_2d


def newton_sums(logits_2d: torch.Tensor, row_max: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Local partial ``[S, Q, R]`` per row, in float64, for Newton's method on tau.

    Returns ``[T, 3]`` float64. Works block by block; the logits are not modified.
    """
    n_rows, n_cols = logits_2d.shape
    sums = torch.zeros(n_rows, 3, dtype=torch.float64, device=logits_2d.device)
    if n_cols == 0:
        return sums
    step = _block_rows(n_rows, n_cols, logits_2d.device)
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        z = logits_2d[r0:r1].to(torch.float64) - row_max[r0:r1, None]
        z.div_(tau[r0:r1, None])
        e = torch.exp(z)
        sums[r0:r1, 0] = e.sum(dim=1)
        e.mul_(z)
        sums[r0:r1, 1] = e.sum(dim=1)
        e.mul_(z)
        sums[r0:r1, 2] = e.sum(dim=1)
    return sums


def gather_target_logits(
    logits_2d: torch.Tensor, target_1d: torch.Tensor, start: int, n_true: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logit of each row's target if the target is one of this shard's true columns, else 0.

    Returns ``(target_logit [T], is_local [T] bool, local_index [T] long)``.
    """
    local_index = target_1d - start
    is_local = (local_index >= 0) & (local_index < n_true)
    local_index = torch.where(is_local, local_index, torch.zeros_like(local_index))
    picked = logits_2d.gather(1, local_index[:, None]).squeeze(1) if n_true else None
    zeros = torch.zeros(target_1d.shape, dtype=logits_2d.dtype, device=logits_2d.device)
    target_logit = torch.where(is_local, picked, zeros) if picked is not None else zeros
    return target_logit, is_local, local_index


def dro_value(
    log_s: torch.Tensor, max_minus_target: torch.Tensor, tau: torch.Tensor, log_c: float, rho: float
) -> torch.Tensor:
    """Eq. (2): f = tau * (LSE(L/tau) - L_+/tau) - tau log|C| + tau rho
    = tau * (log S - log|C| + rho) + (M - L_+)."""
    return tau * (log_s - log_c + rho) + max_minus_target


def dro_dtau(log_s: torch.Tensor, mean_z: torch.Tensor, log_c: float, rho: float) -> torch.Tensor:
    """df/dtau = LSE(L/tau) - E_p[L]/tau - log|C| + rho = log S - Q/S - log|C| + rho."""
    return log_s - mean_z - log_c + rho


def dro_d2tau(mean_z: torch.Tensor, mean_z2: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """d2f/dtau2 = Var_p[L] / tau^3 = (R/S - (Q/S)^2) / tau  (>= 0: f is convex in tau)."""
    return (mean_z2 - mean_z * mean_z).clamp_min(0.0) / tau


def ts_ce_value(
    log_s: torch.Tensor, max_minus_target: torch.Tensor, tau: torch.Tensor
) -> torch.Tensor:
    """TS-CE: cross-entropy of L / tau = LSE(L/tau) - L_+/tau = log S + (M - L_+) / tau."""
    return log_s + max_minus_target / tau


def ts_ce_dtau(
    mean_z: torch.Tensor, max_minus_target: torch.Tensor, tau: torch.Tensor
) -> torch.Tensor:
    """d CE(L/tau) / dtau = -(E_p[L] - L_+) / tau^2 = -(Q/S + (M - L_+)/tau) / tau."""
    return -(mean_z + max_minus_target / tau) / tau


def softmax_grad_(
    exp_2d: torch.Tensor,
    sum_exp: torch.Tensor,
    row_scale: torch.Tensor,
    is_local: torch.Tensor,
    local_index: torch.Tensor,
) -> torch.Tensor:
    """Turn ``exp(z)`` in place into ``row_scale * (softmax - onehot(target))``.

    ``exp_2d [T, V_true_local]``, ``sum_exp [T]`` global, ``row_scale [T]``.
    """
    exp_2d.mul_((row_scale / sum_exp)[:, None])
    if exp_2d.shape[1]:
        rows = torch.arange(exp_2d.shape[0], device=exp_2d.device)
        exp_2d[rows, local_index] -= torch.where(is_local, row_scale, torch.zeros_like(row_scale))
    return exp_2d
