"""Dense single-rank KL-DRO loss: the readable reference for the vocabulary-parallel version."""

from __future__ import annotations

import math

import torch


def dro_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    tau: torch.Tensor | float,
    *,
    rho: float,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token KL-DRO loss of eq. (2), computed with plain autograd on full logits.

        f(z, tau) = tau * log((1/|C|) sum_k exp((L_k - L_+)/tau)) + tau * rho

    Args:
        logits: ``[..., V]`` full logits (half precision is computed in float32).
        target: ``[...]`` token ids in ``[0, vocab_size)``.
        tau: ``[...]`` temperatures (> 0), broadcastable, or a float.
        rho: ``>= 0``.
        vocab_size: true vocabulary size |C|; columns beyond it are padding and ignored.
            Default: all ``V`` columns.
    Returns:
        ``[...]`` loss per token.
    """
    if rho < 0:
        raise ValueError(f"rho ({rho}) must be >= 0")
    n_cols = logits.shape[-1]
    vocab_size = n_cols if vocab_size is None else vocab_size
    if not 1 <= vocab_size <= n_cols:
        raise ValueError(f"vocab_size ({vocab_size}) must be in [1, {n_cols}] (logits' last dim)")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits {tuple(logits.shape)} must be target {tuple(target.shape)} plus a "
            f"vocabulary dimension"
        )
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
        raise ValueError(
            f"target ids must lie in [0, {vocab_size}); got [{int(target.min())}, "
            f"{int(target.max())}]"
        )
    if not isinstance(tau, torch.Tensor) and not tau > 0:
        raise ValueError(f"tau ({tau}) must be > 0")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = logits[..., :vocab_size]
    tau = torch.as_tensor(tau, dtype=logits.dtype, device=logits.device)
    target_logit = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    # Shift by the row maximum before dividing by tau (stable for tau = 1e-3, |L| = 1e4);
    # tau * LSE((L - M)/tau) + M = tau * LSE(L/tau) for any constant M.
    row_max = logits.max(dim=-1, keepdim=True).values.detach()
    lse = torch.logsumexp((logits - row_max) / tau.unsqueeze(-1), dim=-1)
    return tau * (lse - math.log(vocab_size) + rho) + (row_max.squeeze(-1) - target_logit)
