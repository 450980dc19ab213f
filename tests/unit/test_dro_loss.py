"""The dense DRO loss against the primal problem of §4.1, finite differences and CE."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize, minimize_scalar
from torch.utils.checkpoint import checkpoint

from megatron_tempnet.losses import (
    dro_loss,
    dro_math,
    optimal_tau,
    temperature_scaled_cross_entropy,
    vocab_parallel_dro_loss,
)
from tests.helpers.reference import assert_close, dro_dtau_reference, dro_reference


def _primal_dro(d: np.ndarray, tau0: float, rho: float) -> float:
    """max_{p in simplex, KL(p, u) <= rho} sum_k p_k d_k - tau0 KL(p, u), by SLSQP."""
    n = d.size

    def kl(p):
        return float(np.sum(p * np.log(np.maximum(p, 1e-300) * n)))

    best = -np.inf
    for start in (np.full(n, 1.0 / n), np.exp(d - d.max()) / np.exp(d - d.max()).sum()):
        res = minimize(
            lambda p: -(p @ d - tau0 * kl(p)),
            start,
            method="SLSQP",
            bounds=[(1e-12, 1.0)] * n,
            constraints=[
                {"type": "eq", "fun": lambda p: p.sum() - 1.0},
                {"type": "ineq", "fun": lambda p: rho - kl(p)},
            ],
            options={"ftol": 1e-14, "maxiter": 1000},
        )
        assert res.success, res.message
        best = max(best, -res.fun)
    return best


@pytest.mark.parametrize("rho", [0.3, 1.0, 10.0])  # KL constraint active, active, inactive
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dro_loss_equals_primal_at_optimal_tau(rho, seed):
    gen = torch.Generator().manual_seed(seed)
    n, tau0 = 7, 0.05
    logits = torch.randn(n, generator=gen, dtype=torch.float64) * 2
    target = torch.tensor(3)
    d = (logits - logits[3]).numpy()
    primal = _primal_dro(d, tau0, rho)

    # Minimise f over tau >= tau0 with a generic bounded scalar minimiser (independent of ours).
    def f(t):
        return float(dro_loss(logits, target, float(t), rho=rho))

    res = minimize_scalar(f, bounds=(tau0, 1e3), method="bounded", options={"xatol": 1e-12})
    tau_star = min([res.x, tau0], key=f)
    newton = float(optimal_tau(logits[None], rho=rho, tau_min=tau0, vocab_size=n)[0])
    assert newton == pytest.approx(tau_star, rel=1e-5, abs=1e-9)
    # Appendix A, eq. (9): min_tau f = primal + tau0 * rho (the constant eq. (2) drops).
    assert f(newton) - tau0 * rho == pytest.approx(primal, abs=1e-7)


def test_tau_one_gives_cross_entropy_minus_log_c_plus_rho():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 4, 50, generator=gen, dtype=torch.float64) * 4
    target = torch.randint(0, 43, (5, 4), generator=gen)
    rho = 10.0
    ce = F.cross_entropy(logits[..., :43].reshape(-1, 43), target.reshape(-1), reduction="none")
    expected = ce.view(5, 4) - math.log(43) + rho
    assert_close(dro_loss(logits, target, 1.0, rho=rho, vocab_size=43), expected, 1e-13)
    parallel = vocab_parallel_dro_loss(logits, target, 1.0, rho=rho, vocab_size=43)
    assert_close(parallel, expected, 1e-13)
    parallel32 = vocab_parallel_dro_loss(logits.float(), target, 1.0, rho=rho, vocab_size=43)
    assert_close(parallel32, expected, 1e-6)


def _inputs(seed, shape=(3, 2), n_cols=9, vocab=7):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, n_cols, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    target = torch.randint(0, vocab, shape, generator=gen)
    tau = (torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    return logits, target, tau


@pytest.mark.parametrize(
    "fn",
    [
        lambda L, t, tau: dro_loss(L, t, tau, rho=2.0, vocab_size=7),
        lambda L, t, tau: vocab_parallel_dro_loss(L, t, tau, rho=2.0, vocab_size=7),
        lambda L, t, tau: temperature_scaled_cross_entropy(L, t, tau, vocab_size=7),
    ],
    ids=["dense", "vocab_parallel", "ts_ce"],
)
def test_gradcheck(fn):
    """gradcheck runs backward many times on one graph; the vocabulary-parallel backward reuses
    its saved buffer for the gradient (as megatron-core's cross-entropy does), so each backward
    needs its own forward: non-reentrant checkpointing recomputes it."""
    logits, target, tau = _inputs(0)

    def f(L, tau):
        return checkpoint(lambda a, b: fn(a, target, b), L, tau, use_reentrant=False)

    assert torch.autograd.gradcheck(f, (logits, tau))


def test_gradients_match_finite_differences_of_eq2():
    logits, target, tau = _inputs(1)
    weights = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    (vocab_parallel_dro_loss(logits, target, tau, rho=1.5, vocab_size=7) * weights).sum().backward()
    eps = 1e-6
    for idx in [(0, 0, 2), (1, 1, 6), (2, 0, int(target[2, 0]))]:
        bump = torch.zeros_like(logits)
        bump[idx] = eps
        plus = dro_reference(logits.detach() + bump, target, tau.detach(), 1.5, 7)
        minus = dro_reference(logits.detach() - bump, target, tau.detach(), 1.5, 7)
        numeric = float(((plus - minus) * weights).sum() / (2 * eps))
        assert float(logits.grad[idx]) == pytest.approx(numeric, rel=1e-7, abs=1e-9)
    assert float(logits.grad[..., 7:].abs().max()) == 0.0  # padded columns
    for i, j in [(0, 1), (2, 1)]:
        bump = torch.zeros_like(tau)
        bump[i, j] = eps
        plus = dro_reference(logits.detach(), target, tau.detach() + bump, 1.5, 7)
        minus = dro_reference(logits.detach(), target, tau.detach() - bump, 1.5, 7)
        numeric = float(((plus - minus) * weights).sum() / (2 * eps))
        assert float(tau.grad[i, j]) == pytest.approx(numeric, rel=1e-7)


def test_dtau_and_curvature_formulas():
    gen = torch.Generator().manual_seed(4)
    L = torch.randn(6, 20, generator=gen, dtype=torch.float64) * 3
    tau = torch.rand(6, generator=gen, dtype=torch.float64) + 0.2
    row_max = L.max(1).values
    sums = dro_math.newton_sums(L, row_max, tau)
    mean_z, mean_z2 = sums[:, 1] / sums[:, 0], sums[:, 2] / sums[:, 0]
    g = dro_math.dro_dtau(sums[:, 0].log(), mean_z, math.log(20), 0.7)
    assert_close(g, dro_dtau_reference(L, tau, 0.7), 1e-12, "df/dtau")
    eps = 1e-5
    numeric = (dro_dtau_reference(L, tau + eps, 0.7) - dro_dtau_reference(L, tau - eps, 0.7)) / (
        2 * eps
    )
    assert_close(dro_math.dro_d2tau(mean_z, mean_z2, tau), numeric, 1e-7, "d2f/dtau2")
    p = torch.softmax(L / tau[:, None], -1)
    var = (p * L * L).sum(-1) - (p * L).sum(-1) ** 2
    assert_close(dro_math.dro_d2tau(mean_z, mean_z2, tau), var / tau**3, 1e-10, "Var/tau^3")


def test_ts_ce_is_cross_entropy_of_scaled_logits():
    logits, target, tau = _inputs(2)
    out = temperature_scaled_cross_entropy(logits, target, tau, vocab_size=7)
    scaled = logits[..., :7] / tau[..., None]
    expected = F.cross_entropy(scaled.reshape(-1, 7), target.reshape(-1), reduction="none")
    assert_close(out, expected.view(3, 2), 1e-13)


def test_extreme_logits_and_tiny_tau_float32():
    gen = torch.Generator().manual_seed(5)
    logits = (torch.rand(4, 3, 300, generator=gen) * 2 - 1) * 1e4
    logits[0, 0, 7] = 1e4
    target = torch.randint(0, 300, (4, 3), generator=gen)
    tau = torch.full((4, 3), 1e-3, requires_grad=True)
    L = logits.clone().requires_grad_()
    out = vocab_parallel_dro_loss(L, target, tau, rho=10.0, vocab_size=300)
    out.sum().backward()
    L64 = logits.double().requires_grad_()
    tau64 = tau.detach().double().requires_grad_()
    ref = dro_reference(L64, target, tau64, 10.0)
    ref.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(L.grad).all()
    assert_close(out, ref, 1e-6, "loss")
    assert_close(L.grad, L64.grad, 1e-4, "grad logits")
    assert_close(tau.grad, tau64.grad, 1e-4, "grad tau")
    dense = dro_loss(logits, target, tau.detach(), rho=10.0)
    assert torch.isfinite(dense).all()
    assert_close(dense, ref, 1e-6, "dense loss")


def test_inplace_overwrites_logits_and_keeps_results():
    logits, target, tau = _inputs(6)
    expected = dro_reference(logits.detach(), target, tau.detach(), 3.0, 7)
    buf = logits.detach().clone().requires_grad_()
    work = buf * 1.0  # non-leaf, like the output of the output layer
    out = vocab_parallel_dro_loss(work, target, tau.detach(), rho=3.0, vocab_size=7, inplace=True)
    assert_close(out, expected, 1e-13)
    assert not torch.equal(work.detach(), buf.detach())  # the buffer now holds exp(z)
    out.sum().backward()
    ref_logits = logits.detach().clone().requires_grad_()
    dro_reference(ref_logits, target, tau.detach(), 3.0, 7).sum().backward()
    assert_close(buf.grad, ref_logits.grad, 1e-12)


def test_bad_arguments_are_named():
    L = torch.randn(2, 3, 10)
    t = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"vocab_size \(11\)"):
        vocab_parallel_dro_loss(L, t, 1.0, rho=1.0, vocab_size=11)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_dro_loss(L, t[:, :2], 1.0, rho=1.0, vocab_size=10)
    with pytest.raises(ValueError, match=r"rho \(-1"):
        vocab_parallel_dro_loss(L, t, 1.0, rho=-1.0, vocab_size=10)
    with pytest.raises(ValueError, match=r"tau \(0"):
        vocab_parallel_dro_loss(L, t, 0.0, rho=1.0, vocab_size=10)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 8\)"):
        dro_loss(L, t + 9, 1.0, rho=1.0, vocab_size=8)
