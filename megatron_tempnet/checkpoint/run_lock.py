"""One live run per ``--save`` directory: ``SAVE/run.lock`` names the process that owns it.

Two runs saving into one directory overwrite each other's checkpoints and ``latest``; the second
run therefore stops at start-up with an error naming the first (host, pid, start, SLURM job). A
lock left by a process that no longer runs (killed, node lost) is stale: the next run takes it
over and says so. Whether a process runs is known on its own host only (``kill(pid, 0)``, with
the process's start time against a reused pid); a lock from another host is stale when it names
this same SLURM job (a requeue), and otherwise left for a person to remove.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.utils.logging import log_rank0

LOCK = "run.lock"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: float
    """Wall-clock start of the process (seconds since the epoch)."""
    start_ticks: int | None = None
    """The kernel's start time of the process (a reused pid has another one)."""
    slurm_job: str | None = None

    @classmethod
    def this_process(cls) -> Owner:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.time(),
            start_ticks=_start_ticks(os.getpid()),
            slurm_job=os.environ.get("SLURM_JOB_ID"),
        )

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        job = f", SLURM job {self.slurm_job}" if self.slurm_job else ""
        return f"pid {self.pid} on {self.host} (started {when}{job})"

    def is_running(self) -> bool:
        """Whether the owner still runs, as far as this host can tell."""
        if self.host != socket.gethostname():
            return not (self.slurm_job and self.slurm_job == os.environ.get("SLURM_JOB_ID"))
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return self.start_ticks is None or _start_ticks(self.pid) == self.start_ticks


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc``; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces


class RunLock:
    """``SAVE/run.lock`` held by this process (``acquire``), removed by ``release``."""

    def __init__(self, save_dir: str):
        self.path = os.path.join(save_dir, LOCK)
        self.owner = Owner.this_process()

    def acquire(self) -> RunLock:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            with os.fdopen(descriptor, "w") as f:
                json.dump(asdict(self.owner), f)
            return self

    def _take_over_or_refuse(self) -> None:
        try:
            other = self._read()
        except FileNotFoundError:  # released meanwhile: try again
            return
        if other is not None and other.is_running():
            raise CheckpointError(
                f"--save {os.path.dirname(self.path)} is in use by another run: "
                f"{other.describe()}; stop it or choose another --save (if it is not running, "
                f"delete {self.path})"
            )
        who = other.describe() if other is not None else "an unreadable lock"
        log_rank0("taking over the stale lock %s of %s: no longer running", self.path, who)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def _read(self) -> Owner | None:
        try:
            with open(self.path) as f:
                return Owner(**json.load(f))
        except FileNotFoundError:
            raise
        except (OSError, ValueError, TypeError):  # cut short by a crash while it was written
            return None

    def release(self) -> None:
        with contextlib.suppress(OSError, ValueError, TypeError):
            if self._read() == self.owner:
                os.remove(self.path)
