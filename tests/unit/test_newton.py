"""optimal_tau (Appendix B): convergence, bounds and agreement with a generic minimiser."""

import math

import pytest
import torch
from scipy.optimize import minimize_scalar

from megatron_tempnet.losses import dro_loss, optimal_tau
from tests.helpers.reference import dro_dtau_reference


def _logits(kind: str, seed: int, tokens=64, vocab=500):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, vocab, generator=gen, dtype=torch.float64)
    if kind == "random":
        return base * torch.rand(tokens, 1, generator=gen, dtype=torch.float64) * 5
    # peaked: one or a few dominant logits per token, with a spread of margins
    peak = torch.zeros_like(base)
    idx = torch.randint(0, vocab, (tokens, 3), generator=gen)
    margins = torch.rand(tokens, 3, generator=gen, dtype=torch.float64) * 40
    peak.scatter_(1, idx, margins)
    return base + peak


@pytest.mark.parametrize("kind", ["random", "peaked"])
@pytest.mark.parametrize("rho", [2.0, 5.0, 10.0])
def test_converges_or_stops_on_bound_within_30_iterations(kind, rho):
    logits = _logits(kind, seed=int(rho), tokens=48, vocab=32000)  # log|C| = 10.37
    tau_min = 1e-3
    tau = optimal_tau(logits, rho=rho, tau_min=tau_min, vocab_size=32000, max_iter=30, tol=1e-7)
    g = dro_dtau_reference(logits, tau, rho)
    at_bound = (tau == tau_min) & (g >= 0)
    interior = ~at_bound
    assert interior.any()
    assert float(g[interior].abs().max()) < 1e-6
    assert (tau >= tau_min).all()


def test_matches_a_generic_bounded_minimiser():
    logits = _logits("peaked", seed=7, tokens=6, vocab=50)
    target = torch.zeros(6, dtype=torch.long)
    rho, tau_min = 3.0, 0.01
    tau = optimal_tau(logits, rho=rho, tau_min=tau_min, vocab_size=50)
    for i in range(6):

        def f(t, i=i):
            return float(dro_loss(logits[i], target[i], float(t), rho=rho))

        res = minimize_scalar(
            f, bounds=(tau_min, 100.0), method="bounded", options={"xatol": 1e-12}
        )
        best = min([res.x, tau_min], key=f)
        assert f(float(tau[i])) <= f(best) + 1e-12
        assert float(tau[i]) == pytest.approx(best, rel=1e-4, abs=1e-8)


def test_bounds_are_projections():
    # Constant logits: f = tau * rho is minimised at tau_min.
    flat = torch.zeros(3, 40, dtype=torch.float64)
    assert torch.equal(
        optimal_tau(flat, rho=1.0, tau_min=0.02, vocab_size=40),
        torch.full((3,), 0.02, dtype=torch.float64),
    )
    # rho >= log|C|: df/dtau > 0 everywhere, so tau_min again.
    logits = _logits("random", seed=3, tokens=8, vocab=40)
    tau = optimal_tau(logits, rho=math.log(40) + 0.01, tau_min=0.05, vocab_size=40)
    assert torch.all(tau == 0.05)
    # rho = 0: f decreases for all tau; only an upper bound gives a minimiser.
    with pytest.raises(ValueError, match="no finite minimiser"):
        optimal_tau(logits, rho=0.0, tau_min=0.05, vocab_size=40)
    tau = optimal_tau(logits, rho=0.0, tau_min=0.05, vocab_size=40, tau_max=3.0)
    assert torch.all(tau == 3.0)


def test_padding_is_ignored():
    logits = _logits("random", seed=11, tokens=10, vocab=60)
    padded = torch.cat([logits, torch.full((10, 4), 1e3, dtype=torch.float64)], dim=1)
    a = optimal_tau(logits, rho=4.0, tau_min=1e-3, vocab_size=60)
    b = optimal_tau(padded, rho=4.0, tau_min=1e-3, vocab_size=60)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_float32_input_returns_float32_shape():
    logits = _logits("random", seed=2, tokens=12, vocab=30).float().view(3, 4, 30)
    tau = optimal_tau(logits, rho=2.0, tau_min=1e-3, vocab_size=30)
    assert tau.shape == (3, 4) and tau.dtype == torch.float32


def test_each_tau_source_gives_its_tau():
    """``losses.tau_source``: a fixed value, Newton's minimiser (against scipy's on the dense
    loss, with padded columns ignored) and TempNet's prediction; bad sources are refused."""
    from megatron_tempnet.losses import FixedTau, NewtonTau, TempNetTau, fused_output_stage
    from megatron_tempnet.tempnet import TempNetLM

    logits = _logits("random", seed=3, tokens=6, vocab=40)
    padded = torch.cat([logits, torch.full((6, 8), 50.0, dtype=torch.float64)], dim=1)
    fixed = FixedTau(0.7).tau_of(padded.float(), vocab_size=40)
    assert fixed.dtype == torch.float32 and torch.equal(fixed, torch.full((6,), 0.7))
    tau = NewtonTau(rho=2.0, tau_min=0.01, tau_max=3.0).tau_of(padded, vocab_size=40)
    for row, t in zip(logits, tau):

        def f(x, row=row):
            return float(dro_loss(row[None], torch.tensor([0]), x, rho=2.0))

        best = minimize_scalar(
            f,
            bounds=(0.01, 3.0),
            method="bounded",
            options={"xatol": 1e-10},
        ).x
        assert abs(float(t) - best) < 1e-5
    net = TempNetLM(40, hidden_size=8, proj_size=4, padded_vocab_size=48).double()
    assert torch.equal(TempNetTau(net).tau_of(padded, vocab_size=40), net(padded))
    with pytest.raises(ValueError, match=r"tau \(0\) must be > 0"):
        FixedTau(0)
    weight, hidden = torch.randn(48, 4), torch.randn(6, 4)
    with pytest.raises(TypeError, match="tau must be a TauSource"):
        fused_output_stage(hidden, weight, torch.zeros(6, dtype=torch.long), loss="ce",
                           vocab_size=40, tau=0.7)  # fmt: skip
