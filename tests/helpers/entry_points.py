"""Run the entry points and tools as a user does: flags from a dict, N ranks or one process.

``run_program`` runs a script (``pretrain_gpt.py``, ``tools/generate.py``) or a module (``-m``)
as ``__main__`` in fresh processes with the environment torchrun gives its workers (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); with ``nproc=0`` as a plain
``python script.py`` (no launcher variables). Like torchrun it stops the other ranks when one
fails and reports 1 for any failure (the process's own status with ``nproc=0``). The processes
come from the session's preloaded server (``processes``), so a run does not pay for the imports
again. Every process enforces the GPU's device rules (``device_rules``: NCCL's and CUDA's
refusals of host tensors, host synchronisations counted per iteration). examples/quickstart.py
and the SLURM tests run torchrun and srun themselves, without the rule.
"""

from __future__ import annotations

import atexit
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback

from tests.helpers import device_rules
from tests.helpers.processes import as_a_started_process, context

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_GRACE = 30.0  # seconds the other ranks get to stop after one has failed


def cli_flags(base: dict, **flags) -> list[str]:
    """``{"train-iters": 10, "bf16": True, "load": None}`` -> ``["--train-iters", "10",
    "--bf16"]``: later flags override, True is a bare switch, None and False are left out."""
    out = []
    for key, value in {**base, **flags}.items():
        if value is True:
            out.append(f"--{key}")
        elif value is not None and value is not False:
            out += [f"--{key}", str(value)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(
    target: str,
    args: list[str],
    module: bool,
    env: dict,
    cwd: str,
    out: str,
    err: str,
    stdin: str | None,
    setup: tuple | None = None,
    device_rule: str | None = None,
) -> None:
    """One process: ``python target args`` (or ``python -m target args``); ``setup``: ``(f,
    *args)`` called first (a test's fault injection, ``tests.helpers.faults``); ``device_rule``:
    a directory: enforce the GPU's device rules (``tests.helpers.device_rules``) and write the
    host synchronisations per iteration there."""
    as_a_started_process()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    if stdin is not None:
        sys.stdin = open(stdin, encoding="utf-8")  # noqa: SIM115 (the process's stdin)
    code = 0
    try:
        if device_rule is not None:
            device_rules.install_for_run(device_rule)
        if setup is not None:
            setup[0](*setup[1:])
        if module:
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # what the interpreter does at exit
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run_program(
    target: str,
    args: list[str],
    nproc: int = 0,
    *,
    module: bool = False,
    env: dict | None = None,
    timeout: float = 600,
    input: str | None = None,
    setup: tuple | None = None,
    device_rule: str | bool = True,
) -> subprocess.CompletedProcess:
    """Run ``target`` (a path, relative to the repository, or a module with ``module``) with
    ``args`` on ``nproc`` ranks (0: one plain process); returns its status and output.
    ``setup``: ``(f, *args)`` each process calls first; ``device_rule``: every process enforces
    the GPU's device rules (``tests.helpers.device_rules``), and writes its host
    synchronisations per iteration into the directory given (False: no rule)."""
    with tempfile.TemporaryDirectory() as tmp:
        running = Running(target, args, nproc, tmp, module=module, env=env, input=input)
        running.start(setup, device_rule)
        return running.wait(timeout)


class Running:
    """Ranks started and not waited for yet (``run_program``'s parts, for a test that signals
    them while they run): ``start``, then ``wait``; ``procs`` are the ranks."""

    def __init__(self, target, args, nproc, tmp, *, module=False, env=None, input=None):
        self.target, self.args, self.nproc, self.tmp = target, [str(a) for a in args], nproc, tmp
        self.module, self.procs = module, []
        self.path = target if module else os.path.join(REPO, target)
        self.base = dict(os.environ if env is None else env)
        self.base.setdefault("OMP_NUM_THREADS", "1")
        self.base.setdefault("DS_ACCELERATOR", "cpu")
        self.stdin = None
        if input is not None:
            self.stdin = os.path.join(tmp, "stdin")
            with open(self.stdin, "w", encoding="utf-8") as f:
                f.write(input)

    def start(self, setup: tuple | None = None, device_rule: str | bool = True) -> Running:
        ctx, port = context(), str(_free_port())
        if device_rule is True:
            device_rule = os.path.join(self.tmp, "device_rule")
        device_rule = device_rule or None
        for rank in range(max(self.nproc, 1)):
            rank_env = dict(self.base)
            if self.nproc:
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(self.nproc),
                    LOCAL_WORLD_SIZE=str(self.nproc),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                )
            out, err = self._output(rank)
            main_args = (self.path, self.args, self.module, rank_env, os.getcwd(), out, err)
            self.procs.append(
                ctx.Process(target=_main, args=(*main_args, self.stdin, setup, device_rule))
            )
        for p in self.procs:
            p.start()
        return self

    def _output(self, rank: int) -> tuple[str, str]:
        return os.path.join(self.tmp, f"out{rank}"), os.path.join(self.tmp, f"err{rank}")

    def wait(self, timeout: float = 600, grace: float = _GRACE) -> subprocess.CompletedProcess:
        """Every rank's end (the others get ``grace`` seconds once one has failed); the
        status (1 for any failure with ranks) and the output of all ranks."""
        try:
            codes = _wait(self.procs, timeout, [str(self.target), *self.args], grace)
        finally:
            _stop(self.procs)
        ranks = range(max(self.nproc, 1))
        stdout = "".join(_read(self._output(r)[0]) for r in ranks)
        stderr = "".join(_read(self._output(r)[1]) for r in ranks)
        code = codes[0] if not self.nproc else (0 if all(c == 0 for c in codes) else 1)
        return subprocess.CompletedProcess([self.target, *self.args], code, stdout, stderr)


def _wait(procs, timeout: float, cmd: list[str], grace: float = _GRACE) -> list[int]:
    """Every exit status; when one rank fails, the others get ``grace`` seconds, then stop."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            raise subprocess.TimeoutExpired(cmd, timeout)
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None and now - failed_at > grace:
            break
        for p in procs:
            if p.exitcode is None:
                p.join(0.05)
                break
    return [p.exitcode if p.exitcode is not None else -15 for p in procs]


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def run_entry_point(
    script: str,
    nproc: int,
    args: list[str],
    check: bool = True,
    env: dict | None = None,
    device_rule: str | bool = True,
) -> subprocess.CompletedProcess:
    """``script`` (``pretrain_gpt.py``, ``pretrain_clip.py``) on ``nproc`` CPU ranks (gloo);
    ``nproc=0``: a plain process (what a user sees directly); ``env``: its environment;
    ``device_rule``: ``run_program``'s."""
    r = run_program(script, args, nproc, env=env, device_rule=device_rule)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


def run_command(
    cmd: list[str], *, env: dict | None = None, timeout: float = 600, input: str | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` for the project's own programs:
    ``[python, script, ...]``, ``[python, -m, module, ...]`` and the same after
    ``-m torch.distributed.run --standalone --nproc-per-node=N``, through ``run_program``."""
    if cmd[0] != sys.executable:
        raise ValueError(f"not a Python command: {cmd}")
    args, nproc = [str(a) for a in cmd[1:]], 0
    if args[:2] == ["-m", "torch.distributed.run"]:
        args = args[2:]
        while args[0].startswith("--"):  # the launcher's options
            option = args.pop(0)
            if option.startswith("--nproc-per-node="):
                nproc = int(option.split("=", 1)[1])
            elif option == "--nproc-per-node":
                nproc = int(args.pop(0))
    module = args[0] == "-m"
    if module:
        args = args[1:]
    return run_program(
        args[0], args[1:], nproc, module=module, env=env, timeout=timeout, input=input
    )
