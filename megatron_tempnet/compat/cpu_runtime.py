"""The CPU runtime: megatron-core on a machine without a GPU (gloo, CPU tensors).

megatron-core assumes CUDA in three places that matter for CPU runs:

* about a hundred call sites allocate buffers with ``device=torch.cuda.current_device()``
  (all-gathers, the global memory buffer of core attention, GPU weight init), which raises on a
  CPU-only build of torch;
* the RNG tracker behind ``get_cuda_rng_tracker().fork()`` (dropout inside tensor-parallel
  regions, activation recompute) saves and restores CUDA generator states;
* the causal mask core attention builds when it is given none (``get_default_causal_mask``) is
  allocated with ``device="cuda"``.

``apply_cpu_support`` redirects all three to the CPU: ``torch.cuda.current_device()`` returns the
CPU device, megatron-core's tracker class and RNG state accessors are replaced by versions that
keep named CPU generator states, and the default causal mask is built on the CPU. It is a no-op
when CUDA is available, and idempotent.

A CPU generator's state (Mersenne Twister, 5056 bytes) and a CUDA one's (Philox seed and offset)
are different things: the tracker states a checkpoint holds restore only into the runtime that
saved them (``rng_runtime``, ``tracker_states_restorable``). Across runtimes the streams start
from their seeds, as after a layout change.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_tempnet.compat.checks import check_megatron_core
from megatron_tempnet.utils.logging import get_logger

_applied = False
logger = get_logger(__name__)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _get_cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal (the positions a query must not see)."""
    return torch.ones(sq, sq, dtype=torch.bool, device=_cpu_current_device()).triu(1)


def _make_cpu_tracker_class(base: type, default_name: str) -> type:
    class CPURNGStatesTracker(base):
        """megatron-core's RNG tracker keeping named CPU generator states.

        ``fork(name)`` swaps the CPU default generator to the named state for the duration of the
        block, exactly as the CUDA tracker swaps the CUDA generator.
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"RNG tracker seed {seed} is already used")
            if name in self.states_:
                raise ValueError(f"RNG tracker state {name!r} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = default_name):
            if name not in self.states_:
                raise KeyError(f"RNG tracker state {name!r} was never added")
            outer_state = torch.get_rng_state()
            outer_name = self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CPURNGStatesTracker


def apply_cpu_support() -> bool:
    """Make megatron-core usable on CPU. Returns True if the CPU runtime is (now) active.

    Does nothing and returns False when CUDA is available. Call it before building any
    megatron-core model; it is safe to call many times.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    check_megatron_core()
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer import utils as transformer_utils

    torch.cuda.current_device = _cpu_current_device
    mc_random._get_cuda_rng_state = _get_cpu_rng_state
    mc_random._set_cuda_rng_state = _set_cpu_rng_state
    tracker_cls = _make_cpu_tracker_class(
        mc_random.CudaRNGStatesTracker, mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    )
    mc_random.CudaRNGStatesTracker = tracker_cls
    mc_random._CUDA_RNG_STATE_TRACKER = tracker_cls()
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask  # imported by name there
    _applied = True
    logger.debug("CPU runtime for megatron-core applied")
    return True


def rng_runtime() -> str:
    """Whose generator states megatron-core's RNG tracker keeps here: ``"cpu"`` (this runtime)
    or ``"cuda"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def tracker_states_restorable(saved_runtime: str) -> bool:
    """Whether tracker states saved under ``saved_runtime`` (``rng_runtime``'s) can be set here."""
    return saved_runtime == rng_runtime()
