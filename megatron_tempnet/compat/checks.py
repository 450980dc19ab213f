"""Start-up checks: every private megatron-core and DeepSpeed symbol the project reads, replaces or
overrides (in this package and nowhere else) still exists, with the parameters we call it with.

``check_upstream`` runs them all before anything is built, so that an upgrade that changes one
fails here with a message naming the symbol, not deep inside a model. Neither library is ever
edited.
"""

from __future__ import annotations

import inspect

from megatron_tempnet.compat.engines import checkpoint_safe_globals

SUPPORTED_MEGATRON_CORE = "0.16."
SUPPORTED_DEEPSPEED = "0.19."


class UpstreamError(RuntimeError):
    """megatron-core or DeepSpeed no longer has what the project relies on."""


def _require(module, name: str, params: tuple[str, ...] = (), *, owner: str | None = None) -> None:
    """Fail with a clear message if ``module.name`` is gone or lost one of ``params``."""
    where = f"{owner or module.__name__}.{name}"
    if not hasattr(module, name):
        raise UpstreamError(
            f"{where} no longer exists in the installed version: megatron_tempnet/compat/ must "
            "be updated for it (or install the pinned versions: make install)"
        )
    if params:
        have = inspect.signature(getattr(module, name)).parameters
        missing = [p for p in params if p not in have]
        if missing:
            raise UpstreamError(
                f"{where} lost parameter(s) {missing} in the installed version: update "
                "megatron_tempnet/compat/ for it"
            )


def _require_assignment(cls: type, method: str, attribute: str) -> None:
    """``cls.method`` still sets ``self.attribute`` (an instance attribute we read)."""
    _require(cls, method, owner=f"{cls.__module__}.{cls.__name__}")
    if f"self.{attribute}" not in inspect.getsource(getattr(cls, method)):
        raise UpstreamError(
            f"{cls.__module__}.{cls.__name__}.{attribute} no longer exists in the installed "
            "version (not set by "
            f"{method}): megatron_tempnet/compat/ must be updated for it"
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
                "megatron_tempnet/compat/ must be updated for it"
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
    _require_assignment(PipelineEngine, "__init__", "using_bf16_optimizer")
    for instruction in ("BackwardPass", "SendGrad", "RecvGrad", "ReduceTiedGrads"):
        _require(schedule, instruction)
        if getattr(schedule, instruction) not in PipelineEngine._INSTRUCTION_MAP:
            raise UpstreamError(
                f"{owner}._INSTRUCTION_MAP no longer maps schedule.{instruction}: "
                "megatron_tempnet/compat/ must be updated for the installed version"
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
            "_cast_module_mixed_precision: megatron_tempnet/compat/ must be updated for the "
            "installed version"
        )
    _require_assignment(PipelineModule, "__init__", "_local_start")
    _require_assignment(PipelineModule, "__init__", "forward_funcs")
    _require_assignment(PipelineModule, "__init__", "tied_modules")
    if "ds_pipe_replicated" not in inspect.getsource(PipelineModule):
        raise UpstreamError(
            "deepspeed.PipelineModule no longer marks tied copies ds_pipe_replicated: "
            "megatron_tempnet/compat/ must be updated for the installed version"
        )
    check_deepspeed_optimizers()
    checkpoint_safe_globals()
    if not deepspeed.__version__.startswith(SUPPORTED_DEEPSPEED):
        raise UpstreamError(
            f"DeepSpeed {deepspeed.__version__} is installed, the project is written for "
            f"{SUPPORTED_DEEPSPEED}x: install the pinned version (make install)"
        )


def check_deepspeed_optimizers() -> None:
    """What ``base_optimizer``, ``optimizer_tensors``, ``link_optimizer_states``,
    ``has_fragment_mapping``, ``zero3_shape`` and ``zero3_local`` read."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        owner = f"{cls.__module__}.{cls.__name__}"
        _require(cls, "_lazy_init_hp_params_optimizer_state", owner=owner)
        if "self._hp_optimizer_states_linked = " not in inspect.getsource(cls):
            raise UpstreamError(
                f"{owner}._hp_optimizer_states_linked no longer exists in the installed version: "
                "megatron_tempnet/compat/ must be updated for it"
            )
    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer, DeepSpeedZeroOptimizer_Stage3):
        _require_assignment(cls, "__init__", "optimizer")
    if "self.fp32_partitioned_groups_flat = " not in inspect.getsource(
        DeepSpeedZeroOptimizer_Stage3
    ):
        raise UpstreamError(
            "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat no longer exists in the "
            "installed version: megatron_tempnet/compat/ must be updated for it"
        )
    from deepspeed.utils import mixed_precision_linkage
    from deepspeed.utils.tensor_fragment import tensor_fragment

    fields = set(getattr(tensor_fragment, "__dataclass_fields__", {}))
    if not {"lp_fragment_address", "hp_fragment"} <= fields:
        raise UpstreamError(
            "deepspeed.utils.tensor_fragment no longer has lp_fragment_address and hp_fragment: "
            "megatron_tempnet/compat/engines.py must be updated for the installed version"
        )
    _require(tensor_fragment, "get_optim_state_fragment", ("key",))
    if "lp_param._hp_mapping = " not in inspect.getsource(mixed_precision_linkage):
        raise UpstreamError(
            "deepspeed.utils.mixed_precision_linkage no longer sets a parameter's _hp_mapping: "
            "megatron_tempnet/compat/engines.py must be updated for the installed version"
        )
    from deepspeed.runtime.zero import partition_parameters

    source = inspect.getsource(partition_parameters)
    if any(a not in source for a in ("ds_shape", "ds_process_group", "ds_tensor", "ds_numel")):
        raise UpstreamError(
            "deepspeed.runtime.zero.partition_parameters no longer sets ds_shape, "
            "ds_process_group or ds_tensor: "
            "megatron_tempnet/compat/ must be updated for the installed version"
        )


def check_upstream() -> None:
    """Verify every private symbol of megatron-core and DeepSpeed the project uses."""
    check_megatron_core()
    check_deepspeed()
