"""Fresh processes for the tests, started from a server that has the heavy imports done.

Starting Python and importing torch, DeepSpeed and megatron-core costs about 5 s of CPU per
process, several times the work of a tiny training run. The tests therefore start their worker
processes (``run_distributed``'s ranks, and the entry points and tools run by ``run_program``)
through one multiprocessing *forkserver* per test session: it imports those modules once, never
runs a tensor operation itself, and forks every new process from that state. Each process is
still new: its own interpreter state, environment, working directory, command line and exit
status, with nothing shared with the test or with other runs.

``run_in_terminal`` runs a command on a pseudo-terminal instead, to see what a person at a terminal
sees (progress bars redrawn in place).
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import pty
import select
import struct
import subprocess
import termios
import time

PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "deepspeed",
    "deepspeed.pipe",
    "megatron.core",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.gpt_dataset",
    "megatron_tempnet.trainer.loop",
    "megatron_tempnet.models.gpt.arguments",
    "megatron_tempnet.models.clip.arguments",
    "megatron_tempnet.inference.cli",
]
"""What the server imports (only what the workers would import anyway)."""

_context = None


def context():
    """The session's forkserver context (started on first use, with ``PRELOAD`` imported)."""
    global _context
    if _context is None:
        # the server and every process it forks: one OpenMP thread, DeepSpeed's CPU accelerator
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def as_a_started_process() -> None:
    """Called first in every process the server forks: multiprocessing's default start method
    back to the platform's (fork on Linux), the one a program started by torchrun or srun has.
    A process started through a forkserver inherits "forkserver" as its default, so its own
    children (the DataLoader's workers) would each start from a new server that imports torch
    again: about 5 s per run that no user's run pays."""
    mp.set_start_method(None, force=True)


def run_in_terminal(
    cmd: list[str], env: dict | None = None, timeout: float = 120, columns: int = 120
) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal ``columns`` wide as its stdin, stdout and stderr;
    returns its exit status and all it wrote to the terminal (carriage returns kept, newlines
    as the terminal gives them: ``\\r\\n``). Raises ``TimeoutExpired`` after ``timeout``."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    try:
        proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)  # the child's copies stay open: reading ends when they close
    output, deadline = bytearray(), time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, timeout, output=bytes(output))
            ready, _, _ = select.select([master], [], [], 0.1)
            if not ready:
                if proc.poll() is not None:  # exited, and nothing left unread
                    break
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not data:
                break
            output += data
    finally:
        os.close(master)
    return proc.wait(), output.decode("utf-8", errors="replace")
