"""``make gpu-check``'s first step: is there a GPU here, and does torch see it?

It always prints torch's version, the CUDA version torch was built for, and the NVIDIA driver's
version and GPUs as ``nvidia-smi`` lists them. Then, by exit status (the Makefile reads it):

- 0: torch sees a CUDA device (or ``GPU_CHECK_ON_CPU=1`` asks for the CPU smoke run): the checks
  run;
- ``SKIP`` (3): a CPU machine, no GPU listed and none seen: one line, and ``make`` exits 0;
- 1: ``nvidia-smi`` lists GPUs that torch does not see (a CPU build of torch, a driver too old
  for torch's CUDA, or the devices hidden), or ``nvidia-smi`` is there and fails (a driver that
  does not answer): the reason and the fix. Passing there would be a false green.

Run as ``GPU_PYTHON tests/gpu/preflight.py``: it needs only the standard library and torch (the
project need not be importable). Everything but ``gather`` is a pure function of the facts it
collects (tests/unit/test_gpu_preflight.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import dataclass

SKIP = 3
"""Exit status of a CPU machine: nothing to check, ``make gpu-check`` exits 0."""
ON_CPU_ENV = "GPU_CHECK_ON_CPU"
SMI_QUERY = ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"]
MIN_DRIVER = {13: (580,), 12: (525, 60, 13), 11: (450, 80, 2)}
"""The oldest Linux driver that runs a CUDA major version's builds (NVIDIA's minor-version
compatibility: 13.x from 580, 12.x from 12.0's 525.60.13, 11.x from 450.80.02)."""
PYPI_CUDA = "13.0"
"""The CUDA of PyPI's torch 2.13 wheel for Linux x86_64 (its metadata asks for cuda-toolkit
13.0.3); a pytorch.org index (``TORCH_INDEX``) has the other CUDA builds."""
PYPI_BUILD = f"PyPI's torch 2.13 for Linux x86_64, built for CUDA {PYPI_CUDA}"
CUDA12_INDEX = "<pytorch.org's CUDA 12 index, e.g. https://download.pytorch.org/whl/cu128>"


@dataclass(frozen=True)
class Gpu:
    driver: str
    name: str


@dataclass(frozen=True)
class Facts:
    """What the decision needs, collected by ``gather``."""

    python: str
    """The interpreter (``GPU_PYTHON``)."""
    venv: bool
    """Whether that is the repository's ``.venv`` (which ``make install`` builds)."""
    torch_version: str | None
    """None: torch cannot be imported (``torch_error`` says why)."""
    torch_cuda: str | None = None
    """``torch.version.cuda``; None: a CPU build."""
    cuda_available: bool = False
    device_count: int = 0
    init_error: str | None = None
    """What ``torch.cuda.init()`` raised (and what ``is_available()`` warned), if it did."""
    torch_error: str | None = None
    gpus: tuple[Gpu, ...] = ()
    smi_error: str | None = "no nvidia-smi"
    """Why ``gpus`` is empty when nvidia-smi did not list them; None: it ran."""
    visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES``, if set."""
    on_cpu: bool = False
    """``GPU_CHECK_ON_CPU=1``: the CPU smoke run was asked for."""


@dataclass(frozen=True)
class Verdict:
    status: int
    """0: run the checks; ``SKIP``: a CPU machine; 1: a GPU torch cannot use."""
    lines: list[str]


def parse_smi(text: str) -> tuple[Gpu, ...]:
    """``nvidia-smi --query-gpu=driver_version,name --format=csv,noheader``'s lines
    (``580.65.06, NVIDIA H100 80GB HBM3``), one GPU each."""
    gpus = []
    for line in text.splitlines():
        driver, sep, name = line.partition(",")
        if sep and driver.strip():
            gpus.append(Gpu(driver.strip(), name.strip()))
    return tuple(gpus)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``"535.183.01"`` -> ``(535, 183, 1)``; None when it is not dotted numbers."""
    if not text or not re.fullmatch(r"\d+(\.\d+)*", text.strip()):
        return None
    return tuple(int(part) for part in text.strip().split("."))


def min_driver(cuda: str) -> tuple[int, ...] | None:
    """The oldest driver that runs CUDA ``cuda``'s builds (None: not known here)."""
    version = parse_version(cuda)
    return MIN_DRIVER.get(version[0]) if version else None


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(f"{v:02d}" if i else str(v) for i, v in enumerate(version))


def describe(facts: Facts) -> list[str]:
    """The versions, printed whatever the verdict: torch, its CUDA, the driver and its GPUs."""
    if facts.torch_version is None:
        torch = f"torch: cannot be imported by {facts.python} ({facts.torch_error})"
    else:
        build = f"CUDA {facts.torch_cuda}" if facts.torch_cuda else "CPU build"
        torch = f"torch {facts.torch_version} ({build}), {facts.python}"
    if facts.gpus:
        drivers = ", ".join(sorted({g.driver for g in facts.gpus}))
        counts = Counter(g.name for g in facts.gpus)
        names = ", ".join(f"{n} x {name}" if n > 1 else name for name, n in counts.items())
        smi = f"NVIDIA driver {drivers}: {names} (nvidia-smi)"
    else:
        smi = facts.smi_error or "nvidia-smi lists no GPU"
    return [torch, smi]


def _reinstall(facts: Facts, index: str | None = None) -> str:
    """The commands that replace ``facts``'s torch with the build of ``index`` (default: pip's,
    PyPI's CUDA build). A plain ``make install`` would keep it: 2.13.0+cpu satisfies
    ``torch==2.13.0``."""
    version = (facts.torch_version or "2.13.0").split("+")[0]
    if facts.venv:
        extra = f" TORCH_INDEX={index}" if index else ""
        return f".venv/bin/python -m pip uninstall -y torch && make -B install{extra}"
    extra = f" --index-url {index}" if index else ""
    return (
        f"{facts.python} -m pip uninstall -y torch && "
        f"{facts.python} -m pip install -c constraints.txt{extra} torch=={version}"
    )


def _driver(facts: Facts) -> tuple[int, ...] | None:
    versions = {parse_version(g.driver) for g in facts.gpus}
    return min(versions) if None not in versions else None


def _cpu_build(facts: Facts) -> list[str]:
    """Case (a): torch is a CPU build."""
    driver = _driver(facts)
    reason = f"torch {facts.torch_version} is a CPU build"
    if driver is None or driver >= MIN_DRIVER[13]:
        fix = (
            f"{_reinstall(facts)}: pip's default index gives {PYPI_BUILD}; for another CUDA "
            f"add {'TORCH_INDEX=' if facts.venv else '--index-url '}<pytorch.org index>"
        )
    elif driver >= MIN_DRIVER[12]:
        fix = (
            f"{_reinstall(facts, CUDA12_INDEX)}: driver {_dotted(driver)} is too old for "
            f"{PYPI_BUILD}, which needs >= {_dotted(MIN_DRIVER[13])}; or upgrade the driver, "
            f"then {_reinstall(facts)}"
        )
    else:
        fix = (
            f"upgrade the driver: {PYPI_BUILD} needs >= {_dotted(MIN_DRIVER[13])}, a CUDA 12 "
            f"build >= {_dotted(MIN_DRIVER[12])}; then {_reinstall(facts)}"
        )
    return [reason, f"fix: {fix}"]


def _old_driver(facts: Facts, needed: tuple[int, ...], driver: tuple[int, ...]) -> list[str]:
    """Case (b): torch's CUDA needs a newer driver than the one installed."""
    cuda = facts.torch_cuda
    reason = (
        f"torch {facts.torch_version} is a CUDA {cuda} build, which needs NVIDIA driver >= "
        f"{_dotted(needed)}; this driver is {_dotted(driver)}"
    )
    fix = f"fix: upgrade the driver to >= {_dotted(needed)}"
    older = [m for m, v in sorted(MIN_DRIVER.items(), reverse=True) if driver >= v]
    if older and older[0] == 12:
        fix += f", or install a CUDA 12 build: {_reinstall(facts, CUDA12_INDEX)}"
    elif older:
        fix += f", or install a torch built for CUDA {older[0]}.x"
    return [reason, fix]


def _hidden(facts: Facts) -> list[str]:
    """Case (c): the driver is new enough (or its need unknown) and torch still sees nothing."""
    needed = min_driver(facts.torch_cuda or "")
    why = (
        f"the driver is new enough for CUDA {facts.torch_cuda} (>= {_dotted(needed)})"
        if needed
        else f"no known minimum driver for CUDA {facts.torch_cuda}"
    )
    visible = (
        f"CUDA_VISIBLE_DEVICES={facts.visible_devices!r}"
        if facts.visible_devices is not None
        else "CUDA_VISIBLE_DEVICES is not set"
    )
    reports = f"torch.cuda.device_count() = {facts.device_count}"
    if facts.init_error:
        reports += f", torch.cuda.init(): {facts.init_error}"
    return [
        f"{why}, yet torch does not see a GPU: {reports}; {visible}",
        "fix: make the GPUs visible to this process (CUDA_VISIBLE_DEVICES, the container's "
        "GPU access, e.g. docker run --gpus all) and check that torch loads this driver's "
        "libcuda.so",
    ]


def decide(facts: Facts) -> Verdict:
    """Run, skip or fail, with the lines that say why (printed after ``describe``'s)."""
    if facts.torch_version is None:
        return Verdict(1, [f"FAILED: GPU_PYTHON={facts.python} cannot import torch"])
    if facts.on_cpu:
        return Verdict(0, [f"{ON_CPU_ENV}=1: the harness's smoke run on CPU (gloo, small sizes)"])
    if facts.cuda_available:
        n = facts.device_count
        return Verdict(0, [f"torch sees {n} CUDA device{'s' if n > 1 else ''}: running the checks"])
    if not facts.gpus and (facts.smi_error or "").startswith("nvidia-smi failed"):
        return Verdict(
            1,
            [
                f"FAILED: {facts.smi_error}: an NVIDIA driver is installed but does not answer",
                "fix: run nvidia-smi alone for the driver's own message (a kernel module not "
                "loaded, or a driver and library of two versions: reboot after a driver update)",
            ],
        )
    if not facts.gpus:
        reason = "torch.cuda.is_available() is False and nvidia-smi lists no GPU"
        return Verdict(SKIP, [f"skipped: no CUDA device ({reason})"])
    n = len(facts.gpus)
    listed = f"nvidia-smi lists {n} GPU{'s' if n > 1 else ''} but torch sees none"
    needed, driver = min_driver(facts.torch_cuda or ""), _driver(facts)
    if facts.torch_cuda is None:
        lines = _cpu_build(facts)
    elif needed and driver and driver < needed:
        lines = _old_driver(facts, needed, driver)
    else:
        lines = _hidden(facts)
    return Verdict(1, [f"FAILED: {listed}: {lines[0]}", *lines[1:]])


def _nvidia_smi() -> tuple[tuple[Gpu, ...], str | None]:
    if shutil.which(SMI_QUERY[0]) is None:
        return (), "no nvidia-smi"
    try:
        done = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return (), f"nvidia-smi failed: {e}"
    if done.returncode != 0:
        message = (done.stdout + done.stderr).strip().splitlines()
        return (), f"nvidia-smi failed (exit {done.returncode}): {' '.join(message)[:300]}"
    gpus = parse_smi(done.stdout)
    return gpus, None if gpus else "nvidia-smi lists no GPU"


def gather() -> Facts:
    """Ask torch and nvidia-smi (the only impure part)."""
    venv = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), ".venv")
    gpus, smi_error = _nvidia_smi()
    common = {
        "python": sys.executable,
        "venv": os.path.realpath(sys.prefix) == os.path.realpath(venv),
        "gpus": gpus,
        "smi_error": smi_error,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "on_cpu": os.environ.get(ON_CPU_ENV, "").strip() not in ("", "0"),
    }
    try:
        import torch
    except Exception as e:  # any failure to import is reported as it is
        return Facts(torch_version=None, torch_error=f"{type(e).__name__}: {e}", **common)
    with warnings.catch_warnings(record=True) as caught:  # "driver too old" comes as a warning
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
        count = torch.cuda.device_count()
    errors = [str(w.message).strip() for w in caught]
    if not available:
        try:
            torch.cuda.init()
        except Exception as e:  # what torch says is the report
            errors.append(str(e).strip() or type(e).__name__)
    return Facts(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=available,
        device_count=count,
        init_error="; ".join(dict.fromkeys(errors)) or None,
        **common,
    )


def main() -> int:
    facts = gather()
    verdict = decide(facts)
    for line in describe(facts) + verdict.lines:
        print(f"gpu-check: {line}", flush=True)
    return verdict.status


if __name__ == "__main__":
    sys.exit(main())
