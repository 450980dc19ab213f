"""The run's process groups, gradient precision and checkpoint loading with Megatron-LM's flags,
on a real DeepSpeed engine (one gloo rank):

- --distributed-timeout-minutes reaches torch.distributed's default group and megatron-core's,
  --checkpoint-timeout-minutes the host group (checkpoints, rank 0's start-up scans);
- under --bf16 the micro-batches' gradients add up in float32 (DeepSpeed's bf16 optimizer) to
  the float32 sum of each micro-batch's bfloat16 gradients, where --grad-reduce-in-bf16 rounds
  the sum to bfloat16;
- --no-load-rng leaves the RNG streams as they are; --exit-on-missing-checkpoint makes an empty
  --load an error.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tests.helpers.distributed import run_distributed
from tests.helpers.run_flags import MOCK_RUN

BASE = [*MOCK_RUN, "--micro-batch-size", "4"]


def _config(*argv: str):
    """The run config of ``BASE`` and ``argv`` (one rank), in a process DeepSpeed accepts."""
    from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
    from megatron_tempnet.trainer.validation import validate_run

    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asks for it

    config = config_from_args(build_parser().parse_args([*BASE, *argv]))
    validate_run(config, world_size=1)
    return config


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _timeouts(minutes: int, checkpoint_minutes: float) -> list[timedelta]:
    from megatron_tempnet.distributed.groups import host_group
    from megatron_tempnet.trainer.engine import init_process_groups

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    config = _config(
        "--distributed-timeout-minutes",
        str(minutes),
        "--checkpoint-timeout-minutes",
        str(checkpoint_minutes),
    )
    dist.destroy_process_group()  # the harness's: init_process_groups makes the run's own
    init_process_groups(config)
    groups = [
        dist.group.WORLD,
        parallel_state.get_data_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_model_parallel_group(),
        host_group(),  # the checkpoints' and rank 0's scans: its own timeout
    ]
    return [_timeout(g) for g in groups]


def test_the_timeouts_reach_every_process_group():
    want = [timedelta(minutes=7)] * 5 + [timedelta(minutes=90.5)]
    assert run_distributed(_timeouts, world_size=1, args=(7, 90.5)) == [want]


def _accumulate(*argv: str) -> dict:
    """Two micro-batches through the engine (no optimizer step): the accumulated gradients and
    the two sums of each micro-batch's bfloat16 gradients (float32, bfloat16)."""
    from megatron_tempnet import compat
    from megatron_tempnet.trainer.engine import build_engine, decay_groups, init_process_groups
    from megatron_tempnet.trainer.task import TrainModel

    config = _config("--global-batch-size", "8", "--clip-grad", "0", *argv)
    init_process_groups(config)
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    reference = copy.deepcopy(module).to(torch.bfloat16)
    model = TrainModel(module, decay_groups("lm", module.parameters(), 1e-3, 0.0, 0.0))
    engine, optimizer = build_engine(model, config, 1)
    batches = [torch.randn(4, 16).to(torch.bfloat16) for _ in range(2)]
    for x in batches:
        engine.backward(engine(x).float().square().mean())
    grads = []
    for x in batches:  # the engine's loss is divided by the 2 accumulated micro-batches
        reference.zero_grad()
        (reference(x).float().square().mean() / 2).backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
    return {
        "optimizer": type(optimizer).__name__,
        "stage": engine.zero_optimization_stage(),
        "accumulated": _accumulated(engine, optimizer, compat),
        "float32_sum": [(a.float() + b.float()).flatten() for a, b in zip(*grads)],
        "bfloat16_sum": [(a + b).flatten() for a, b in zip(*grads)],
    }


def _accumulated(engine, optimizer, compat) -> list[torch.Tensor]:
    """The accumulated gradient of each parameter, in the module's order: DeepSpeed's bf16
    optimizer's float32 buffers, else the parameters' own gradients."""
    params = list(engine.module.parameters())
    if not hasattr(optimizer, "fp32_groups_gradients"):
        return [p.grad.flatten() for p in params]
    where = {
        id(p): g
        for group, grads in zip(optimizer.bf16_groups, optimizer.fp32_groups_gradients)
        for p, g in zip(group, grads)
    }
    return [where[id(p)].flatten() for p in params]


@pytest.mark.parametrize("reduce_in_bf16", [False, True])
def test_micro_batch_gradients_add_up_in_float32_under_bf16(reduce_in_bf16):
    argv = ("--bf16", "--grad-reduce-in-bf16") if reduce_in_bf16 else ("--bf16",)
    (out,) = run_distributed(_accumulate, world_size=1, args=argv)
    expected = out["bfloat16_sum"] if reduce_in_bf16 else out["float32_sum"]
    dtype = torch.bfloat16 if reduce_in_bf16 else torch.float32
    assert out["stage"] == (0 if reduce_in_bf16 else 1)  # float32 needs the bf16 optimizer
    assert [g.dtype for g in out["accumulated"]] == [dtype] * 4
    assert all(torch.equal(g, e) for g, e in zip(out["accumulated"], expected))
    # the two sums differ: bfloat16 drops the low bits float32 keeps
    rounded = sum(
        int((a.float() != b).sum()) for a, b in zip(out["bfloat16_sum"], out["float32_sum"])
    )
    assert rounded > 100


def _load_flags(save_dir: str, empty_dir: str) -> dict:
    from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
    from megatron_tempnet.checkpoint.checkpointer import Checkpointer
    from megatron_tempnet.distributed.sharding import TensorLayout
    from megatron_tempnet.trainer.engine import build_engine, decay_groups, init_process_groups
    from megatron_tempnet.trainer.task import TrainModel

    config = _config()
    init_process_groups(config)
    module = torch.nn.Linear(4, 4)
    model = TrainModel(
        module,
        decay_groups("lm", module.parameters(), 1e-3, 0.0, 0.0),
        tensor_layout=TensorLayout(100, 100),
    )
    engine, _ = build_engine(model, config, 1)

    def checkpointer(**flags) -> Checkpointer:
        run = dataclasses.replace(
            config, checkpoint=dataclasses.replace(config.checkpoint, **flags)
        )
        return Checkpointer(engine, model, run)

    torch.manual_seed(11)
    saved = torch.get_rng_state()
    client = {"data": None, "config": json.loads(config.to_json())}
    checkpointer(save=save_dir).save(2, client, rank_state={"mine": 5})
    out = {}
    for load_rng in (False, True):
        torch.manual_seed(12)
        before = torch.get_rng_state()
        client = checkpointer(load=save_dir, no_load_rng=not load_rng).resume()
        now = torch.get_rng_state()
        out[load_rng] = (torch.equal(now, before), torch.equal(now, saved), client["rank_state"])
    errors = []
    for directory in (empty_dir, os.path.join(empty_dir, "missing")):
        assert checkpointer(load=directory).resume() is None
        try:
            checkpointer(load=directory, exit_on_missing_checkpoint=True).resume()
        except CheckpointError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def test_no_load_rng_and_exit_on_missing_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (out,) = run_distributed(_load_flags, world_size=1, args=(str(tmp_path / "c"), str(empty)))
    assert out[False] == (True, False, {"mine": 5})  # the streams stay the run's own
    assert out[True] == (False, True, {"mine": 5})  # the saved streams
    stop = ", and --exit-on-missing-checkpoint stops the run instead of starting from scratch"
    assert out["errors"] == [
        f"--load {empty}: no checkpoint there (no 'latest')" + stop,
        f"--load {empty / 'missing'}: no such directory" + stop,
    ]


def _slow_peer() -> str | None:
    """Rank 1 still busy with its files after the host group's timeout: rank 0's wait ends in
    an error that names --checkpoint-timeout-minutes."""
    import time

    from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
    from megatron_tempnet.checkpoint.checkpointer import timeout_named

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    dist.barrier(group=group)
    if dist.get_rank() == 1:
        time.sleep(3)
        return None
    try:
        with timeout_named(1 / 60):
            dist.all_gather_object([None, None], 0, group=group)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_wait_past_the_checkpoint_timeout_names_the_flag():
    message, _ = run_distributed(_slow_peer, world_size=2)
    assert message.startswith(
        "the ranks waited for each other's checkpoint files longer than "
        "--checkpoint-timeout-minutes (0.0166667): a slow file system needs a larger value ("
    )
    assert "Timed out" in message
