"""Run an entry point with PyTorch's deterministic algorithms: ``python deterministic.py
pretrain_gpt.py FLAGS...`` (also under ``torch.distributed.run``).

The exact-resume check compares a resumed run with an uninterrupted one bit for bit. On a GPU
that needs more than a complete checkpoint: by default the flash and memory-efficient attention
backward passes and the fused output stage's ``index_add_`` accumulate with atomics, so two
identical runs already differ in the last bits. Deterministic mode switches them (and every
other kernel that has one) to their deterministic variants; ``CUBLAS_WORKSPACE_CONFIG`` does the
same for cuBLAS. It is strict (not ``warn_only``, under which the attention kernels stay
non-deterministic): a kernel with no deterministic variant stops the run with an error that
names it. Uninitialised memory is not filled (that costs bandwidth and changes no result of a
correct program).
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initialises
    import torch
    import torch.utils.deterministic

    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` would have it
    runpy.run_path(script, run_name="__main__")
