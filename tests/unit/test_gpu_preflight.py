"""``make gpu-check``'s preflight (tests/gpu/preflight.py): it never passes where GPUs are listed
and torch sees none.

The decision is checked case by case on made-up facts; then ``make gpu-check`` itself runs, with
a stand-in ``nvidia-smi`` on an otherwise empty PATH, and torch's CUDA version set by a
``sitecustomize.py`` (torch.cuda stays unavailable: a CPU build, or a CUDA build whose driver is
too old). Without the preflight (the Makefile's inline check before it) the GPU cases exited 0
with "skipped: no CUDA device".
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.preflight import (
    SKIP,
    Facts,
    Gpu,
    decide,
    describe,
    min_driver,
    parse_smi,
    parse_version,
)

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = REPO / "Makefile"
H100 = Gpu("580.65.06", "NVIDIA H100 80GB HBM3")
A100_535 = Gpu("535.183.01", "NVIDIA A100-SXM4-80GB")
VENV = Facts(python="/repo/.venv/bin/python", venv=True, torch_version="2.13.0+cpu")
"""A CPU build of torch in the repository's venv on a machine without nvidia-smi."""


def with_gpus(facts: Facts, *gpus: Gpu, **changes) -> Facts:
    return dataclasses.replace(facts, gpus=gpus, smi_error=None, **changes)


def test_nvidia_smi_lines_parse_into_driver_and_name():
    text = "580.65.06, NVIDIA H100 80GB HBM3\n580.65.06, NVIDIA H100 80GB HBM3\n\n"
    assert parse_smi(text) == (H100, H100)
    assert parse_smi("") == ()
    assert parse_smi("No devices were found\n") == ()
    assert parse_version("535.183.01") == (535, 183, 1) and parse_version("[N/A]") is None
    assert parse_version(None) is None


def test_the_minimum_driver_follows_the_cuda_major_version():
    assert min_driver("13.0") == min_driver("13.2") == (580,)
    assert min_driver("12.0") == min_driver("12.8") == (525, 60, 13)
    assert min_driver("11.8") == (450, 80, 2)
    assert min_driver("10.2") is None and min_driver("") is None


def test_the_versions_are_described_whatever_the_verdict():
    assert describe(VENV) == [
        "torch 2.13.0+cpu (CPU build), /repo/.venv/bin/python",
        "no nvidia-smi",
    ]
    facts = with_gpus(VENV, H100, H100, torch_version="2.13.0+cu130", torch_cuda="13.0")
    assert describe(facts) == [
        "torch 2.13.0+cu130 (CUDA 13.0), /repo/.venv/bin/python",
        "NVIDIA driver 580.65.06: 2 x NVIDIA H100 80GB HBM3 (nvidia-smi)",
    ]
    failed = dataclasses.replace(VENV, smi_error="nvidia-smi failed (exit 9): NVIDIA-SMI has")
    assert describe(failed)[1] == "nvidia-smi failed (exit 9): NVIDIA-SMI has"


def test_an_nvidia_smi_that_fails_is_a_gpu_machine_that_fails():
    failed = dataclasses.replace(VENV, smi_error="nvidia-smi failed (exit 9): NVIDIA-SMI has")
    verdict = decide(failed)
    assert verdict.status == 1
    assert verdict.lines[0] == (
        "FAILED: nvidia-smi failed (exit 9): NVIDIA-SMI has: an NVIDIA driver is installed but "
        "does not answer"
    )


def test_a_cpu_machine_skips_and_a_seen_gpu_runs():
    skipped = decide(VENV)
    assert skipped.status == SKIP
    assert skipped.lines[0].startswith("skipped: no CUDA device")
    seen = with_gpus(VENV, H100, torch_cuda="13.0", cuda_available=True, device_count=1)
    assert decide(seen).status == 0
    # CUDA seen without nvidia-smi on PATH (some containers): the checks run
    assert decide(dataclasses.replace(seen, gpus=(), smi_error="no nvidia-smi")).status == 0
    # the CPU smoke run was asked for: it runs, GPUs or not
    assert decide(with_gpus(VENV, H100, on_cpu=True)).status == 0
    assert decide(dataclasses.replace(VENV, on_cpu=True)).status == 0


def test_torch_that_cannot_be_imported_fails():
    facts = Facts(python="python3", venv=False, torch_version=None, torch_error="No module")
    verdict = decide(facts)
    assert verdict.status == 1 and "cannot import torch" in verdict.lines[0]
    assert describe(facts)[0] == "torch: cannot be imported by python3 (No module)"


def test_a_cpu_build_beside_listed_gpus_fails_with_a_reinstall():
    verdict = decide(with_gpus(VENV, H100))
    assert verdict.status == 1
    assert verdict.lines[0] == (
        "FAILED: nvidia-smi lists 1 GPU but torch sees none: torch 2.13.0+cpu is a CPU build"
    )
    fix = verdict.lines[1]
    # a plain `make install` keeps 2.13.0+cpu: it satisfies torch==2.13.0
    assert fix.startswith("fix: .venv/bin/python -m pip uninstall -y torch && make -B install:")
    assert "CUDA 13.0" in fix and "TORCH_INDEX=<pytorch.org index>" in fix
    # another interpreter: pip's commands for it
    other = decide(with_gpus(VENV, H100, python="/usr/bin/python3", venv=False)).lines[1]
    assert other.startswith(
        "fix: /usr/bin/python3 -m pip uninstall -y torch && "
        "/usr/bin/python3 -m pip install -c constraints.txt torch==2.13.0:"
    )
    assert "--index-url <pytorch.org index>" in other


def test_a_cpu_build_with_an_older_driver_names_a_build_it_runs():
    fix = decide(with_gpus(VENV, A100_535, A100_535)).lines[1]
    assert "make -B install TORCH_INDEX=<pytorch.org's CUDA 12 index" in fix
    assert "driver 535.183.01 is too old" in fix and ">= 580" in fix
    ancient = decide(with_gpus(VENV, Gpu("470.42.01", "Tesla V100"))).lines[1]
    assert ancient.startswith("fix: upgrade the driver:") and ">= 525.60.13" in ancient


def test_a_cuda_build_newer_than_the_driver_fails_naming_both():
    facts = with_gpus(VENV, A100_535, torch_version="2.13.0+cu130", torch_cuda="13.0")
    verdict = decide(facts)
    assert verdict.status == 1
    assert verdict.lines[0] == (
        "FAILED: nvidia-smi lists 1 GPU but torch sees none: torch 2.13.0+cu130 is a CUDA 13.0 "
        "build, which needs NVIDIA driver >= 580; this driver is 535.183.01"
    )
    assert verdict.lines[1].startswith("fix: upgrade the driver to >= 580, or install a CUDA 12")
    cuda12 = with_gpus(VENV, Gpu("520.61.05", "Tesla T4"), torch_cuda="12.4")
    assert decide(cuda12).lines[1] == (
        "fix: upgrade the driver to >= 525.60.13, or install a torch built for CUDA 11.x"
    )


def test_gpus_hidden_from_a_new_enough_driver_report_what_torch_cuda_says():
    facts = with_gpus(
        VENV,
        H100,
        torch_version="2.13.0+cu130",
        torch_cuda="13.0",
        visible_devices="",
        init_error="No CUDA GPUs are available",
    )
    verdict = decide(facts)
    assert verdict.status == 1
    assert verdict.lines[0] == (
        "FAILED: nvidia-smi lists 1 GPU but torch sees none: the driver is new enough for CUDA "
        "13.0 (>= 580), yet torch does not see a GPU: torch.cuda.device_count() = 0, "
        "torch.cuda.init(): No CUDA GPUs are available; CUDA_VISIBLE_DEVICES=''"
    )
    assert "CUDA_VISIBLE_DEVICES" in verdict.lines[1]
    # exactly the oldest driver CUDA 12 runs on is new enough
    edge = with_gpus(VENV, Gpu("525.60.13", "NVIDIA A10"), torch_cuda="12.8")
    assert "the driver is new enough for CUDA 12.8" in decide(edge).lines[0]
    # a CUDA this check has no minimum for, or a driver it cannot read: what torch says
    unknown = with_gpus(VENV, H100, torch_cuda="14.0")
    assert "no known minimum driver for CUDA 14.0" in decide(unknown).lines[0]
    unread = with_gpus(VENV, Gpu("[N/A]", "NVIDIA H100"), torch_cuda="13.0")
    assert "yet torch does not see a GPU" in decide(unread).lines[0]


needs_no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="torch sees a GPU here: make gpu-check would run the checks"
)


def _make(tmp_path: Path, smi: str | None, cuda: str | None):
    """``make gpu-check GPU_PYTHON=<this interpreter>`` from the repository, its PATH an empty
    directory but for a stand-in ``nvidia-smi`` printing ``smi`` (None: no nvidia-smi), and
    ``torch.version.cuda`` set to ``cuda`` (None: a CPU build) before the preflight reads it."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    site.mkdir()
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{smi}'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    (site / "sitecustomize.py").write_text(f"import torch\ntorch.version.cuda = {cuda!r}\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GPU_CHECK_ON_CPU", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    }
    env.update(PATH=str(bin_dir), PYTHONPATH=str(site))
    return subprocess.run(
        [shutil.which("make"), "--no-print-directory", "-f", str(MAKEFILE), "gpu-check"]
        + [f"GPU_PYTHON={sys.executable}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@needs_no_gpu
def test_make_gpu_check_fails_with_a_cpu_build_of_torch_beside_a_gpu(tmp_path):
    done = _make(tmp_path, "580.65.06, NVIDIA H100 80GB HBM3", None)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f"gpu-check: torch {torch.__version__} (CPU build), {sys.executable}" in out
    assert "gpu-check: NVIDIA driver 580.65.06: NVIDIA H100 80GB HBM3 (nvidia-smi)" in out
    assert "but torch sees none: torch" in out and "is a CPU build" in out
    assert "pip uninstall -y torch" in out and "skipped" not in out


@needs_no_gpu
def test_make_gpu_check_fails_with_a_driver_too_old_for_torchs_cuda(tmp_path):
    done = _make(tmp_path, "535.183.01, NVIDIA A100-SXM4-80GB", "13.0")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f"gpu-check: torch {torch.__version__} (CUDA 13.0)" in out
    assert "gpu-check: NVIDIA driver 535.183.01: NVIDIA A100-SXM4-80GB (nvidia-smi)" in out
    assert "needs NVIDIA driver >= 580; this driver is 535.183.01" in out
    assert "fix: upgrade the driver to >= 580" in out


@needs_no_gpu
def test_make_gpu_check_skips_on_a_machine_without_nvidia_smi(tmp_path):
    done = _make(tmp_path, None, None)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.splitlines() == [
        f"gpu-check: torch {torch.__version__} (CPU build), {sys.executable}",
        "gpu-check: no nvidia-smi",
        "gpu-check: skipped: no CUDA device (torch.cuda.is_available() is False and nvidia-smi "
        "lists no GPU)",
    ]
