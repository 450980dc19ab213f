"""DeepSpeed's engine, checkpoint engine and optimizer wrappers, as the trainer uses them.

**Float32 islands under --bf16 / --fp16.** DeepSpeed's engine casts every parameter of the model
to the training dtype in ``_cast_module_mixed_precision``. ``engine_class`` gives the engine
(plain, pipeline, or last-stage-backward pipeline) whose cast leaves the parameters marked by
``utils.precision.keep_float32`` (TempNet, CLIP's temperature) in float32; DeepSpeed's bf16/fp16
optimizers and ZeRO 1-2 step them in float32 from then on. ZeRO-3 keeps one dtype for all
parameters, so there the mark is not honoured (TempNet still computes in float32).

**Checkpoint files** go through ``checkpoint_engine_class`` (the trainer's writer and its
weights-only loader); ``checkpoint_safe_globals`` names the value classes DeepSpeed's files hold.

**Optimizer wrappers**: the PyTorch optimizer inside ZeRO 1-3 and the bf16 optimizer, the tensors
AdamW keeps state for, and ZeRO-3's partitions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_tempnet.compat.pipeline import last_stage_backward_engine
from megatron_tempnet.utils.precision import is_float32_island


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


def has_fragment_mapping(parameter) -> bool:
    """ZeRO 1-2 or the bf16 optimizer maps this parameter to a fragment of its float32
    partitions (``_hp_mapping``: its master and AdamW states live there)."""
    return hasattr(parameter, "_hp_mapping")


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
