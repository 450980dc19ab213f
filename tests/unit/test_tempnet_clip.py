"""TempNetCLIP: docs/design.md §2's formula in float64, init, range, stop-gradient, prototypes."""

from __future__ import annotations

import pytest
import torch

from megatron_tempnet.tempnet.clip import TempNetCLIP


def reference_tau(net: TempNetCLIP, e: torch.Tensor) -> torch.Tensor:
    p = {k: v.double() for k, v in net.state_dict().items()}
    v = torch.sigmoid(e.double() @ p["weight1"].T + p["bias1"])
    w2 = p["prototypes"] / p["prototypes"].norm(dim=0, keepdim=True)
    u = v @ w2
    phi = p["pooling.log_phi"].exp()
    attention = torch.softmax(u / phi, dim=1) - 1.0 / u.shape[1]
    s = (attention * p["pooling.w3"] * u).sum(1) - p["pooling.bias"]
    return (net.tau_max - net.tau_min) * torch.sigmoid(s) + net.tau_min


def _embeddings(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)


def test_formula_init_and_parameter_count():
    torch.manual_seed(0)
    net = TempNetCLIP(256)
    assert sum(p.numel() for p in net.parameters()) == 256 * 256 + 256 + 256 * 256 + 256 + 2
    assert torch.equal(net.pooling.w3, torch.ones(256)) and net.pooling.bias.item() == 0
    assert net.pooling.log_phi.exp().item() == pytest.approx(0.01)
    net.init_prototypes(_embeddings(256, 256, 1))
    torch.testing.assert_close(net.prototypes.t(), _embeddings(256, 256, 1))
    e = _embeddings(10, 256, 2)
    tau = net(e)
    torch.testing.assert_close(tau.double(), reference_tau(net, e), rtol=1e-6, atol=1e-9)
    assert ((tau >= 0.001) & (tau <= 0.05)).all() and tau.std() > 0


def test_stop_gradient_and_learning_signal():
    net = TempNetCLIP(8, hidden_size=8, proj_size=4)
    e = _embeddings(5, 8, 3).requires_grad_(True)
    (net(e) * torch.arange(5.0)).sum().backward()
    assert e.grad is None  # the embedding is a stop-gradient input
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_prototype_shape_is_checked():
    net = TempNetCLIP(16, hidden_size=8, proj_size=4)
    with pytest.raises(ValueError, match="hidden size must equal the embedding size"):
        net.init_prototypes(_embeddings(4, 16, 0))
