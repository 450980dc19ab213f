"""TempNetLM at TP = 1, 2, 4: same tau, same parameters after an optimizer step, and
TP-agnostic checkpoints.

The step is AdamW (the paper's optimizer) in float64 and SGD in float32: Adam's first step is
lr * g / (|g| + eps), which turns the float32 rounding noise of gradients that nearly cancel
over tokens into parameter differences far above 1e-6, whatever the parallel layout.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_tempnet.losses import vocab_parallel_dro_loss
from megatron_tempnet.tempnet import TempNetLM
from tests.helpers.distributed import run_distributed
from tests.helpers.reference import assert_close

VOCAB, PADDED = 150, 160  # TP = 4: 40 columns per rank, the last rank holds 30 true ones


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(5, 4, PADDED, generator=gen, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, VOCAB, (5, 4), generator=gen)
    return logits, target


def _tempnet(**kw) -> TempNetLM:
    """The TempNet of these tests (hidden size 32, projection 16) on the padded vocabulary."""
    return TempNetLM(VOCAB, hidden_size=32, proj_size=16, padded_vocab_size=PADDED, **kw)


def _train_one_step(dtype):
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the default RNG: identical on every TP rank
    net = _tempnet(tp_group=dist.group.WORLD).to(dtype)
    if dtype == torch.float64:
        optimizer = torch.optim.AdamW(
            net.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1
        )
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    logits, target = _inputs(dtype)
    width = PADDED // tp
    local = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    tau = net(local)
    loss = vocab_parallel_dro_loss(
        local, target, tau, rho=4.0, vocab_size=VOCAB, tp_group=dist.group.WORLD
    )
    loss.mean().backward()
    logits_grad_before_tempnet = local.grad.clone()
    grads = {name: p.grad.clone() for name, p in net.named_parameters() if name != "weight1"}
    optimizer.step()
    after = net(local.detach())
    return {
        "tau": tau.detach(),
        "tau_after": after.detach(),
        "state": net.state_dict(),
        "local_w1_shape": tuple(net.weight1.shape),
        "logits_grad": logits_grad_before_tempnet,
        "grads": grads,
    }


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def by_tp(request):
    return {tp: run_distributed(_train_one_step, tp, args=(request.param,)) for tp in (1, 2, 4)}


def test_tau_and_parameters_after_a_step_are_tp_invariant(by_tp):
    ref = by_tp[1][0]
    for tp, results in by_tp.items():
        for rank, res in enumerate(results):  # replicated layers: identical gradients
            for name, grad in res["grads"].items():
                assert torch.equal(grad, results[0]["grads"][name]), f"{name} tp={tp} {rank}"
                assert_close(grad, ref["grads"][name], 1e-5, f"grad {name} tp={tp}")
    for tp, results in by_tp.items():
        for rank, res in enumerate(results):
            where = f"tp={tp} rank={rank}"
            assert_close(res["tau"], ref["tau"], 1e-6, f"tau {where}")
            assert_close(res["tau_after"], ref["tau_after"], 1e-6, f"tau after step {where}")
            assert res["state"].keys() == ref["state"].keys()
            for key, value in res["state"].items():
                assert value.shape == ref["state"][key].shape, key
                assert_close(value, ref["state"][key], 1e-6, f"{key} {where}")
    assert not torch.equal(ref["tau"], ref["tau_after"])  # the step changed TempNet
    assert [r["local_w1_shape"] for r in by_tp[4]] == [(32, 40), (32, 40), (32, 40), (32, 30)]


def test_logits_gradient_is_the_loss_gradient_only(by_tp):
    # tau depends on the logits only through a stop-gradient, so d loss / d logits must equal
    # the DRO gradient at fixed tau: softmax(L / tau) - onehot, per token.
    logits, target = _inputs(torch.float64)
    tau = by_tp[1][0]["tau"]
    p = torch.softmax(logits.double()[..., :VOCAB] / tau.double()[..., None], dim=-1)
    expected = p - torch.nn.functional.one_hot(target, VOCAB).double()
    expected = torch.cat([expected, torch.zeros(5, 4, PADDED - VOCAB, dtype=torch.float64)], -1)
    expected /= target.numel()
    for tp, results in by_tp.items():
        grad = torch.cat([r["logits_grad"] for r in results], dim=-1)
        assert_close(grad, expected, 1e-5, f"tp={tp}")


def test_checkpoint_saved_at_tp4_loads_at_tp1(by_tp):
    state = by_tp[4][0]["state"]
    net = _tempnet().to(state["weight1"].dtype)
    net.load_state_dict(state)
    logits, _ = _inputs(state["weight1"].dtype)
    assert_close(net(logits), by_tp[4][0]["tau_after"], 1e-6, "tau after reload at TP=1")


def _no_stop_grad_logits_gradient():
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = _tempnet(tp_group=dist.group.WORLD, stop_grad=False).double()
    logits, _ = _inputs(torch.float64)
    width = PADDED // tp
    local = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    weights = torch.linspace(-1, 1, 20, dtype=torch.float64).view(5, 4)
    (net(local) * weights).sum().backward()
    return local.grad


def test_no_stop_grad_logits_gradient_is_tp_invariant():
    tp1 = run_distributed(_no_stop_grad_logits_gradient, 1)[0]
    assert float(tp1[..., :VOCAB].abs().min()) > 0
    for tp in (2, 4):
        grad = torch.cat(run_distributed(_no_stop_grad_logits_gradient, tp), dim=-1)
        assert_close(grad, tp1, 1e-12, f"tp={tp}")
