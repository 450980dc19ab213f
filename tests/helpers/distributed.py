"""Run a function on N gloo processes from a pytest test.

    results = run_distributed(fn, world_size=2, args=(...), timeout=120)

* ``fn`` runs in fresh processes (forked from the session's preloaded server, see
  ``processes``) with ``torch.distributed`` initialised (gloo, CPU) and must be importable (a
  module-level function). Its return values, one per rank, come back as a list.
* Every rank enforces the GPU's device rules (``device_rules``): a host tensor given to a
  collective or mixed with a device tensor fails the test with NCCL's or CUDA's error.
* The rendezvous store is opened by this process on a port the OS picks, so tests never collide
  on ports.
* If a rank raises, the test fails with that rank's traceback; if the ranks do not finish within
  ``timeout`` seconds, the test fails naming the ranks still running. Either way every child is
  terminated (and children die with the parent if pytest itself is killed): no orphans.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_tempnet.compat.build_locks import remove_stale_build_locks
from tests.helpers import device_rules
from tests.helpers.processes import as_a_started_process, context

_HOST = "127.0.0.1"


class DistributedTestError(AssertionError):
    """A rank failed, died, or timed out."""


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker(fn, rank, world_size, port, args, kwargs, results, timeout):
    as_a_started_process()
    _die_with_parent()
    torch.set_num_threads(1)
    payload = None
    try:
        device_rules.install()  # NCCL's and CUDA's device rules, as on a GPU machine
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        payload = ("ok", pickle.dumps(fn(*args, **kwargs)))
    except BaseException:
        payload = ("error", traceback.format_exc())
    finally:
        results.put((rank, *payload))
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn, world_size: int, args: tuple = (), kwargs: dict | None = None, timeout: float = 180.0
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    # a DeepSpeed op's build killed by an earlier test would make every rank wait forever
    remove_stale_build_locks()
    ctx = context()
    store = dist.TCPStore(
        _HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            daemon=True,
            args=(fn, rank, world_size, store.port, args, kwargs or {}, results, timeout),
        )
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, timeout)
    finally:
        _terminate(procs)
        del store


def _collect(procs, results, world_size, timeout):
    deadline = time.monotonic() + timeout
    outputs: dict[int, object] = {}
    while len(outputs) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs
            ]
            if dead:
                codes = {r: procs[r].exitcode for r in dead}
                raise DistributedTestError(
                    f"rank(s) {dead} died without a result (exit codes {codes})"
                ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise DistributedTestError(
                    f"timed out after {timeout:.0f}s; rank(s) {missing} still running"
                ) from None
            continue
        if status == "error":
            raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{payload}")
        outputs[rank] = pickle.loads(payload)
    return [outputs[r] for r in range(world_size)]


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5)
