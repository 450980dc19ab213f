"""Fresh processes for the tests, started from a server that has the heavy imports done.

Starting Python and importing torch, DeepSpeed and megatron-core costs about 5 s of CPU per
process, several times the work of a tiny training run. The tests therefore start their worker
processes (``run_distributed``'s ranks, and the entry points and tools run by ``run_program``)
through one multiprocessing *forkserver* per test session: it imports those modules once, never
runs a tensor operation itself, and forks every new process from that state. Each process is
still new: its own interpreter state, environment, working directory, command line and exit
status, with nothing shared with the test or with other runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os

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
