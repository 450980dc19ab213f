"""Independent float64 references written straight from the paper's equations."""

from __future__ import annotations

import math

import torch


def dro_reference(logits, target, tau, rho, vocab_size=None):
    """Eq. (2) literally: tau * log((1/|C|) sum_k exp((L_k - L_+)/tau)) + tau * rho, float64.

    Differentiable with plain autograd (logits and tau may require grad).
    """
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    L = logits.to(torch.float64)[..., :vocab_size]
    tau = torch.as_tensor(tau, dtype=torch.float64)
    L_plus = L.gather(-1, target.unsqueeze(-1))
    lse = torch.logsumexp((L - L_plus) / tau.unsqueeze(-1), dim=-1)
    return tau * (lse - math.log(vocab_size)) + tau * rho


def dro_dtau_reference(logits, tau, rho, vocab_size=None):
    """Eq. (10): df/dtau, from the softmax written out in float64."""
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    L = logits.to(torch.float64)[..., :vocab_size]
    tau = torch.as_tensor(tau, dtype=torch.float64).unsqueeze(-1)
    p = torch.softmax(L / tau, dim=-1)
    lse = torch.logsumexp(L / tau, dim=-1)
    return lse - math.log(vocab_size) - (p * L / tau).sum(-1) + rho


def assert_close(actual, expected, rtol, what=""):
    """Elementwise relative tolerance, with an absolute floor of ``rtol * max|expected|``."""
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}"
    )
