"""The multi-process test harness itself."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import DistributedTestError, run_distributed


def _sum_of_ranks(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), float(t) + offset, os.getpid()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 would wait forever without the harness


def _hang():
    time.sleep(600)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running code
        return f.read().split()[2] != "Z"


def test_results_come_back_per_rank():
    results = run_distributed(_sum_of_ranks, 3, args=(10.0,))
    assert [(r, v) for r, v, _ in results] == [(0, 13.0), (1, 13.0), (2, 13.0)]
    assert not any(_alive(pid) for *_, pid in results)


def test_child_traceback_is_surfaced_and_others_are_stopped():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 of 2 failed") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert "deliberate failure on rank 1" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)  # the child's own traceback
    assert time.monotonic() - start < 30


def test_timeout_kills_every_rank(monkeypatch):
    import tests.helpers.distributed as harness

    started = []
    original = harness._terminate

    def spy(procs):
        started.extend(p.pid for p in procs)
        original(procs)

    monkeypatch.setattr(harness, "_terminate", spy)
    with pytest.raises(DistributedTestError, match=r"timed out after 5s; rank\(s\) \[0, 1\]"):
        run_distributed(_hang, 2, timeout=5)
    assert len(started) == 2
    assert not any(_alive(pid) for pid in started)
