"""The step's own gradient norm and clipping (ZeRO 0 in float32 and bf16): the global norm over
TP ranks equals a float64 reference, clipping scales the gradients to ``--clip-grad``, and
neither waits for the device nor copies any gradient to float64. The norm a GPT training step
reports over two accumulated micro-batches on two data-parallel ranks equals the float64 norm of
the global batch's gradient, in float32 (the step's own) and under --bf16 (DeepSpeed's bf16
optimizer, which must count each micro-batch once)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import device_rules
from tests.helpers.distributed import run_distributed

SHAPES = {"sharded": (300, 7), "replicated": (1000,), "small": (4,)}


def _grads(rank: int) -> dict[str, torch.Tensor]:
    """Every rank's gradients as that rank holds them (the replicated ones equal on all)."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        seed = 10 * i + (rank if name == "sharded" else 0)
        out[name] = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    return out


class Float64Copies(TorchDispatchMode):
    """Records every float64 tensor larger than one value per gradient that an operation
    makes (the smallest gradient has more elements than there are gradients)."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        big = isinstance(out, torch.Tensor) and out.numel() > len(SHAPES)
        if big and out.dtype == torch.float64:
            self.found.append((str(func), out.numel()))
        return out


def _clip(max_norm: float, dtype: torch.dtype) -> dict:
    from megatron_tempnet import compat
    from megatron_tempnet.trainer.step import clip_grad_norm_

    compat.apply_cpu_support()
    tp, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    params = []
    for name, grad in _grads(rank).items():
        p = torch.nn.Parameter(torch.zeros(grad.shape, dtype=dtype))
        p.grad = grad.to(dtype)
        p.tensor_model_parallel = name == "sharded"
        params.append(p)
    before = [p.grad.double().clone() for p in params]
    counter, start = device_rules.counter(), len(device_rules.counter().events)
    with Float64Copies() as copies:
        norm = clip_grad_norm_(params, max_norm)
    waits = counter.events[start:]
    every = [g for r in range(tp) for g in (_grads(r)["sharded"],)]
    every += [_grads(0)["replicated"], _grads(0)["small"]]
    reference = sum(g.to(dtype).double().pow(2).sum() for g in every).sqrt()
    scale = [(p.grad.double() / b)[b != 0] for p, b in zip(params, before)]
    return {
        "norm": float(norm),
        "reference": float(reference),
        "waits": waits,
        "copies": copies.found,
        "scale": torch.cat(scale),
    }


@pytest.mark.parametrize("tp,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_norm_and_clipping_wait_for_nothing_and_copy_no_gradient(tp, dtype):
    for max_norm in (0.0, 1.0):
        results = run_distributed(_clip, world_size=tp, args=(max_norm, dtype))
        for out in results:
            assert out["waits"] == [] and out["copies"] == []
            assert out["norm"] == pytest.approx(out["reference"], rel=1e-6)
            expected = min(1.0, max_norm / (out["reference"] + 1e-6)) if max_norm else 1.0
            tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 rounds each gradient
            assert out["scale"].sub(expected).abs().max() <= tolerance * expected
        assert max_norm == 0 or results[0]["reference"] > 2 * max_norm  # clipping acted


class TokenModel(torch.nn.Module):
    """A GPT task's module in miniature: ``forward(tokens, position_ids, labels, loss_mask)``
    returns ``TokenLosses``, a dataclass, in which DeepSpeed's engine sees no output tensor to
    hook."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(100, 16)
        self.hidden = torch.nn.Linear(16, 64)
        self.out = torch.nn.Linear(64, 8)

    def forward(self, tokens, position_ids, labels, loss_mask=None):
        from megatron_tempnet.models.gpt.objective import TokenLosses

        y = self.out(torch.tanh(self.hidden(self.embedding(tokens))))  # [b, s, 8]
        loss = y.float().square().mean(-1)  # [b, s]
        return TokenLosses(loss=loss, ce=loss.detach(), tau=torch.ones_like(loss))


def _micro_batches(count: int) -> list[dict]:
    """The global batch: ``count`` micro-batches of 2 sequences of 5 tokens, some masked."""
    g = torch.Generator().manual_seed(11)
    return [
        {
            "tokens": torch.randint(0, 100, (2, 5), generator=g),
            "labels": torch.zeros(2, 5, dtype=torch.long),
            "loss_mask": (torch.rand(2, 5, generator=g) > 0.2).float(),
            "position_ids": torch.arange(5).expand(2, 5),
        }
        for _ in range(count)
    ]


def _accumulated_norm(*argv: str) -> dict:
    from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
    from megatron_tempnet.models.gpt.step import train_step
    from megatron_tempnet.trainer.engine import build_engine, decay_groups, init_process_groups
    from megatron_tempnet.trainer.step import step_max_grad_norm
    from megatron_tempnet.trainer.task import TrainModel
    from megatron_tempnet.trainer.validation import validate_run
    from tests.helpers.run_flags import MOCK_RUN

    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it
    dp, rank = dist.get_world_size(), dist.get_rank()
    flags = ["--micro-batch-size", "2", "--global-batch-size", str(4 * dp), "--clip-grad", "0"]
    config = config_from_args(build_parser().parse_args([*MOCK_RUN, *flags, *argv]))
    validate_run(config, world_size=dp)
    init_process_groups(config)
    torch.manual_seed(3)
    module = TokenModel()
    reference = copy.deepcopy(module)
    model = TrainModel(module, decay_groups("lm", module.parameters(), 1e-3, 0.0, 0.0))
    engine, optimizer = build_engine(model, config, dp)
    for r, p in zip(reference.parameters(), engine.module.parameters()):  # bf16-rounded
        r.data = p.detach().double()
    batches = _micro_batches(2 * dp)
    mine = batches[2 * rank : 2 * rank + 2]
    group = parallel_state.get_data_parallel_group()
    stats = train_step(engine, mine, dp_group=group, max_grad_norm=step_max_grad_norm(config))
    tokens = sum(b["loss_mask"].sum() for b in batches)
    loss = sum((reference(b["tokens"], None, None).loss * b["loss_mask"]).sum() for b in batches)
    (loss / tokens).backward()
    expected = torch.stack([p.grad.square().sum() for p in reference.parameters()]).sum().sqrt()
    return {
        "optimizer": type(optimizer).__name__,
        "accumulation": config.gradient_accumulation_steps(dp),
        "norm": float(stats.grad_norm),
        "reference": float(expected),
    }


@pytest.mark.parametrize(
    "argv,optimizer,rel",
    [
        ((), "AdamW", 1e-6),  # ZeRO 0: the step measures the norm itself
        (("--bf16",), "BF16_Optimizer", 1e-2),  # bf16 rounds the weights and each gradient
    ],
)
def test_the_norm_of_accumulated_micro_batches_equals_a_float64_reference(argv, optimizer, rel):
    for out in run_distributed(_accumulated_norm, world_size=2, args=argv):
        assert (out["optimizer"], out["accumulation"]) == (optimizer, 2)
        assert out["norm"] == pytest.approx(out["reference"], rel=rel)
