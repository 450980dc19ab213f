"""Everything the project takes from megatron-core and DeepSpeed beyond their public API.

Every private symbol of either library that the project reads, replaces or overrides is named in
this package and nowhere else (``tests/unit/test_architecture.py`` checks the rest of the
library), and ``check_upstream`` verifies each one before anything is built. Neither library is
ever edited. Four jobs, one module each:

* ``checks``: the start-up checks of every private symbol below, and the pinned versions;
* ``cpu_runtime``: megatron-core on a machine without a GPU (CUDA buffers, the CUDA RNG tracker
  and the default causal mask redirected to the CPU), and RNG tracker states that move between
  that runtime and CUDA;
* ``engines``: DeepSpeed's engine that keeps float32 islands and writes its files through the
  trainer, its optimizer wrappers' internals;
* ``pipeline``: DeepSpeed's pipeline module and engine internals (pieces, tied copies, layer
  files, a last-stage-only backward);

and ``rotary``: megatron-core's ``RotaryEmbedding`` with the caller's frequencies;
``build_locks``: the lock files a killed build of a DeepSpeed op leaves behind.

The names the rest of the library uses are exported here: ``compat.engine_class``.
"""

from megatron_tempnet.compat.build_locks import remove_stale_build_locks
from megatron_tempnet.compat.checks import (
    SUPPORTED_DEEPSPEED,
    SUPPORTED_MEGATRON_CORE,
    UpstreamError,
    check_deepspeed,
    check_deepspeed_optimizers,
    check_megatron_core,
    check_upstream,
)
from megatron_tempnet.compat.cpu_runtime import (
    apply_cpu_support,
    rng_runtime,
    tracker_states_restorable,
)
from megatron_tempnet.compat.engines import (
    base_optimizer,
    checkpoint_safe_globals,
    engine_class,
    fragment_master,
    fragment_range,
    fragment_state,
    has_fragment_mapping,
    link_optimizer_states,
    loss_scale,
    optimizer_tensors,
    set_loss_scale,
    zero3_local,
    zero3_partition,
    zero3_range,
    zero3_shape,
)
from megatron_tempnet.compat.pipeline import (
    is_pipe_replicated,
    last_stage_backward_engine,
    pipeline_first_index,
    pipeline_pieces,
    pipeline_tied_modules,
)
from megatron_tempnet.compat.rotary import rotary_embedding_class

__all__ = [
    "SUPPORTED_DEEPSPEED",
    "SUPPORTED_MEGATRON_CORE",
    "UpstreamError",
    "apply_cpu_support",
    "base_optimizer",
    "check_deepspeed",
    "check_deepspeed_optimizers",
    "check_megatron_core",
    "check_upstream",
    "checkpoint_safe_globals",
    "engine_class",
    "has_fragment_mapping",
    "is_pipe_replicated",
    "last_stage_backward_engine",
    "link_optimizer_states",
    "optimizer_tensors",
    "pipeline_first_index",
    "pipeline_pieces",
    "pipeline_tied_modules",
    "remove_stale_build_locks",
    "rng_runtime",
    "rotary_embedding_class",
    "tracker_states_restorable",
    "zero3_local",
    "loss_scale",
    "set_loss_scale",
    "zero3_range",
    "zero3_partition",
    "fragment_state",
    "fragment_range",
    "fragment_master",
    "zero3_shape",
]
