"""Everything the project takes from megatron-core and DeepSpeed beyond their public API.

Every private symbol of either library that the project reads, replaces or overrides is named in
this module and nowhere else, and ``check_upstream`` verifies each one (that it exists, with the
parameters we call it with) before anything is built, so that an upgrade that changes one fails
here with a message, not deep inside a model. Neither library is ever edited.

**The CPU runtime** (``apply_cpu_support``). megatron-core assumes CUDA in three places that
matter for CPU runs:

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

**DeepSpeed's pipeline engine.** A ``PipelineModule`` keeps its built pieces in ``forward_funcs``,
the global index of its first piece in ``_local_start`` and its process grid in ``_grid``, and
reads its layer files in ``load_state_dir``; the ``PipelineEngine`` maps schedule instructions to
methods in ``_INSTRUCTION_MAP`` and runs backward in ``_exec_backward_pass``. The accessors,
``pipeline_module_base`` and ``last_stage_backward_engine`` below are the only code that touches
them (and the module's ``tied_modules``, ``ckpt_layer_path_list`` and the ``ds_pipe_replicated``
mark it puts on tied copies).

**RoPE frequencies** (``rotary_embedding_class``). megatron-core's ``RotaryEmbedding`` applies
LLaMA-3.1's frequency scaling with ``rope_scaling=True``, but its constructor passes only the
factor to the scaling helper, which then uses low_freq_factor 1, high_freq_factor 4 and
original_max_position_embeddings 8192 whatever the model's values. The subclass here takes the
inverse frequencies from the caller instead (``models.transformer.Llama3RopeScaling`` computes
them for any values) and sets ``inv_freq``, the instance attribute from which every angle is
computed.

**Float32 islands under --bf16 / --fp16.** DeepSpeed's engine casts every parameter of the model
to the training dtype in ``_cast_module_mixed_precision``. ``engine_class`` gives the engine
(plain, pipeline, or last-stage-backward pipeline) whose cast leaves the parameters marked by
``utils.precision.keep_float32`` (TempNet, CLIP's temperature) in float32; DeepSpeed's bf16/fp16
optimizers and ZeRO 1-2 step them in float32 from then on. ZeRO-3 keeps one dtype for all
parameters, so there the mark is not honoured (TempNet still computes in float32).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

import torch

from megatron_tempnet.utils.logging import get_logger
from megatron_tempnet.utils.precision import is_float32_island

SUPPORTED_MEGATRON_CORE = "0.16."
SUPPORTED_DEEPSPEED = "0.19."

_applied = False
logger = get_logger(__name__)


class UpstreamError(RuntimeError):
    """megatron-core or DeepSpeed no longer has what the project relies on."""


def _require(module, name: str, params: tuple[str, ...] = (), *, owner: str | None = None) -> None:
    """Fail with a clear message if ``module.name`` is gone or lost one of ``params``."""
    where = f"{owner or module.__name__}.{name}"
    if not hasattr(module, name):
        raise UpstreamError(
            f"{where} no longer exists in the installed version: megatron_tempnet/compat.py must "
            "be updated for it (or install the pinned versions: make install)"
        )
    if params:
        have = inspect.signature(getattr(module, name)).parameters
        missing = [p for p in params if p not in have]
        if missing:
            raise UpstreamError(
                f"{where} lost parameter(s) {missing} in the installed version: update "
                "megatron_tempnet/compat.py for it"
            )


def _require_assignment(cls: type, method: str, attribute: str) -> None:
    """``cls.method`` still sets ``self.attribute`` (an instance attribute we read)."""
    _require(cls, method, owner=f"{cls.__module__}.{cls.__name__}")
    if f"self.{attribute}" not in inspect.getsource(getattr(cls, method)):
        raise UpstreamError(
            f"{cls.__module__}.{cls.__name__}.{attribute} no longer exists in the installed "
            "version (not set by "
            f"{method}): megatron_tempnet/compat.py must be updated for it"
        )


def check_megatron_core() -> None:
    """Every megatron-core symbol the CPU runtime replaces, and the pinned version."""
    from megatron.core import package_info
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer import utils as transformer_utils

    _require(transformer_utils, "get_default_causal_mask", ("sq",))
    _require(fused_softmax, "get_default_causal_mask", ("sq",))
    for name, params in (
        ("CudaRNGStatesTracker", ()),
        ("_get_cuda_rng_state", ("device", "clone", "graph_safe")),
        ("_set_cuda_rng_state", ("new_state", "device", "graph_safe")),
        ("_CUDA_RNG_STATE_TRACKER", ()),
        ("_CUDA_RNG_STATE_TRACKER_INITIALIZED", ()),
        ("initialize_rng_tracker", ("force_reset",)),
        ("model_parallel_cuda_manual_seed", ("seed",)),
        ("_MODEL_PARALLEL_RNG_TRACKER_NAME", ()),
    ):
        _require(mc_random, name, params)
    tracker_cls = mc_random.CudaRNGStatesTracker
    for method in ("reset", "add", "fork", "get_states", "set_states", "is_initialized"):
        if not callable(getattr(tracker_cls, method, None)):
            raise UpstreamError(
                f"CudaRNGStatesTracker.{method} no longer exists in the installed version: "
                "megatron_tempnet/compat.py must be updated for it"
            )
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    _require(
        rotary_pos_embedding,
        "RotaryEmbedding",
        ("kv_channels", "rotary_percent", "rotary_interleaved", "rotary_base", "rope_scaling"),
    )
    rotary = rotary_pos_embedding.RotaryEmbedding
    _require_assignment(rotary, "__init__", "inv_freq")
    _require_assignment(rotary, "get_freqs_non_repeated", "inv_freq")
    if not package_info.__version__.startswith(SUPPORTED_MEGATRON_CORE):
        raise UpstreamError(
            f"megatron-core {package_info.__version__} is installed, the project is written for "
            f"{SUPPORTED_MEGATRON_CORE}x: install the pinned version (make install)"
        )


def check_deepspeed() -> None:
    """Every DeepSpeed pipeline symbol the accessors below read or override."""
    import deepspeed
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    owner = "deepspeed.PipelineEngine"
    _require(PipelineEngine, "_INSTRUCTION_MAP", owner=owner)
    _require(PipelineEngine, "_exec_backward_pass", ("buffer_id",), owner=owner)
    for instruction in ("BackwardPass", "SendGrad", "RecvGrad"):
        _require(schedule, instruction)
        if getattr(schedule, instruction) not in PipelineEngine._INSTRUCTION_MAP:
            raise UpstreamError(
                f"{owner}._INSTRUCTION_MAP no longer maps schedule.{instruction}: "
                "megatron_tempnet/compat.py must be updated for the installed version"
            )
    from deepspeed.runtime.engine import DeepSpeedEngine

    owner = "deepspeed.DeepSpeedEngine"
    params = ("param_dtype", "buffer_dtype", "is_zero_init_model")
    _require(DeepSpeedEngine, "_cast_module_mixed_precision", params, owner=owner)
    if "_cast_module_mixed_precision" not in inspect.getsource(
        DeepSpeedEngine._configure_distributed_model
    ):
        raise UpstreamError(
            f"{owner}._configure_distributed_model no longer casts the model through "
            "_cast_module_mixed_precision: megatron_tempnet/compat.py must be updated for the "
            "installed version"
        )
    owner = "deepspeed.PipelineModule"
    params = ("load_dir", "checkpoint_engine", "strict")
    _require(PipelineModule, "load_state_dir", params, owner=owner)
    _require(PipelineModule, "ckpt_layer_path_list", ("ckpt_dir", "local_layer_idx"), owner=owner)
    _require_assignment(PipelineModule, "__init__", "_grid")
    _require_assignment(PipelineModule, "__init__", "_local_start")
    _require_assignment(PipelineModule, "__init__", "forward_funcs")
    _require_assignment(PipelineModule, "__init__", "tied_modules")
    if "ds_pipe_replicated" not in inspect.getsource(PipelineModule):
        raise UpstreamError(
            "deepspeed.PipelineModule no longer marks tied copies ds_pipe_replicated: "
            "megatron_tempnet/compat.py must be updated for the installed version"
        )
    check_deepspeed_optimizers()
    check_deepspeed_checkpointing()
    if not deepspeed.__version__.startswith(SUPPORTED_DEEPSPEED):
        raise UpstreamError(
            f"DeepSpeed {deepspeed.__version__} is installed, the project is written for "
            f"{SUPPORTED_DEEPSPEED}x: install the pinned version (make install)"
        )


def check_deepspeed_optimizers() -> None:
    """What ``base_optimizer``, ``optimizer_tensors``, ``link_optimizer_states``,
    ``zero3_shape`` and ``zero3_local`` read."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        owner = f"{cls.__module__}.{cls.__name__}"
        _require(cls, "_lazy_init_hp_params_optimizer_state", owner=owner)
        if "self._hp_optimizer_states_linked = " not in inspect.getsource(cls):
            raise UpstreamError(
                f"{owner}._hp_optimizer_states_linked no longer exists in the installed version: "
                "megatron_tempnet/compat.py must be updated for it"
            )
    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer, DeepSpeedZeroOptimizer_Stage3):
        _require_assignment(cls, "__init__", "optimizer")
    if "self.fp32_partitioned_groups_flat = " not in inspect.getsource(
        DeepSpeedZeroOptimizer_Stage3
    ):
        raise UpstreamError(
            "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat no longer exists in the "
            "installed version: megatron_tempnet/compat.py must be updated for it"
        )
    from deepspeed.runtime.zero import partition_parameters

    source = inspect.getsource(partition_parameters)
    if any(a not in source for a in ("ds_shape", "ds_process_group", "ds_tensor")):
        raise UpstreamError(
            "deepspeed.runtime.zero.partition_parameters no longer sets ds_shape, "
            "ds_process_group or ds_tensor: "
            "megatron_tempnet/compat.py must be updated for the installed version"
        )


def check_deepspeed_checkpointing() -> None:
    """What ``checkpoint_engine_class`` overrides and ``checkpoint_safe_globals`` names."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    owner = "deepspeed TorchCheckpointEngine"
    _require(TorchCheckpointEngine, "save", ("state_dict", "path"), owner=owner)
    _require(TorchCheckpointEngine, "load", ("path", "map_location"), owner=owner)
    _require_assignment(TorchCheckpointEngine, "__init__", "zipfile_serialization")
    _require_assignment(DeepSpeedEngine, "_configure_checkpointing", "checkpoint_engine")
    checkpoint_safe_globals()


def check_upstream() -> None:
    """Verify every private symbol of megatron-core and DeepSpeed the project uses."""
    check_megatron_core()
    check_deepspeed()


# ----------------------------------------------------------------------------- the CPU runtime


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _get_cpu_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal (the positions a query must not see)."""
    return torch.ones(sq, sq, dtype=torch.bool).triu(1)


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


# ---------------------------------------------------------------------- RoPE's frequencies


@functools.cache
def rotary_embedding_class() -> type:
    """megatron-core's ``RotaryEmbedding`` with the caller's inverse frequencies.

    ``cls(frequencies, **kwargs)``: ``kwargs`` are ``RotaryEmbedding``'s (without
    ``rope_scaling``); ``frequencies`` maps its unscaled inverse frequencies (``[d/2]`` float32,
    ``base^(-2i/d)``) to the ones every angle is computed from (``position x inv_freq``).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class ScaledRotaryEmbedding(RotaryEmbedding):
        """``RotaryEmbedding`` whose ``inv_freq`` is ``frequencies(base^(-2i/d))``."""

        def __init__(self, frequencies, **kwargs):
            super().__init__(rope_scaling=False, **kwargs)
            self.inv_freq = frequencies(self.inv_freq)

    return ScaledRotaryEmbedding


# --------------------------------------------------------------- DeepSpeed's pipeline internals


def pipeline_pieces(module) -> list:
    """The pieces this pipeline stage built, in order (layers, or functions for tied layers)."""
    return module.forward_funcs


def pipeline_first_index(module) -> int:
    """The global index (in the model's list of layer specs) of this stage's first piece."""
    return module._local_start


def pipeline_tied_modules(module) -> list:
    """The modules this stage shares with another stage (a tied embedding)."""
    return list(module.tied_modules.values())


def pipeline_layer_files(module, checkpoint: str, local_index: int) -> list[str]:
    """The layer files of this stage's piece ``local_index`` in a checkpoint directory."""
    return module.ckpt_layer_path_list(checkpoint, local_index)


def is_pipe_replicated(parameter) -> bool:
    """The second pipeline stage's copy of a tied parameter (counted once in a norm)."""
    return getattr(parameter, "ds_pipe_replicated", False)


def is_stage_writer(module) -> bool:
    """This rank is the first of its stage's data- and tensor-parallel replicas."""
    grid = module._grid
    return grid.data_parallel_id == 0 and grid.get_slice_parallel_rank() == 0


@functools.cache
def pipeline_module_base() -> type:
    """DeepSpeed's ``PipelineModule`` whose load can leave the stage's last piece out.

    Subclasses answer ``skip_last_piece_on_load(load_dir)``; when it is True, the stage loads
    every piece but the last (which keeps what it holds) from ``load_dir``; the other pieces keep
    their indices, so their files match.
    """
    from deepspeed.runtime.pipe.module import PipelineModule

    class PipelineModuleWithOptionalLastPiece(PipelineModule):
        def skip_last_piece_on_load(self, load_dir: str) -> bool:
            return False

        def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
            if not self.skip_last_piece_on_load(load_dir):
                return super().load_state_dir(load_dir, checkpoint_engine, strict)
            pieces = self.forward_funcs
            self.forward_funcs = pieces[:-1]
            try:
                return super().load_state_dir(load_dir, checkpoint_engine, strict)
            finally:
                self.forward_funcs = pieces

    return PipelineModuleWithOptionalLastPiece


@functools.cache
def last_stage_backward_engine() -> type:
    """DeepSpeed's ``PipelineEngine`` running backward on the last stage only.

    For a pipeline whose earlier stages are frozen and whose last stage detaches its input:
    every stage runs forward, only the last one runs backward, and no gradient is sent or
    received between stages.
    """
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class LastStageBackwardEngine(PipelineEngine):
        def _exec_last_stage_backward(self, buffer_id):
            if self.is_last_stage():
                super()._exec_backward_pass(buffer_id)

        def _exec_nothing(self, buffer_id):
            pass

        _INSTRUCTION_MAP = {
            **PipelineEngine._INSTRUCTION_MAP,
            schedule.BackwardPass: _exec_last_stage_backward,
            schedule.SendGrad: _exec_nothing,
            schedule.RecvGrad: _exec_nothing,
        }

    return LastStageBackwardEngine


@functools.cache
def checkpoint_safe_globals() -> list:
    """The classes besides tensors and containers that DeepSpeed's checkpoint files hold: its
    loss scalers, ZeRO stage enum and ZeRO's fragment addresses (plain values: rebuilding them
    runs no code of the file)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@functools.cache
def checkpoint_engine_class(writer: type, load: Callable) -> type:
    """DeepSpeed's torch checkpoint engine writing through ``writer(records=True, zipfile=...)``
    (the trainer's ``FileWriter``: flushed to disk, failures recorded) and loading through
    ``load(path, map_location)`` (the trainer's ``load_file``: weights only)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class GuardedCheckpointEngine(TorchCheckpointEngine):
        def __init__(self, config_params=None):
            super().__init__(config_params)
            self.writer = writer(records=True, zipfile=self.zipfile_serialization)

        def save(self, state_dict, path: str):
            self.writer.save(state_dict, path)

        def load(self, path: str, map_location=None):
            return load(path, map_location)

    return GuardedCheckpointEngine


@functools.cache
def engine_class(
    pipeline: bool = False, last_stage_backward: bool = False, checkpoint_engine: type | None = None
) -> type:
    """DeepSpeed's engine (``PipelineEngine`` for a pipeline, ``last_stage_backward_engine`` for
    a forward-only one) that keeps the float32 islands' parameters float32 under bf16/fp16 and
    reads and writes its files through ``checkpoint_engine`` (``checkpoint_engine_class``'s)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if last_stage_backward:
        base = last_stage_backward_engine()
    else:
        base = PipelineEngine if pipeline else DeepSpeedEngine

    class Float32IslandEngine(base):
        def _configure_checkpointing(self, *args, **kwargs):
            super()._configure_checkpointing(*args, **kwargs)
            if checkpoint_engine is not None:
                self.checkpoint_engine = checkpoint_engine(self._config)

        def _cast_module_mixed_precision(self, *args, **kwargs):
            kept = {}
            if self.zero_optimization_stage() < 3:  # ZeRO-3 flattens one dtype
                kept = {id(p): p.data for p in self.module.parameters() if is_float32_island(p)}
            super()._cast_module_mixed_precision(*args, **kwargs)
            for p in self.module.parameters():
                if id(p) in kept:
                    p.data = kept[id(p)]

    Float32IslandEngine.__name__ = f"Float32Island{base.__name__}"
    return Float32IslandEngine


# ------------------------------------------------------------------ DeepSpeed's optimizer wrappers


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The PyTorch optimizer that DeepSpeed's wrapper (ZeRO 1-3, bf16) steps on its float32
    partitions; ``optimizer`` itself when it is not wrapped (ZeRO 0 in float32)."""
    return getattr(optimizer, "optimizer", optimizer)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors AdamW keeps state for: ZeRO-3 puts its float32 partitions
    (``fp32_partitioned_groups_flat``) in AdamW's groups only while it steps them; the other
    wrappers (and an unwrapped optimizer) keep them there."""
    partitions = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if partitions is not None:
        return list(partitions)
    return [t for group in base_optimizer(optimizer).param_groups for t in group["params"]]


def link_optimizer_states(optimizer) -> None:
    """Let ZeRO 1-2 and the bf16 optimizer map each parameter's fragment of AdamW's states.

    They do it once, after the first group's first step, when the other groups have no state
    yet (PyTorch creates it lazily): the parameters of every group but the first are left
    unmapped. Mapping again once every group has its state (after a step, or states created
    by hand before the first one) fixes that."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        optimizer._hp_optimizer_states_linked = False
        link()


def zero3_shape(parameter) -> torch.Size | None:
    """A ZeRO-3 partitioned parameter's full shape (None for any other parameter)."""
    return getattr(parameter, "ds_shape", None) if hasattr(parameter, "ds_id") else None


def zero3_local(parameter, value: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO-3 partition of ``value`` (the parameter's full shape): the flattened
    value zero-padded to a multiple of the partition count, cut like ``ds_tensor``. (DeepSpeed's
    ``safe_set_full_fp32_param`` cannot set a parameter whose size is not such a multiple.)"""
    import torch.distributed as dist

    group = parameter.ds_process_group
    size = parameter.ds_tensor.numel()
    flat = value.flatten()
    padded = flat.new_zeros(size * dist.get_world_size(group=group))
    padded[: flat.numel()] = flat
    return padded.narrow(0, size * dist.get_rank(group=group), size).clone()
