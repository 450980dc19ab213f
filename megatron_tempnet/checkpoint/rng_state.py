"""A rank's random number generator states: saved with each checkpoint, restored on a resume at
the layout that saved them."""

from __future__ import annotations

import torch

from megatron_tempnet import compat
from megatron_tempnet.utils.logging import log_rank0


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
        "runtime": compat.rng_runtime(),  # whose generator states the tracker's are
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """The saved streams, where they fit: the CPU's always; the tracker's (dropout) and CUDA's
    only on the runtime that saved them (a CPU generator's state is no CUDA one's)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    saved = state.get("runtime", "cuda" if "cuda" in state else "cpu")  # older files: inferred
    if not compat.tracker_states_restorable(saved):
        log_rank0(
            "the checkpoint's dropout RNG streams were saved on %s and this run is on %s: they "
            "start from the run's seeds; everything else is exact",
            saved.upper(),
            compat.rng_runtime().upper(),
        )
        return
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
