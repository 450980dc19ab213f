"""CLIPTrainModule's five losses over several steps against float64 references written here:
per-anchor values, the moving-average state, iSogCLR's per-sample tau update, TempNet's
objective, and the gradients reaching the features."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_tempnet.models.clip.config import CLIPLossConfig
from megatron_tempnet.models.clip.objective import CLIPTrainModule

N, D = 6, 5


class FakeTowers(nn.Module):
    """Stands in for the towers: the features are parameters (random, unnormalised)."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.config = SimpleNamespace(embed_dim=D)
        self.image = nn.Parameter(torch.randn(N, D, generator=gen))
        self.text = nn.Parameter(torch.randn(N, D, generator=gen))

    def forward(self, images, tokens, lengths):
        return self.image * 1.0, self.text * 1.0


def _reference_side(sim, tau, s, b, seen, gamma, rho):
    """One side of the robust loss for anchor rows of ``sim [n, n]`` (positives on the
    diagonal), float64 loops: (loss_i with gradient, tau_grad_i, s_i, b_i)."""
    n = sim.shape[0]
    losses, grads, s_new, b_new = [], [], [], []
    for i in range(n):
        d = [sim[i, j] - sim[i, i] for j in range(n) if j != i]
        z = [float(x.detach()) / tau[i] for x in d]
        bi = max(max(z), b[i]) if seen[i] else max(z)
        g = sum(math.exp(v - bi) for v in z)
        si = (1 - gamma) * s[i] * math.exp(b[i] - bi) + gamma * g if seen[i] else g
        w = [math.exp(v - bi) / si for v in z]
        losses.append(sum(wj * dj for wj, dj in zip(w, d)))
        weighted = sum(wj * float(dj.detach()) for wj, dj in zip(w, d))
        grads.append(math.log(si / (n - 1)) + bi + rho - weighted / tau[i])
        s_new.append(si), b_new.append(bi)
    return torch.stack(losses), grads, s_new, b_new


def _reference_info_nce(sim, tau):
    return torch.stack([-torch.log_softmax(sim[i] / tau[i], dim=0)[i] for i in range(sim.shape[0])])


def _features(towers):
    img = nn.functional.normalize(towers.image.detach().double(), dim=1).requires_grad_()
    txt = nn.functional.normalize(towers.text.detach().double(), dim=1).requires_grad_()
    return img, txt


ISOGCLR = dict(isogclr_tau_lr=0.004, isogclr_tau_beta=0.5, isogclr_grad_clip=1.5)


@pytest.mark.parametrize("loss", ["sogclr", "isogclr", "tempnet"])
def test_robust_losses_over_five_epochs(loss):
    """Each step is an epoch (every sample is an anchor): iSogCLR's update as published (a
    moving average, beta 0.5, of the tau-gradient clipped at 1.5 here so that the clip acts)."""
    cfg = CLIPLossConfig(clip_loss=loss, tau_init=0.03, rho=2.0, gamma=0.7, **ISOGCLR)
    cfg.tempnet.tempnet_proj_size = 4
    torch.manual_seed(0)
    module = CLIPTrainModule(FakeTowers(1), cfg)
    k = len(cfg.state_fields)
    state, seen = torch.zeros(N, k), torch.zeros(N, dtype=torch.bool)
    ref = {f: [0.0] * N for f in cfg.state_fields}
    clipped = 0
    for step in range(5):
        with torch.no_grad():  # move the features so every step differs
            module.clip.image.add_(0.3 * torch.randn(N, D))
        module.zero_grad()
        out = module(None, None, None, state, seen)
        out.loss.sum().backward()
        img, txt = _features(module.clip)
        model_terms, objective, tempnet_terms = [], [], []
        for side, (a, c) in (("image", (img, txt)), ("text", (txt, img))):
            if loss == "tempnet":
                tau = module.tempnets[side](a.detach().float()).double().tolist()
            elif loss == "isogclr":
                tau = [ref[f"tau_{side}"][i] if step else 0.03 for i in range(N)]
            else:
                tau = [0.03] * N
            side_loss, tau_grad, s_new, b_new = _reference_side(
                a @ c.t(), tau, ref[f"s_{side}"], ref[f"b_{side}"], [step > 0] * N, 0.7, 2.0
            )
            model_terms.append(side_loss)
            extra = torch.tensor(tau_grad) * torch.tensor(tau) if loss == "tempnet" else 0.0
            objective.append(side_loss.detach() + extra)
            ref[f"s_{side}"], ref[f"b_{side}"] = s_new, b_new
            if loss == "isogclr":  # u <- 0.5 u + 0.5 clip(g); tau <- [tau - eta u]
                clipped += sum(abs(g) > 1.5 for g in tau_grad)
                u = [
                    0.5 * u + 0.5 * min(max(g, -1.5), 1.5)
                    for u, g in zip(ref[f"u_{side}"], tau_grad)
                ]
                ref[f"u_{side}"] = u
                ref[f"tau_{side}"] = [min(max(t - 0.004 * v, 0.005), 0.05) for t, v in zip(tau, u)]
            if loss == "tempnet":  # TempNet's gradient: that of sum_i tau_grad_i * tau_i
                tempnet_terms.append((side, a.detach().float(), torch.tensor(tau_grad)))
            torch.testing.assert_close(
                out.tau[:N] if side == "image" else out.tau[N:],
                torch.tensor(tau, dtype=torch.float32),
            )
        torch.testing.assert_close(out.loss.double(), torch.cat(objective), rtol=1e-4, atol=1e-5)
        torch.cat(model_terms).sum().backward()
        torch.testing.assert_close(
            module.clip.image.grad.double(),
            _chain(module.clip.image, img.grad),
            rtol=1e-3,
            atol=1e-5,
        )
        for side, e, tau_grad in tempnet_terms:
            net = module.tempnets[side]
            got = [p.grad.clone() for p in net.parameters()]
            expected = torch.autograd.grad(
                (tau_grad.float() * net(e)).sum(), list(net.parameters())
            )
            for g, r in zip(got, expected):
                torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-6)
        for i, f in enumerate(cfg.state_fields):
            expected_state = torch.tensor(ref[f], dtype=torch.float64)
            torch.testing.assert_close(
                out.state[:, i].double(), expected_state, rtol=1e-4, atol=1e-6
            )
        state, seen = out.state, torch.ones(N, dtype=torch.bool)
    if loss == "isogclr":  # the clip and the bounds were exercised
        assert clipped > 0
        taus = torch.tensor(ref["tau_image"] + ref["tau_text"])
        assert (taus == 0.005).any() or (taus == 0.05).any() or taus.std() > 1e-3


def test_isogclr_with_beta_1_and_no_clip_is_the_plain_projected_step():
    """beta 1, no clipping: ``clamp(tau - eta g, min, max)`` bit for bit, from the robust
    loss's own tau-gradient."""
    from megatron_tempnet.losses.contrastive import robust_contrastive_side

    plain = dict(isogclr_tau_lr=0.02, isogclr_tau_beta=1.0, isogclr_grad_clip=0.0)
    cfg = CLIPLossConfig(clip_loss="isogclr", tau_init=0.03, rho=2.0, gamma=0.7, **plain)
    torch.manual_seed(0)
    module = CLIPTrainModule(FakeTowers(3), cfg)
    column = {f: i for i, f in enumerate(cfg.state_fields)}
    state = torch.rand(N, len(cfg.state_fields)) * 0.04 + 0.006
    state[:, column["u_image"]] = 100.0  # the old average has no weight
    seen = torch.ones(N, dtype=torch.bool)
    out = module(None, None, None, state, seen)
    towers = module.clip
    img, txt = (nn.functional.normalize(f.detach(), dim=1) for f in (towers.image, towers.text))
    side = robust_contrastive_side(
        img @ txt.t(),
        torch.arange(N),
        state[:, column["tau_image"]],
        state[:, column["s_image"]],
        state[:, column["b_image"]],
        seen,
        gamma=0.7,
        rho=2.0,
    )
    tau = state[:, column["tau_image"]]
    expected = (tau - 0.02 * side.tau_grad).clamp(0.005, 0.05)
    assert torch.equal(out.state[:, column["tau_image"]], expected)
    assert torch.equal(out.state[:, column["u_image"]], side.tau_grad)


def _chain(raw: torch.Tensor, grad_normalised: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. the raw features from the gradient w.r.t. their normalised rows."""
    x = raw.detach().double().requires_grad_()
    nn.functional.normalize(x, dim=1).backward(grad_normalised)
    return x.grad


@pytest.mark.parametrize("loss", ["clip", "tau"])
def test_info_nce_losses(loss):
    cfg = CLIPLossConfig(clip_loss=loss, tau_init=0.05)
    torch.manual_seed(0)
    module = CLIPTrainModule(FakeTowers(2), cfg)
    out = module(None, None, None)
    out.loss.sum().backward()
    img, txt = _features(module.clip)
    if loss == "clip":
        tau_i = tau_t = [0.05] * N  # exp(log 0.05), inside the tau range
    else:  # TaU: tau = tau_init / sigmoid(a), a from a linear head on the embedding
        head_i, head_t = module.tau_heads["image"].linear, module.tau_heads["text"].linear
        # the head reads the embedding with its gradient (TaU), unlike TempNet
        a_i = (img @ head_i.weight.double().t() + head_i.bias.double())[:, 0]
        a_t = (txt @ head_t.weight.double().t() + head_t.bias.double())[:, 0]
        tau_i, tau_t = 0.05 / torch.sigmoid(a_i), 0.05 / torch.sigmoid(a_t)
        torch.testing.assert_close(out.uncertainty.double(), torch.cat([-a_i, -a_t]).detach())
    expected = torch.cat(
        [_reference_info_nce(img @ txt.t(), tau_i), _reference_info_nce(txt @ img.t(), tau_t)]
    )
    torch.testing.assert_close(out.loss.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    expected.sum().backward()
    torch.testing.assert_close(
        module.clip.text.grad.double(), _chain(module.clip.text, txt.grad), rtol=1e-4, atol=1e-6
    )
    if loss == "clip":  # d loss / d log tau = sum over anchors of d loss / d tau * tau
        t = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
        ref = torch.cat(
            [
                _reference_info_nce(img.detach() @ txt.detach().t(), [t] * N),
                _reference_info_nce(txt.detach() @ img.detach().t(), [t] * N),
            ]
        )
        (g,) = torch.autograd.grad(ref.sum(), t)
        assert float(module.log_tau.grad) == pytest.approx(float(g) * 0.05, rel=1e-4)
