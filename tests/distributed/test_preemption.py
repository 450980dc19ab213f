"""Stop requests are agreed across ranks: a signal or an exhausted time budget on one rank stops
every rank at the same iteration."""

import os
import signal
import time

import torch.distributed as dist

from megatron_tempnet.trainer.preemption import StopRequests
from megatron_tempnet.trainer.step import compute_device
from tests.helpers.distributed import run_distributed


def _decisions(signal_rank: int, signum: int, late_rank: int | None) -> list:
    rank = dist.get_rank()
    start = time.monotonic() - 120 if rank == late_rank else None  # 2 of 1.5 minutes gone
    requests = StopRequests(
        exit_duration_mins=1.5 if late_rank is not None else 0.0, start_time=start
    ).install()
    try:
        decisions = [requests.agreed(compute_device()) if late_rank is None else None]
        if rank == signal_rank:
            os.kill(os.getpid(), signum)  # the handler records it; nothing else happens
        decisions.append(requests.agreed(compute_device()))
    finally:
        requests.restore()
    return decisions + [signal.getsignal(signum) is signal.SIG_DFL]


def test_a_signal_on_one_rank_stops_every_rank():
    for signal_rank, signum, name in [
        (1, signal.SIGUSR1, "SIGUSR1"),
        (0, signal.SIGTERM, "SIGTERM"),
    ]:
        results = run_distributed(_decisions, world_size=3, args=(signal_rank, signum, None))
        assert results == [[None, f"received {name}", True]] * 3


def test_the_time_budget_of_one_rank_stops_every_rank():
    results = run_distributed(_decisions, world_size=2, args=(-1, signal.SIGUSR1, 1))
    assert results == [[None, "--exit-duration-in-mins 1.5 reached", True]] * 2
