"""The training objective: every --loss / --tau-source pair against float64 references."""

from __future__ import annotations

import pytest
import torch

from megatron_tempnet.losses import dro_loss, optimal_tau
from megatron_tempnet.models.gpt.objective import (
    LOSSES,
    TAU_SOURCES,
    LossConfig,
    LossConfigError,
    masked_mean,
    token_losses_from_logits,
)
from megatron_tempnet.tempnet import TempNetConfig, TempNetLM

V, PAD = 50, 64


def _ce(logits, labels, tau):
    """Cross-entropy of L / tau over the true vocabulary, float64."""
    z = logits.double()[..., :V] / tau.double()[..., None]
    return torch.logsumexp(z, -1) - z.gather(-1, labels[..., None]).squeeze(-1)


VALID = [
    (loss, src) for loss in LOSSES for src in TAU_SOURCES if not (loss == "ce" and src == "tempnet")
]


@pytest.mark.parametrize("loss,source", VALID)
def test_every_combination_matches_its_reference(loss, source):
    torch.manual_seed(0)
    cfg = LossConfig(
        loss=loss, tau_source=source, fixed_tau=0.7, rho=2.0, tempnet=TempNetConfig(tau_min=0.05)
    )
    cfg.validate()
    logits = (torch.randn(2, 6, PAD) * 3).requires_grad_()
    labels = torch.randint(0, V, (2, 6))
    net = TempNetLM(V, hidden_size=8, proj_size=8, padded_vocab_size=PAD, tau_min=0.05)
    out = token_losses_from_logits(logits, labels, cfg, vocab_size=V, tempnet=net)
    if source == "tempnet":
        tau = net(logits).detach()
    elif source == "newton":
        tau = optimal_tau(logits.detach(), rho=2.0, tau_min=0.05, vocab_size=V)
    else:
        tau = torch.full((2, 6), 0.7)
    torch.testing.assert_close(out.tau, tau)
    expected = {
        "dro": lambda: dro_loss(
            logits.detach().double(), labels, tau.double(), rho=2.0, vocab_size=V
        ),
        "ts-ce": lambda: _ce(logits.detach(), labels, tau),
        "ce": lambda: _ce(logits.detach(), labels, torch.ones(2, 6)),
    }[loss]()
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        out.ce.double(), _ce(logits.detach(), labels, torch.ones(2, 6)), rtol=1e-5, atol=1e-5
    )
    mask = torch.ones(2, 6)
    mask[1, 3:] = 0
    total = masked_mean(out.loss, mask, mask.sum())
    total.backward()
    assert logits.grad is not None and float(logits.grad[1, 3:].abs().max()) == 0
    trains_tempnet = source == "tempnet"
    assert (net.weight2.grad is not None) == trains_tempnet


def test_configuration_errors_name_the_flags():
    for kw, message in [
        ({"loss": "mse"}, "--loss 'mse'"),
        ({"tau_source": "magic"}, "--tau-source 'magic'"),
        (
            {"tempnet": TempNetConfig(tau_min=0.5, tau_max=0.3)},
            r"--tempnet-tau-min \(0.5\) must be > 0 and <",
        ),
        ({"rho": -1.0}, r"--tempnet-rho \(-1.0\)"),
        ({"loss": "ce", "tau_source": "tempnet"}, "TempNet would get no gradient"),
        ({"tau_source": "newton", "rho": 0.0}, "needs --tempnet-rho > 0"),
        (
            {"tau_source": "fixed", "tempnet": TempNetConfig(stop_grad=False)},
            "--no-tempnet-stop-grad needs",
        ),
        ({"tau_source": "fixed", "fixed_tau": 0.0}, r"--fixed-tau \(0.0\)"),
        ({"tempnet_dropout": 1.0}, r"--tempnet-dropout \(1.0\) must be in \[0, 1\)"),
    ]:
        with pytest.raises(LossConfigError, match=message):
            LossConfig(**kw).validate()


@pytest.mark.parametrize("loss", LOSSES)
def test_evaluation_reports_the_t_llm_term(loss):
    """Under no_grad (evaluation) the cross-entropy of L / tau comes with the losses."""
    torch.manual_seed(1)
    source = "fixed" if loss == "ce" else "tempnet"
    cfg = LossConfig(
        loss=loss, tau_source=source, fixed_tau=0.6, rho=2.0, tempnet=TempNetConfig(tau_min=0.05)
    )
    logits = torch.randn(2, 5, PAD) * 2
    labels = torch.randint(0, V, (2, 5))
    net = TempNetLM(V, hidden_size=8, proj_size=8, padded_vocab_size=PAD, tau_min=0.05).eval()
    with torch.no_grad():
        out = token_losses_from_logits(logits, labels, cfg, vocab_size=V, tempnet=net)
    tau = net(logits) if source == "tempnet" else torch.full((2, 5), 0.6)
    torch.testing.assert_close(out.ts_ce.double(), _ce(logits, labels, tau), rtol=1e-5, atol=1e-6)
    assert token_losses_from_logits(logits, labels, cfg, vocab_size=V, tempnet=net).ts_ce is None


def test_saved_loss_settings_read_the_nested_and_the_flat_layout():
    """A run's saved ``loss`` section holds TempNet's settings in ``tempnet``; the checkpoint
    fixture of format 1 has them flat: both read the same."""
    import dataclasses
    import json
    import pathlib

    from megatron_tempnet.tempnet.config import saved_loss_settings

    fixture = pathlib.Path(__file__).parents[1] / "fixtures/checkpoint_v1/train/config.json"
    flat = json.loads(fixture.read_text())["loss"]
    tempnet = TempNetConfig(
        tempnet_hidden_size=8, tempnet_proj_size=8, tempnet_lr=1e-3, tempnet_weight_decay=0.1
    )
    nested = dataclasses.asdict(LossConfig(rho=4.0, output_stage_chunk_size=24, tempnet=tempnet))
    assert nested["tempnet"]["tau_min"] == 0.001 and "tau_min" not in nested
    now, before = saved_loss_settings(nested), saved_loss_settings(flat)
    assert "tempnet" not in now and before == flat
    assert {k: now[k] for k in flat} == flat
