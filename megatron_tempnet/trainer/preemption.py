"""Stopping early and coming back: a signal or a wall-clock budget ends the run at a checkpoint.

SLURM warns a job before it ends (``--signal=USR1@120``: SIGUSR1 two minutes before the time
limit) and sends SIGTERM when it preempts or requeues it. On either signal, or when
``--exit-duration-in-mins`` has passed, the run finishes the iteration it is in, writes a
checkpoint, and exits with ``EXIT_REQUEUE``; the sbatch scripts in ``examples/`` requeue the job
on that status and the requeued job resumes from ``latest``.

A signal reaches the ranks at different moments (or only some of them), so each rank's flags are
all-reduced (MAX) once per iteration: every rank sees the same decision at the same iteration and
the checkpoint is consistent. The trainer reads the reduced flags with the iteration's statistics,
in the one copy from the device it makes per iteration.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

EXIT_REQUEUE = 75
"""Exit status of a run that stopped early at a checkpoint (sysexits' EX_TEMPFAIL: run the same
command again and it resumes)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """Signal flags and the wall-clock budget of this rank, agreed across ranks per iteration.

    ``install()`` replaces the handlers of ``STOP_SIGNALS`` (the handler only records the signal;
    the work happens between iterations) and ``restore()`` puts the previous ones back.
    """

    def __init__(self, exit_duration_mins: float = 0.0, start_time: float | None = None):
        self.exit_duration_mins = exit_duration_mins
        self.start_time = time.monotonic() if start_time is None else start_time
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequests:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        self.received = signum

    def _out_of_time(self) -> bool:
        elapsed = (time.monotonic() - self.start_time) / 60
        return bool(self.exit_duration_mins) and elapsed >= self.exit_duration_mins

    def flags(self, device: torch.device) -> torch.Tensor:
        """``[signal number or 0, out of time]`` MAX-reduced over the default group (collective),
        on ``device`` (the compute device: NCCL reduces device tensors), not read yet."""
        flags = torch.zeros(2, dtype=torch.int64, device=device)
        # filled on the device: a tensor made from Python values is a blocking copy
        flags[0] = self.received or 0
        flags[1] = int(self._out_of_time())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def decide(self, flags: list[float]) -> str | None:
        """Why every rank stops now (``None``: go on), from ``flags``'s values."""
        signum, out_of_time = (int(v) for v in flags)
        if signum:
            return f"received {signal.Signals(signum).name}"
        if out_of_time:
            return f"--exit-duration-in-mins {self.exit_duration_mins:g} reached"
        return None

    def agreed(self, device: torch.device) -> str | None:
        """``decide(flags(device))``: collective, and it waits for the device."""
        return self.decide(self.flags(device).tolist())
