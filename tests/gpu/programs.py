"""Start the project's programs as a user does, and wait for them (the acceptance checks).

Every program is a fresh process of this interpreter (``sys.executable``): training under
``torch.distributed.run --standalone`` (ranks on GPUs of their own when several runs share a
machine), tools as plain processes; its output, every rank's, in ``LOG_DIR/name.log``. CPU mode:
gloo, DeepSpeed's CPU accelerator, no GPU visible, one OpenMP thread per rank. Each program's
wall time goes to the summary (``report.PROGRAMS``), whether it succeeds or not.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.gpu import report
from tests.gpu.harness import REPO, gpu_count, on_cpu, sizes

FIRST_ITERATION = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ iteration \d+ \|", re.MULTILINE
)
"""The first training iteration's line in a log (utils/cli.py's format: asctime, level)."""


def environment(devices: list[int] | None = None) -> dict[str, str]:
    """The programs' environment: CPU (gloo, DeepSpeed's CPU accelerator, no GPU visible) or
    CUDA (``devices``: the GPUs to show, default all); one OpenMP thread per CPU rank, a few per
    GPU rank; the repository importable whatever the interpreter."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if on_cpu():
        env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    else:
        env.update(OMP_NUM_THREADS="4", DS_ACCELERATOR="cuda")
        if devices is not None:  # indices of the GPUs this process sees
            shown = env.get("CUDA_VISIBLE_DEVICES", "").split(",")
            visible = shown if shown != [""] else [str(i) for i in range(gpu_count())]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in devices)
    return env


class ProgramError(AssertionError):
    """A program exited with an error; the message ends with its output."""


@dataclass
class Program:
    """One started program (``start``), waited for with ``wait``."""

    name: str
    cmd: list[str]
    log_dir: Path
    proc: subprocess.Popen
    started: float
    """``time.monotonic()`` at its start."""
    started_at: float
    """``time.time()`` at its start (its log's timestamps are wall-clock)."""
    check: str
    """The test (and phase) that started it."""
    seconds: float | None = None
    """Its wall time, once it has ended."""

    def wait(self, timeout: float) -> float:
        """Wait for the program; its wall time in seconds, or ``ProgramError`` (the program
        stopped) when it fails or runs past ``timeout`` seconds from its start."""
        try:
            code = self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop("timed out")
            message = f"{self.name}: still running after {timeout:.0f} s\n{self.tail()}"
            raise ProgramError(message) from None
        except BaseException:  # the test was interrupted or timed out: no orphaned ranks
            self.stop("interrupted")
            raise
        self._ended("ok" if code == 0 else f"exit {code}")
        if code != 0:
            raise ProgramError(f"{self.name}: exit status {code}\n{self.tail()}")
        return self.seconds

    def stop(self, outcome: str = "stopped", grace: float = 30.0) -> None:
        """End the program: SIGTERM (torchrun passes it to its ranks), then after ``grace``
        seconds SIGKILL to its whole process group. ``outcome``: what the summary says of it,
        unless it had already ended."""
        code = self.proc.poll()
        if code is not None:
            self._ended("ok" if code == 0 else f"exit {code}")
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._ended(outcome)

    def _ended(self, outcome: str) -> None:
        """Its wall time, recorded once, with the time to its first training iteration."""
        if self.seconds is not None:
            return
        self.seconds = time.monotonic() - self.started
        first, line = None, FIRST_ITERATION.search(self.output())
        if line is not None:
            logged = datetime.datetime.strptime(line.group(1), "%Y-%m-%d %H:%M:%S,%f")
            first = logged.timestamp() - self.started_at
        report.PROGRAMS.append(
            report.ProgramTime(self.name, self.check, self.seconds, outcome, first)
        )

    def tail(self, chars: int = 5000) -> str:
        text = (self.log_dir / f"{self.name}.log").read_text(errors="replace")
        return f"$ {' '.join(self.cmd)}\n...{text[-chars:]}"

    def output(self) -> str:
        return (self.log_dir / f"{self.name}.log").read_text(errors="replace")


def start(
    name: str,
    target: str,
    args: list[str],
    log_dir: Path,
    *,
    nproc: int = 0,
    devices: list[int] | None = None,
    wrapper: str | None = None,
    env: dict | None = None,
) -> Program:
    """Start ``target`` (a path relative to the repository) with ``args``: under
    ``torch.distributed.run --standalone`` on ``nproc`` ranks, or (``nproc=0``) as one plain
    process; ``wrapper``: a script that runs ``target`` itself (``deterministic.py``). Its
    output (both streams, every rank) goes to ``log_dir/name.log``."""
    launcher = []
    if nproc:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    head = [str(Path(__file__).with_name(wrapper))] if wrapper else []
    cmd = [sys.executable, *launcher, *head, str(REPO / target), *map(str, args)]
    log_dir.mkdir(parents=True, exist_ok=True)
    started_at = time.time()
    with open(log_dir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**environment(devices), **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, for ``stop``
        )
    return Program(name, cmd, log_dir, proc, time.monotonic(), started_at, _current_check())


def _current_check() -> str:
    """The running test and phase, from pytest's ``PYTEST_CURRENT_TEST``
    (``tests/gpu/test_gpu_check.py::test_x (setup)`` -> ``test_x (setup)``)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit("::", 1)[-1]


def wait_all(programs: list[Program], timeout: float) -> None:
    """Wait for ``programs``, started side by side, one after another; a failure stops those
    still running and raises ``ProgramError``."""
    try:
        for program in programs:
            program.wait(timeout)
    finally:
        for program in programs:
            program.stop()


def run(name: str, target: str, args: list[str], log_dir: Path, **kw) -> Program:
    """``start`` and wait (``ProgramError`` on failure or after ``sizes().timeout`` s)."""
    program = start(name, target, args, log_dir, **kw)
    program.wait(sizes().timeout)
    return program


@dataclass
class Job:
    """A training run for ``run_jobs``: ``target`` with ``args`` on ``nproc`` ranks."""

    name: str
    target: str
    args: list[str]
    nproc: int
    env: dict | None = None
    """Variables added to the environment (``environment``'s)."""


def run_jobs(jobs: list[Job], log_dir: Path) -> dict[str, Program]:
    """Run ``jobs``, each on GPUs of its own, as many at once as the GPUs allow (started in
    order); on CPU one at a time (they would only share the cores). A failure stops the others
    and raises ``ProgramError``. -> the finished programs by name."""
    if on_cpu():
        return {
            j.name: run(j.name, j.target, j.args, log_dir, nproc=j.nproc, env=j.env) for j in jobs
        }
    free, timeout = list(range(gpu_count())), sizes().timeout
    too_big = [j.name for j in jobs if j.nproc > len(free)]
    if too_big:
        raise ValueError(f"{too_big} need more than the {len(free)} GPUs here")
    pending, running, done = list(jobs), {}, {}
    try:
        while pending or running:
            while pending and pending[0].nproc <= len(free):
                job = pending.pop(0)
                devices, free = free[: job.nproc], free[job.nproc :]
                program = start(
                    job.name,
                    job.target,
                    job.args,
                    log_dir,
                    nproc=job.nproc,
                    devices=devices,
                    env=job.env,
                )
                running[job.name] = (program, devices)
            time.sleep(0.5)
            for name, (program, devices) in list(running.items()):
                late = time.monotonic() - program.started > timeout
                if program.proc.poll() is not None or late:
                    del running[name]
                    free += devices
                    program.wait(timeout)
                    done[name] = program
    finally:
        for program, _ in running.values():
            program.stop()
    return done
