"""The contrastive losses against float64 references written with plain loops from docs/design.md
§2: per-step values, the moving-average state across steps, the tau-gradient estimate, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tempnet.losses.contrastive import info_nce, robust_contrastive_side, tempnet_loss


def reference_side(sim, positive, tau, s, b, seen, gamma, rho):
    """Loops over anchors and negatives, in float64."""
    n, B = sim.shape
    out = {"loss": [], "tau_grad": [], "s": [], "b": [], "w": []}
    for i in range(n):
        p = int(positive[i])
        d = [float(sim[i, j] - sim[i, p]) for j in range(B)]
        negs = [j for j in range(B) if j != p]
        t = float(tau[i])
        top = max(d[j] / t for j in negs)
        b_new = max(float(b[i]), top) if seen[i] else top
        g = sum(math.exp(d[j] / t - b_new) for j in negs)
        if seen[i]:
            s_new = (1 - gamma) * float(s[i]) * math.exp(float(b[i]) - b_new) + gamma * g
        else:
            s_new = g
        w = [0.0 if j == p else math.exp(d[j] / t - b_new) / s_new for j in range(B)]
        weighted = sum(w[j] * d[j] for j in range(B))
        out["loss"].append(weighted)
        out["tau_grad"].append(math.log(s_new / (B - 1)) + b_new + rho - weighted / t)
        out["s"].append(s_new)
        out["b"].append(b_new)
        out["w"].append(w)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def _features(n: int, d: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=1)


@pytest.mark.parametrize("tau_value", [0.01, 0.05, 1.0])
def test_robust_side_matches_the_reference_over_steps(tau_value):
    n, B, gamma, rho = 4, 8, 0.8, 6.5
    positive = torch.tensor([1, 3, 4, 6])
    tau = torch.tensor([tau_value, tau_value * 0.5, tau_value * 2, tau_value])
    s, b = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    seen = torch.zeros(n, dtype=torch.bool)
    for step in range(3):  # the first visit, then the moving average
        anchors, candidates = _features(n, 16, step), _features(B, 16, 10 + step)
        sim = (anchors @ candidates.t()).requires_grad_(True)
        got = robust_contrastive_side(sim, positive, tau, s, b, seen, gamma=gamma, rho=rho)
        want = reference_side(sim.detach(), positive, tau, s, b, seen, gamma, rho)
        for key in ("loss", "tau_grad", "s", "b"):
            torch.testing.assert_close(
                getattr(got, key).detach(), want[key], rtol=1e-12, atol=1e-12
            )
        got.loss.sum().backward()  # d loss_i / d s_ij = w_ij (j != i), -sum_j w_ij at the positive
        grad = want["w"].clone()
        grad[torch.arange(n), positive] = -want["w"].sum(1)
        torch.testing.assert_close(sim.grad, grad, rtol=1e-12, atol=1e-12)
        s, b, seen = got.s, got.b, torch.ones(n, dtype=torch.bool)


def test_tau_gradient_estimate_is_the_derivative_of_the_robust_loss():
    """With gamma = 1 the estimate is exact: d/dtau [tau log(1/(B-1) sum_j exp(d_ij/tau)) +
    tau rho], by central finite differences in float64."""
    n, B, rho = 3, 9, 2.0
    sim = _features(n, 8, 1) @ _features(B, 8, 2).t()
    positive, tau = torch.tensor([0, 4, 8]), torch.tensor([0.05, 0.2, 0.7], dtype=torch.float64)

    def robust(t):
        d = sim - sim.gather(1, positive[:, None])
        mask = torch.ones_like(d, dtype=torch.bool)
        mask[torch.arange(n), positive] = False
        lse = torch.logsumexp((d / t[:, None]).masked_fill(~mask, -torch.inf), dim=1)
        return t * (lse - math.log(B - 1)) + t * rho

    zeros, unseen = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.bool)
    got = robust_contrastive_side(sim, positive, tau, zeros, zeros, unseen, gamma=1.0, rho=rho)
    h = 1e-6
    numeric = (robust(tau + h) - robust(tau - h)) / (2 * h)
    torch.testing.assert_close(got.tau_grad, numeric, rtol=1e-6, atol=1e-8)
    tau_param = tau.clone().requires_grad_(True)
    tempnet_loss(tau_param, got.tau_grad).sum().backward()
    torch.testing.assert_close(tau_param.grad, numeric, rtol=1e-6, atol=1e-8)


def test_info_nce_matches_the_reference_and_its_gradients():
    n, B = 4, 6
    sim = (_features(n, 8, 3) @ _features(B, 8, 4).t()).requires_grad_(True)
    positive = torch.tensor([0, 2, 3, 5])
    tau = torch.tensor([0.07, 0.1, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    got = info_nce(sim, positive, tau)
    want = [
        -math.log(
            math.exp(sim[i, positive[i]].item() / tau[i].item())
            / sum(math.exp(sim[i, j].item() / tau[i].item()) for j in range(B))
        )
        for i in range(n)
    ]
    torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda x, t: info_nce(x, positive, t), (sim, tau))


def test_bad_shapes_and_gamma_are_refused():
    sim = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        robust_contrastive_side(
            sim,
            torch.tensor([0, 1]),
            torch.ones(2),
            torch.zeros(2),
            torch.zeros(2),
            torch.zeros(2, dtype=torch.bool),
            gamma=0.0,
            rho=1.0,
        )
    with pytest.raises(ValueError, match="positive and tau"):
        info_nce(sim, torch.tensor([0]), torch.ones(2))
    with pytest.raises(ValueError, match=">= 2 candidates"):
        info_nce(torch.zeros(2, 1), torch.tensor([0, 0]), torch.ones(2))
