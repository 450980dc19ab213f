"""TempNetLM on one rank: the docs/design.md §2 formula, init, stop-gradient, range, checkpoints."""

import math

import pytest
import torch

from megatron_tempnet.tempnet import TempNetLM


def _reference_tau(net: TempNetLM, logits: torch.Tensor, tau_max: float) -> torch.Tensor:
    """docs/design.md §2 written out in float64 from the module's parameters."""
    sd = {k: v.double() for k, v in net.state_dict().items()}
    L = logits.double()[..., : net.vocab_size]
    Lbar = L / L.norm(dim=-1, keepdim=True)
    v = torch.sigmoid(Lbar @ sd["weight1"].T + sd["bias1"])
    u = v @ sd["weight2"].T
    phi = sd["pooling.log_phi"].exp()
    d2 = u.shape[-1]
    s = ((torch.softmax(u / phi, -1) - 1 / d2) * sd["pooling.w3"] * u).sum(-1) - sd["pooling.bias"]
    return (tau_max - net.tau_min) * torch.sigmoid(s) + net.tau_min


@pytest.mark.parametrize("vocab,expected", [(32000, 8_258_050), (50304, 12_943_874)])
def test_parameter_count_matches_table_13(vocab, expected):
    net = TempNetLM(vocab)
    d1 = d2 = 256
    assert vocab * d1 + d1 + d1 * d2 + d2 + 2 == expected
    assert sum(p.numel() for p in net.parameters()) == expected


def test_init_follows_appendix_d1():
    torch.manual_seed(0)
    net = TempNetLM(1000, hidden_size=64, proj_size=32)
    assert torch.equal(net.pooling.w3.detach(), torch.ones(32))
    assert float(net.pooling.bias.detach()) == 0.0
    assert float(net.pooling.log_phi.detach().exp()) == pytest.approx(1.0)
    bound = 1 / math.sqrt(1000)
    w1 = net.weight1.detach()
    assert float(w1.abs().max()) <= bound
    assert float(w1.abs().max()) > 0.9 * bound  # uniform over the full range
    assert float(net.weight2.detach().abs().max()) <= 1 / math.sqrt(64)


def test_forward_matches_reference_and_range():
    torch.manual_seed(1)
    net = TempNetLM(
        90, hidden_size=16, proj_size=8, tau_min=0.01, tau_max=1.5, padded_vocab_size=96
    ).double()
    with torch.no_grad():  # move off the init so every parameter matters
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    logits = torch.randn(5, 3, 96, dtype=torch.float64) * 4
    logits[..., 90:] = 1e6  # padding must not reach TempNet
    tau = net(logits)
    assert tau.shape == (5, 3)
    torch.testing.assert_close(tau, _reference_tau(net, logits, 1.5), rtol=1e-12, atol=0)
    assert float(tau.min()) >= 0.01 and float(tau.max()) <= 1.5
    net.eval()
    net.tau_max_eval = 1.2
    torch.testing.assert_close(net(logits), _reference_tau(net, logits, 1.2), rtol=1e-12, atol=0)
    net.train()
    torch.testing.assert_close(net(logits), tau, rtol=0, atol=0)


def test_input_carries_no_gradient_to_logits():
    net = TempNetLM(50, hidden_size=8, proj_size=8)
    logits = torch.randn(4, 2, 50, requires_grad=True)
    tau = net(logits)
    (grad,) = torch.autograd.grad(tau.sum(), [logits], allow_unused=True)
    assert grad is None
    tau = net(logits * 2.0)
    tau.sum().backward()
    assert logits.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())


def test_gradients_gradcheck():
    net = TempNetLM(20, hidden_size=6, proj_size=5, padded_vocab_size=24).double()
    logits = torch.randn(3, 2, 24, dtype=torch.float64)
    names = [n for n, _ in net.named_parameters()]

    def f(*values):
        return torch.func.functional_call(net, dict(zip(names, values)), (logits,))

    values = tuple(p.detach().clone().requires_grad_() for p in net.parameters())
    assert torch.autograd.gradcheck(f, values)


def test_state_dict_round_trip_and_shape_error():
    net = TempNetLM(40, hidden_size=8, proj_size=4)
    other = TempNetLM(40, hidden_size=8, proj_size=4)
    other.load_state_dict(net.state_dict())
    x = torch.randn(3, 40)
    torch.testing.assert_close(other(x), net(x), rtol=0, atol=0)
    wrong = TempNetLM(41, hidden_size=8, proj_size=4)
    with pytest.raises(RuntimeError, match=r"weight1: checkpoint has shape \(8, 40\)"):
        wrong.load_state_dict(net.state_dict())


def test_bad_configuration_is_named():
    with pytest.raises(ValueError, match=r"tau_min \(0.5\) must be < tau_max \(0.3\)"):
        TempNetLM(10, tau_min=0.5, tau_max=0.3)
    with pytest.raises(ValueError, match="expects 10 logits per rank"):
        TempNetLM(10)(torch.randn(2, 12))
    with pytest.raises(ValueError, match="padded_vocab_size"):
        TempNetLM(10, padded_vocab_size=8)


def test_without_stop_grad_the_logits_get_tau_s_gradient():
    """The ablation's input gradient equals autograd through the float64 reference formula."""
    net = TempNetLM(20, hidden_size=6, proj_size=5, padded_vocab_size=24, stop_grad=False)
    net = net.double()
    logits = torch.randn(3, 2, 24, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 2, dtype=torch.float64)
    (grad,) = torch.autograd.grad((net(logits) * weights).sum(), [logits])
    ref_logits = logits.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(
        (_reference_tau(net, ref_logits, net.tau_max) * weights).sum(), [ref_logits]
    )
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-14)
    assert float(grad[..., :20].abs().min()) > 0 and float(grad[..., 20:].abs().max()) == 0
    names = [n for n, _ in net.named_parameters()]

    def f(x, *values):
        return torch.func.functional_call(net, dict(zip(names, values)), (x,))

    values = tuple(p.detach().clone().requires_grad_() for p in net.parameters())
    assert torch.autograd.gradcheck(f, (logits.detach().clone().requires_grad_(), *values))


@pytest.mark.parametrize(
    "vocab,tp,padded,columns",
    [
        (32000, 2, 32000, [16000, 16000]),
        (32000, 4, 32256, [8064, 8064, 8064, 7808]),
        (128256, 1, 128256, [128256]),
        (128256, 2, 128256, [64128, 64128]),
        (128256, 4, 128512, [32128, 32128, 32128, 31872]),
    ],
)
def test_w1_is_split_like_the_logits_at_llama3_vocabulary(vocab, tp, padded, columns, monkeypatch):
    """LLaMA-3's 128256 tokens: the vocabulary is padded to a multiple of 128 x TP (none at TP 1
    and 2, 256 rows at TP 4), each rank's W1 holds the true columns of the output layer's rows
    on that rank (megatron-core's vocabulary range), and the parameters are Table 13's formula.
    Built on the meta device: no memory for the 33M-parameter W1."""
    from megatron.core.tensor_parallel.utils import VocabUtility

    from megatron_tempnet.distributed.groups import TPGroup
    from megatron_tempnet.models.transformer import padded_vocab_size
    from megatron_tempnet.tempnet import llm

    assert padded_vocab_size(vocab, 128, tp) == padded
    monkeypatch.setattr(llm, "resolve_tp_group", lambda group: group)  # a rank of a TP group
    d1 = d2 = 256
    replicated = d1 + d1 * d2 + d2 + 2  # b1, W2, w3, b, log phi
    w1_columns = []
    for rank in range(tp):
        with torch.device("meta"):
            net = llm.TempNetLM(vocab, tp_group=TPGroup(None, rank, tp), padded_vocab_size=padded)
        start, end = VocabUtility.vocab_range_from_global_vocab_size(padded, rank, tp)
        assert (net.part.start, net.part.end) == (start, end)
        assert net.weight1.shape == (d1, min(end, vocab) - start)
        assert sum(p.numel() for p in net.parameters()) == net.weight1.shape[1] * d1 + replicated
        w1_columns.append(net.weight1.shape[1])
    assert w1_columns == columns and sum(columns) == vocab
    with torch.device("meta"):
        whole = llm.TempNetLM(vocab, tp_group=TPGroup(None, 0, 1))
    expected = {32000: 8_258_050, 128256: 32_899_586}[vocab]
    assert sum(p.numel() for p in whole.parameters()) == vocab * d1 + replicated == expected


def test_dropout_acts_in_training_only_and_the_fused_stage_follows_the_module():
    """--tempnet-dropout: the fused output stage draws the same mask as TempNet's own forward
    (one chunk, same RNG state), so its tau and TempNet's gradients equal the unfused path's."""
    from megatron_tempnet.losses import (
        TempNetTau,
        fused_output_stage,
        temperature_scaled_cross_entropy,
    )

    torch.manual_seed(0)
    net = TempNetLM(40, hidden_size=16, proj_size=8, dropout=0.5).double()
    weight = torch.randn(40, 6, dtype=torch.float64)
    hidden = torch.randn(12, 6, dtype=torch.float64)
    target = torch.randint(0, 40, (12,))
    logits = hidden @ weight.t()
    net.eval()
    kept = net(logits)
    net.train()
    grads = []
    for fused in (False, True):
        torch.manual_seed(1)
        if fused:
            out = fused_output_stage(
                hidden, weight, target, loss="ts-ce", vocab_size=40, tau=TempNetTau(net)
            )
            loss, tau = out.loss, out.tau
        else:
            tau = net(logits)
            loss = temperature_scaled_cross_entropy(logits, target, tau, vocab_size=40)
        assert (tau - kept).abs().max() > 1e-3  # the mask changes tau in training
        net.zero_grad()
        loss.sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for unfused, fused in zip(*grads):
        torch.testing.assert_close(fused, unfused, rtol=1e-9, atol=1e-12)


def test_tempnet_s_product_through_the_output_weight_is_the_same_math(monkeypatch):
    """With the stop-gradient and more tokens than ~h, the fused stage forms ``W1 L`` as
    ``(W1 W) h`` (and W1's gradient through ``H``): tau, the loss and every gradient equal the
    direct product's in float64."""
    from megatron_tempnet.losses import TempNetTau, fused_output_stage, output_chunks, output_stage

    torch.manual_seed(0)
    net = TempNetLM(50, hidden_size=12, proj_size=8, padded_vocab_size=56).double()
    weight = torch.randn(56, 6, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(40, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 50, (40,))
    mask = (torch.arange(40) % 7 != 0).double()  # masked tokens: the backward's recomputation
    chosen = []

    def recorded(*args):
        through = output_chunks.w1_through_weight(*args)
        chosen.append(through is not None)
        return through

    results = []
    for factored in (True, False):
        monkeypatch.setattr(
            output_stage, "w1_through_weight", recorded if factored else lambda *args: None
        )
        out = fused_output_stage(
            hidden,
            weight,
            target,
            loss="dro",
            rho=2.0,
            vocab_size=50,
            tau=TempNetTau(net),
            chunk_size=9,
        )
        params = [hidden, weight, *net.parameters()]
        grads = torch.autograd.grad((out.loss * mask).sum() * 0.37, params)  # g: 0.37 or 0
        results.append([out.tau, out.loss, *grads])
    assert chosen == [True]
    for factored, direct in zip(*results):
        torch.testing.assert_close(factored, direct, rtol=1e-10, atol=1e-12)
