"""`make install` on a GPU machine without a CUDA toolkit (the usual fresh GPU machine: a driver,
PyPI's CUDA build of torch, no nvcc).

DeepSpeed installs from its source package, and its setup.py asks every op builder whether it is
compatible; on a GPU three of them ask nvcc for its version, which raises where there is no CUDA
toolkit, and pip stops, whatever ``DS_BUILD_OPS`` says. The test runs the Makefile's own DeepSpeed
line (from ``make -n``) on this interpreter as a GPU machine would see it
(``tests/helpers/gpu_machine``: a CUDA build of torch with a device, no toolkit), as far as pip's
build of the package's metadata, where the failure happens: with the Makefile's environment it
passes, without ``DS_IGNORE_CUDA_DETECTION`` (the earlier line) it fails as it did.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_MACHINE = REPO / "tests" / "helpers" / "gpu_machine"


def _deepspeed_line() -> tuple[dict[str, str], list[str]]:
    """The Makefile's DeepSpeed install command: (its environment, pip's arguments)."""
    plan = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    [line] = [x for x in plan.splitlines() if "pip install" in x and x.endswith(" deepspeed")]
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    pip = words[words.index("pip") + 1 :]
    return env, pip


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """DeepSpeed's source package at the pinned version (pip's cache makes it one download)."""
    where = tmp_path_factory.mktemp("sdist")
    pins = dict(
        line.split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        + ["-d", str(where), f"deepspeed=={pins['deepspeed']}"],
        check=True,
        capture_output=True,
    )
    return where


def _build_metadata(build_env: dict[str, str], pip: list[str], sdist: Path):
    """pip's install, on the emulated GPU machine, up to the package's metadata (``--dry-run``
    runs setup.py and installs nothing)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_")}
    env.update(build_env, PYTHONPATH=str(GPU_MACHINE))
    local = ["--dry-run", "--ignore-installed", "--no-deps", "--no-cache-dir", "--no-index"]
    return subprocess.run(
        [sys.executable, "-m", "pip", *pip, *local, "--find-links", str(sdist)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )


def test_deepspeed_builds_on_a_gpu_machine_without_a_cuda_toolkit(sdist):
    build_env, pip = _deepspeed_line()
    assert build_env == {"DS_BUILD_OPS": "0", "DS_IGNORE_CUDA_DETECTION": "1"}
    assert "--no-build-isolation" in pip  # DeepSpeed's setup.py imports the installed torch
    done = _build_metadata(build_env, pip, sdist)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Would install deepspeed-" in done.stdout
    # the earlier line, without DS_IGNORE_CUDA_DETECTION: pip stops in DeepSpeed's setup.py,
    # in the op builders' question for nvcc, which they ask only where torch sees a GPU (the
    # emulation is a GPU machine) and which fails without a toolkit (it has none)
    earlier = _build_metadata({"DS_BUILD_OPS": "0"}, pip, sdist)
    assert earlier.returncode != 0
    assert "MissingCUDAException: CUDA_HOME does not exist" in earlier.stdout + earlier.stderr
