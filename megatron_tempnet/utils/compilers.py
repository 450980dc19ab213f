"""Whether ``torch.compile`` has the compilers it needs on this machine (cheap: no compiling)."""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Mapping


def compiler_missing(
    cuda: bool, environ: Mapping[str, str] = os.environ, include: str | None = None
) -> str | None:
    """What ``torch.compile`` lacks here to compile for the CUDA device (``cuda``) or the CPU, or
    None.

    On a GPU, Triton builds a small C launcher for its kernels: a C compiler (``$CC``, else
    ``gcc`` or ``clang``, as Triton looks for it) and Python's headers (``Python.h`` in
    ``include``, default this interpreter's). On a CPU, inductor needs a C++ compiler (``$CXX``,
    else ``g++``).
    """
    if not cuda:
        cxx = environ.get("CXX", "g++")
        return None if shutil.which(cxx) else f"no C++ compiler ({cxx}) for torch.compile"
    cc = environ.get("CC") or next((c for c in ("gcc", "clang") if shutil.which(c)), None)
    if cc is None or not shutil.which(cc):
        return f"no C compiler ({cc or '$CC, gcc or clang'}) for Triton"
    include = include or sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"no Python headers ({include}/Python.h) for Triton: install python3-dev"
    return None


def compile_error(error: BaseException) -> str:
    """A compiler failure in one line: its type and the first line of its message (at most 300
    characters), for the warning that turns a compiled path off."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"
