"""The output stage's logit passes compiled (torch.compile, inductor's C++ backend here) against
float64 references and against the eager passes, alone and through the whole fused stage; a
failing compiler leaves the eager passes, with one warning.

The suite runs the passes eager (tests/conftest.py sets ``MEGATRON_TEMPNET_COMPILE=0``); these
tests turn the compiled ones on.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tempnet.losses import TempNetTau, fused_output_stage, logit_passes
from megatron_tempnet.tempnet import TempNetLM


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setenv(logit_passes.ENV, "1")
    if logit_passes.compiler_missing(False) is not None:
        pytest.skip("no C++ compiler for torch.compile")
    assert logit_passes._Pass.failed is None


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setenv(logit_passes.ENV, "0")


def _logits(rows=37, cols=1000, seed=0):
    """float32 logits around 500 with tau from 1e-3 to 2, each row's spread ~5 tau (no softmax
    is one-hot: dividing before subtracting would lose the differences near the maximum)."""
    gen = torch.Generator().manual_seed(seed)
    tau = torch.logspace(-3, 0.3, rows)[torch.randperm(rows, generator=gen)]
    logits = 500.0 + torch.randn(rows, cols, generator=gen) * 5.0 * tau[:, None]
    return logits, tau


def _reference_sums(logits, tau):
    """float64: row maximum, squared norm, S at tau = 1, S and Q at tau."""
    x = logits.double()
    row_max = x.amax(dim=1)
    z = (x - row_max[:, None]) / tau.double()[:, None]
    e = z.exp()
    return row_max, (x * x).sum(1), (x - row_max[:, None]).exp().sum(1), e.sum(1), (e * z).sum(1)


def _passes(logits, tau):
    row_max, norm_sq = logit_passes.row_stats(logits, need_norm=True)
    sums = logit_passes.exp_sums(logits, row_max, tau, at_tau=True, need_q=True)
    scale = torch.linspace(0.5, 1.5, logits.shape[0])
    coef = torch.linspace(-0.1, 0.1, logits.shape[0])
    grad = logit_passes.tempered_softmax_(logits.clone(), row_max, tau, scale, coef)
    return (row_max, norm_sq, *sums), grad


def test_compiled_passes_equal_the_float64_sums_and_the_eager_passes(compiled, monkeypatch):
    logits, tau = _logits()
    reference = _reference_sums(logits, tau)
    results = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(logit_passes.ENV, mode)
        assert logit_passes.compiled_passes(logits) == (mode == "1")
        results[mode] = _passes(logits, tau)
    assert logit_passes._exp_sums.proven and logit_passes._softmax.proven  # compiled, ran
    (sums, grad), (eager_sums, eager_grad) = results["1"], results["0"]
    for got, want, ref in zip(sums, eager_sums, reference):  # S >= 1; Q <= 0, ~0 at tau 1e-3
        torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    x, row_max = logits.double(), reference[0]
    scale, coef = torch.linspace(0.5, 1.5, 37).double(), torch.linspace(-0.1, 0.1, 37).double()
    want = ((x - row_max[:, None]) / tau.double()[:, None]).exp() * scale[:, None]
    want += coef[:, None] * x
    torch.testing.assert_close(grad.double(), want, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(grad, eager_grad, rtol=2e-5, atol=1e-6)


def _stage(stop_grad: bool):
    """The fused stage with TempNet and the DRO loss, float32: its values and every gradient."""
    torch.manual_seed(0)
    net = TempNetLM(300, hidden_size=16, proj_size=8, padded_vocab_size=320, stop_grad=stop_grad)
    weight = (torch.randn(320, 24) * 0.5).requires_grad_()
    hidden = torch.randn(50, 24, requires_grad=True)
    target = torch.randint(0, 300, (50,))
    out = fused_output_stage(
        hidden, weight, target, loss="dro", rho=2.0, vocab_size=300, tau=TempNetTau(net),
        chunk_size=16,
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss.mean(), [hidden, weight, *net.parameters()])
    return [out.loss, out.ce, out.tau, *grads]


@pytest.mark.parametrize("stop_grad", [True, False])
def test_the_fused_stage_compiled_equals_it_eager(compiled, monkeypatch, stop_grad):
    """Every value and gradient within float32 rounding (``stop_grad=False``: the softmax pass
    with TempNet's term on the logits)."""
    fused = _stage(stop_grad)
    assert logit_passes._row_stats.proven and logit_passes._softmax.proven
    monkeypatch.setenv(logit_passes.ENV, "0")
    for got, want in zip(fused, _stage(stop_grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_failing_compiler_leaves_the_eager_passes_with_one_warning(
    compiled, monkeypatch, tmp_path, caplog
):
    from torch._inductor import config as inductor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing compiled is reused
    monkeypatch.setattr(logit_passes._Pass, "failed", None)  # restored afterwards
    fresh = logit_passes._Pass(logit_passes._fused_exp_sums, logit_passes._eager_exp_sums)
    logits, tau = _logits(rows=5, cols=64)
    row_max = logits.amax(dim=1)
    torch._dynamo.reset()
    try:
        with inductor.patch({"cpp.cxx": (None, "false")}), caplog.at_level("WARNING"):
            got = fresh(logits, row_max, tau, True, True)
    finally:
        torch._dynamo.reset()
    want = logit_passes._eager_exp_sums(logits, row_max, tau, True, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert logit_passes._Pass.failed is not None and not logit_passes.compiled_passes(logits)
    [line] = [r.getMessage() for r in caplog.records if "logit passes" in r.getMessage()]
    assert line.startswith("torch.compile failed on the output stage's logit passes (")
