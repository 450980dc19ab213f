"""Run the training entry points as a user does: flags from a dict, torchrun or one process."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def run_entry_point(script: str, nproc: int, args: list[str],
                    check: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    """``script`` under torchrun with ``nproc`` CPU ranks (gloo); ``nproc=0``: plain python
    (what a user sees directly)."""
    launcher = [] if nproc == 0 else ["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={nproc}"]  # fmt: skip
    cmd = [sys.executable, *launcher, os.path.join(REPO, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r
