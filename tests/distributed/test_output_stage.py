"""The fused output stage against the unfused one (output layer, TempNet, vocab-parallel loss) at
TP = 1, 2 and 4: per-token values, reported statistics and every gradient, for every loss and tau
source, with padded vocabulary columns (some ranks without a true column), masked tokens, tau
down to 1e-3 and |logits| up to 1e4; and no ``[tokens, V/tp]`` tensor allocated on the way.

The loss's upstream gradient is the loss mask (the training step's), one value for every token,
or a different value per token; and the same with the gradients recomputed in the backward pass
only (``eager_gradients=False``).

Both paths go through the GPT objective: the unfused one with the logits
(``token_losses_from_logits``), the fused one with ``FinalHidden`` (``token_losses_fused``).
Tied and untied output weights are the training runs' business (tests/e2e/test_pretrain.py:
GPT-2 ties them, the LLaMA pipeline does not).
"""

import contextlib
import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_tempnet.distributed.groups import parallel_argmax
from megatron_tempnet.losses import FixedTau, fused_output_stage
from megatron_tempnet.models.gpt import objective as gpt_objective
from megatron_tempnet.models.gpt.layers import FinalHidden
from megatron_tempnet.models.gpt.objective import (
    LossConfig,
    token_losses_from_logits,
    token_losses_fused,
)
from megatron_tempnet.tempnet import TempNetConfig, TempNetLM
from tests.helpers.distributed import run_distributed

PADDED, HIDDEN, BATCH, SEQ, CHUNK = 208, 16, 3, 6, 7  # 18 tokens in chunks of 7, 7 and 4
TAU_MIN = 1e-3

# name: (dtype, true vocabulary, extreme, tolerance). 101 true ids leave ranks 2 and 3 of TP 4
# without a true column. "extreme": integer hidden states and weights, so that the logits (up to
# 14400) are exact whatever the GEMM's blocking, and tau at 1e-3.
SCALES = {
    "float32": (torch.float32, 203, False, 1e-5),
    "extreme": (torch.float32, 203, True, 1e-5),
    "float64": (torch.float64, 101, False, 1e-12),
}
# (--loss, --tau-source, TempNet's stop-gradient)
OBJECTIVES = [
    ("dro", "tempnet", True),
    ("ts-ce", "tempnet", True),
    ("dro", "tempnet", False),
    ("dro", "fixed", True),
    ("ts-ce", "fixed", True),
    ("ce", "fixed", True),
    ("dro", "newton", True),
    ("ce", "newton", True),
]
# the loss's upstream gradient (the objectives that use every piece of the gradient, two scales)
# "mask": the loss mask, the gradient most tokens share plus the masked tokens' (the default
# above); "uniform": one value everywhere (nothing recomputed); "random": a value per token
# (almost every token recomputed); "recompute": the mask, gradients only in the backward pass;
# "masked": a multiple of the mask, which the stage is told (the training step's contract: a
# backward pass without waits)
UPSTREAM = ["uniform", "random", "recompute", "masked"]
MASKED_SCALE = 0.37
UPSTREAM_OBJECTIVES = [OBJECTIVES[2], OBJECTIVES[1], OBJECTIVES[6]]
UPSTREAM_SCALES = ["float32", "float64"]


def _inputs(scale: str, seed: int = 0):
    dtype, vocab, extreme, _ = SCALES[scale]
    gen = torch.Generator().manual_seed(seed)
    if extreme:
        hidden = torch.randint(-30, 31, (SEQ, BATCH, HIDDEN), generator=gen).double()
        weight = torch.randint(-30, 31, (PADDED, HIDDEN), generator=gen).double()
        hidden[0, 0], weight[5] = 30.0, 30.0  # logit 14400 at token 5: the row's target below
    else:
        hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
        weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels[0, 0] = 5
    mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.3).double()
    return hidden.to(dtype), weight.to(dtype), labels, mask.to(dtype)


def _tempnet(vocab: int, dtype, extreme: bool, stop_grad: bool) -> TempNetLM:
    torch.manual_seed(3)
    tempnet = TempNetLM(
        vocab,
        hidden_size=8,
        proj_size=6,
        tau_min=TAU_MIN,
        padded_vocab_size=PADDED,
        stop_grad=stop_grad,
        tp_group=dist.group.WORLD,
    ).to(dtype)
    if extreme:  # tau pushed to within 1e-5 of tau_min
        with torch.no_grad():
            tempnet.pooling.bias.fill_(12.0)
    return tempnet


class _LargestAllocation(TorchDispatchMode):
    """The largest tensor any operation returns while active (in elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _one_path(fused: bool, scale: str, objective: tuple, *, train=True, upstream="mask"):
    """Per-token outputs and every gradient of one path on this rank (hidden's complete)."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    dtype, vocab, extreme, _ = SCALES[scale]
    loss, source, stop_grad = objective
    hidden, weight, labels, mask = _inputs(scale)
    if upstream == "uniform":
        mask = torch.full_like(mask, 0.25)
    elif upstream == "random":
        mask = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    eager = upstream != "recompute"
    stage = functools.partial(fused_output_stage, eager_gradients=eager)
    width = PADDED // tp
    weight = weight[rank * width : (rank + 1) * width].clone().requires_grad_(train)
    hidden = hidden.clone().requires_grad_(train)
    config = LossConfig(
        loss=loss,
        tau_source=source,
        fixed_tau=TAU_MIN if extreme else 0.7,
        rho=3.0,
        tempnet=TempNetConfig(tau_min=TAU_MIN if extreme else 0.05, stop_grad=stop_grad),
        output_stage_chunk_size=CHUNK,
    )
    tempnet = _tempnet(vocab, dtype, extreme, stop_grad) if source == "tempnet" else None
    common = dict(vocab_size=vocab, tempnet=tempnet, tp_group=dist.group.WORLD)
    told = {"loss_mask": mask} if upstream == "masked" else {}
    tracker = _LargestAllocation()
    patch = mock.patch.object(gpt_objective, "fused_output_stage", stage)
    with tracker if fused else contextlib.nullcontext(), patch:
        if fused:
            final = FinalHidden(hidden, weight)
            out = token_losses_fused(final, labels, config, **common, **told)
        else:
            logits = (hidden @ weight.t()).transpose(0, 1)  # [b, s, V_pad/tp]
            out = token_losses_from_logits(logits, labels, config, **common)
        if train:
            scale = MASKED_SCALE if upstream == "masked" else 1.0
            ((out.loss * mask).sum() * scale).backward()
    grads = {}
    if train:
        grads = {"hidden": hidden.grad, "weight": weight.grad}
        if not fused:  # megatron-core's column-parallel layer sums dL/dh over the TP group
            dist.all_reduce(grads["hidden"])
        for name, p in tempnet.named_parameters() if tempnet is not None else ():
            grads[name] = p.grad
    values = {"loss": out.loss.detach(), "ce": out.ce, "tau": out.tau}
    if out.ts_ce is not None:
        values["ts_ce"] = out.ts_ce
    return values, grads, tracker.largest


def _all_cases():
    tp = dist.get_world_size()
    results = {}
    for scale in SCALES:
        for objective in OBJECTIVES:
            fused = _one_path(True, scale, objective)
            unfused = _one_path(False, scale, objective)
            results[(scale, objective)] = (fused, unfused)
    for scale in UPSTREAM_SCALES:
        for objective in UPSTREAM_OBJECTIVES:
            for upstream in UPSTREAM:
                fused = _one_path(True, scale, objective, upstream=upstream)
                unfused = _one_path(False, scale, objective, upstream=upstream)
                results[(scale, objective, upstream)] = (fused, unfused)
    # evaluation: T-LLM terms from the same call, and the greedy token
    hidden, weight, labels, _ = _inputs("float32")
    width = PADDED // tp
    local = weight[dist.get_rank() * width :][:width]
    with torch.no_grad():
        evaluation = (
            _one_path(True, "float32", OBJECTIVES[0], train=False)[0],
            _one_path(False, "float32", OBJECTIVES[0], train=False)[0],
        )
        greedy = fused_output_stage(
            hidden,
            local,
            labels.t(),
            loss="ce",
            vocab_size=203,
            tau=FixedTau(1.0),
            tp_group=dist.group.WORLD,
            chunk_size=CHUNK,
            eval_terms=True,
        ).argmax
        logits = (hidden @ local.t()).reshape(-1, width)
        n_true = max(0, min(width, 203 - dist.get_rank() * width))
        expected = parallel_argmax(logits[:, :n_true], dist.get_rank() * width, _tp())
    return results, evaluation, (greedy.reshape(-1), expected)


def _tp():
    from megatron_tempnet.distributed.groups import resolve_tp_group

    return resolve_tp_group(dist.group.WORLD)


def _true_columns(scale: str, rank: int, tp: int) -> int:
    width = PADDED // tp
    return max(0, min(width, SCALES[scale][1] - rank * width))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both vanish)."""
    err = float((got.double() - want.double()).abs().max())
    return err / max(float(want.double().abs().max()), 1e-300) if err else 0.0


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def outcomes(request):
    return run_distributed(_all_cases, world_size=request.param), request.param


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: "-".join(map(str, o)))
def test_fused_stage_equals_the_unfused_one(outcomes, scale, objective):
    _check_case(outcomes, scale, (scale, objective))


@pytest.mark.parametrize("upstream", UPSTREAM)
@pytest.mark.parametrize("scale", UPSTREAM_SCALES)
@pytest.mark.parametrize("objective", UPSTREAM_OBJECTIVES, ids=lambda o: "-".join(map(str, o)))
def test_any_upstream_gradient(outcomes, scale, objective, upstream):
    _check_case(outcomes, scale, (scale, objective, upstream))


def _check_case(outcomes, scale: str, case: tuple) -> None:
    per_rank, tp = outcomes
    tolerance = SCALES[scale][3]
    tokens = BATCH * SEQ
    for rank, (results, _, _) in enumerate(per_rank):
        (values, grads, largest), (ref_values, ref_grads, _) = results[case]
        assert set(values) == set(ref_values) and set(grads) == set(ref_grads)
        for name in ref_values:
            err = _relative(values[name], ref_values[name])
            assert err <= tolerance, (tp, rank, name, err)
        for name, want in ref_grads.items():
            if want is None:
                assert grads[name] is None, name
                continue
            if want.numel() == 0 or (name == "weight" and _true_columns(scale, rank, tp) == 0):
                assert grads[name].shape == want.shape and not grads[name].any(), name
                continue
            assert float(want.abs().max()) > 0, name  # every gradient is exercised
            err = _relative(grads[name], want)
            assert err <= tolerance, (tp, rank, name, err)
        # never a [tokens, V/tp] tensor: the largest is one chunk's logits (or smaller)
        assert largest < tokens * (PADDED // tp), (largest, tokens, PADDED // tp)
        assert largest >= CHUNK * (PADDED // tp)


def test_evaluation_terms_and_greedy_tokens(outcomes):
    per_rank, tp = outcomes
    for _, (fused, unfused), (greedy, expected) in per_rank:
        assert set(fused) == {"loss", "ce", "tau", "ts_ce"} == set(unfused)
        for name in unfused:
            assert _relative(fused[name], unfused[name]) <= 1e-5, (tp, name)
        assert torch.equal(greedy, expected)


_DRO_AT_0_7 = dict(loss="dro", vocab_size=203, tau=FixedTau(0.7))


def test_an_upstream_gradient_not_a_multiple_of_the_mask_is_refused():
    hidden, weight, labels, mask = _inputs("float32")
    hidden.requires_grad_()
    out = fused_output_stage(hidden, weight, labels.t(), **_DRO_AT_0_7, upstream_mask=mask.t())
    with pytest.raises(RuntimeError, match="not a multiple of upstream_mask"):
        (out.loss * mask.t() * torch.linspace(1, 2, SEQ)[:, None]).sum().backward()


def test_a_second_backward_pass_is_refused():
    hidden, weight, labels, _ = _inputs("float32")
    hidden.requires_grad_()
    out = fused_output_stage(hidden, weight, labels.t(), **_DRO_AT_0_7)
    out.loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward pass ran twice"):
        out.loss.sum().backward()
