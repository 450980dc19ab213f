"""The fused output stage on sequence shards (--sequence-parallel) against the same stage on
whole sequences, at TP 2 and 4: every per-token value and every gradient (this rank's hidden rows,
the output weight, TempNet's parameters) for the DRO loss, TS-CE and cross-entropy with TempNet,
a fixed or Newton's tau, the loss's upstream gradient being the loss mask (masked tokens
recomputed one by one, or told to the stage), one value, a value per token, or all gradients in
the backward pass; the
evaluation terms; and no ``[tokens, h]`` tensor on the way (only this rank's shard and one
gathered chunk of rows).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed

PADDED, HIDDEN, STAGE_SEQ, STAGE_BATCH, CHUNK = 208, 16, 8, 3, 7
TEMPNET_D1 = 8
STAGE_VOCAB = 203
# (--loss, --tau-source, TempNet's stop-gradient)
OBJECTIVES = [
    ("dro", "tempnet", True),
    ("dro", "tempnet", False),
    ("ts-ce", "tempnet", True),
    ("dro", "fixed", True),
    ("ce", "newton", True),
]
# the loss's upstream gradient: the loss mask (masked tokens recomputed one by one), one value
# everywhere, a value per token, the mask with every gradient in the backward pass, a multiple of
# the mask the stage is told (the training step's: no recompute, no wait)
UPSTREAM = ["mask", "uniform", "random", "recompute", "masked"]


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """The shape of every tensor an operation returns while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _stage_inputs(dtype):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(STAGE_SEQ, STAGE_BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, STAGE_VOCAB, (STAGE_BATCH, STAGE_SEQ), generator=gen)
    mask = (torch.rand(STAGE_BATCH, STAGE_SEQ, generator=gen) > 0.3).double()
    return hidden.to(dtype), weight.to(dtype), labels, mask.to(dtype)


def _stage(sharded: bool, objective: tuple, upstream: str, dtype, train: bool = True) -> dict:
    """This rank's per-token values, its hidden rows' gradient and the other gradients of the
    fused stage on the whole sequence or on this rank's shard of it, and the shapes it made."""
    import functools
    from unittest import mock

    from megatron_tempnet.losses import fused_output_stage
    from megatron_tempnet.models.gpt import objective as gpt_objective
    from megatron_tempnet.models.gpt.layers import FinalHidden
    from megatron_tempnet.models.gpt.objective import LossConfig, token_losses_fused
    from megatron_tempnet.tempnet import TempNetConfig, TempNetLM

    rank, tp = dist.get_rank(), dist.get_world_size()
    loss, source, stop_grad = objective
    hidden, weight, labels, mask = _stage_inputs(dtype)
    if upstream == "uniform":
        mask = torch.full_like(mask, 0.25)
    elif upstream == "random":
        mask = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    local = STAGE_SEQ // tp
    rows = slice(rank * local, (rank + 1) * local) if sharded else slice(None)
    hidden = hidden[rows].clone().requires_grad_(train)
    width = PADDED // tp
    weight = weight[rank * width : (rank + 1) * width].clone().requires_grad_(train)
    config = LossConfig(
        loss=loss,
        tau_source=source,
        fixed_tau=0.7,
        rho=3.0,
        tempnet=TempNetConfig(tau_min=0.05, stop_grad=stop_grad),
        output_stage_chunk_size=CHUNK,
    )
    tempnet = None
    if source == "tempnet":
        torch.manual_seed(3)
        tempnet = TempNetLM(
            STAGE_VOCAB,
            hidden_size=TEMPNET_D1,
            proj_size=6,
            tau_min=0.05,
            padded_vocab_size=PADDED,
            stop_grad=stop_grad,
            tp_group=dist.group.WORLD,
        ).to(dtype)
    stage = functools.partial(fused_output_stage, eager_gradients=upstream != "recompute")
    shapes = _Shapes()
    with shapes, mock.patch.object(gpt_objective, "fused_output_stage", stage):
        final = FinalHidden(hidden, weight, sequence_parallel=sharded)
        out = token_losses_fused(
            final,
            labels,
            config,
            vocab_size=STAGE_VOCAB,
            tempnet=tempnet,
            tp_group=dist.group.WORLD,
            loss_mask=mask if upstream == "masked" else None,
        )
        if train:
            ((out.loss * mask).sum() * (0.37 if upstream == "masked" else 1.0)).backward()
    result = {"loss": out.loss.detach(), "ce": out.ce, "tau": out.tau, "shapes": shapes.shapes}
    if out.ts_ce is not None:
        result["ts_ce"] = out.ts_ce
    if train:
        result["hidden"] = (
            hidden.grad if sharded else hidden.grad[rank * local : (rank + 1) * local]
        )
        result["weight"] = weight.grad
        for name, p in tempnet.named_parameters() if tempnet is not None else ():
            result[name] = p.grad
    return result


def _stage_cases() -> dict:
    out = {}
    for dtype in (torch.float32, torch.float64):
        for objective in OBJECTIVES:
            for upstream in UPSTREAM if objective[0] == "dro" else ["mask"]:
                case = (str(dtype), objective, upstream)
                out[case] = [_stage(s, objective, upstream, dtype) for s in (True, False)]
    with torch.no_grad():  # evaluation: the T-LLM terms
        out["eval"] = [
            _stage(s, OBJECTIVES[0], "mask", torch.float32, False) for s in (True, False)
        ]
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def stage_runs(request):
    return run_distributed(_stage_cases, world_size=request.param), request.param


def test_the_fused_stage_on_sequence_shards_computes_the_whole_sequences(stage_runs):
    per_rank, tp = stage_runs
    tokens = STAGE_SEQ * STAGE_BATCH
    for rank, cases in enumerate(per_rank):
        assert len(cases) == 2 * (len(OBJECTIVES) + 3 * len(UPSTREAM) - 3) + 1
        for case, (sharded, whole) in cases.items():
            tolerance = 1e-12 if "float64" in case[0] else 1e-5
            names = set(whole) - {"shapes"}
            assert set(sharded) - {"shapes"} == names, case
            assert {"loss", "tau", "ce"} <= names
            for name in names:
                want, got = whole[name], sharded[name]
                if want is None:
                    assert got is None, (case, name)
                    continue
                assert got.shape == want.shape, (case, name)
                scale = max(float(want.abs().max()), 1e-30)
                err = float((got - want).abs().max()) / scale
                assert err <= tolerance, (tp, rank, case, name, err)
            # no [tokens, h] tensor: the hidden rows it holds are this rank's shard (and its
            # gradient) or one gathered chunk (the output weight [V/tp, h], its true rows, its
            # gradient and TempNet's [d1, h] product through it aside); the whole-sequence
            # stage holds [tokens, h], which the check would find
            from megatron_tempnet.distributed.groups import vocab_partition

            n_true = vocab_partition(PADDED // tp, rank, STAGE_VOCAB).n_true
            rows = [s[0] for s in sharded["shapes"] if len(s) == 2 and s[1] == HIDDEN]
            largest = max(r for r in rows if r not in (PADDED // tp, n_true, TEMPNET_D1))
            assert largest <= max(CHUNK, tokens // tp) < tokens, (case, rows)
            if "hidden" in whole:
                whole_rows = [s[0] for s in whole["shapes"] if len(s) == 2 and s[1] == HIDDEN]
                assert tokens in whole_rows
