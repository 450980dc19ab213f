"""DeepSpeed's engine and optimizer wrappers, as the trainer uses them.

**Float32 islands under --bf16 / --fp16.** DeepSpeed's engine casts every parameter of the model
to the training dtype in ``_cast_module_mixed_precision``. ``engine_class`` gives the engine
(plain, pipeline, or last-stage-backward pipeline) whose cast leaves the parameters marked by
``utils.precision.keep_float32`` (TempNet, CLIP's temperature) in float32; DeepSpeed's bf16/fp16
optimizers and ZeRO 1-2 step them in float32 from then on. ZeRO-3 keeps one dtype for all
parameters, so there the mark is not honoured (TempNet still computes in float32).

**Checkpoint files** of the earlier format (DeepSpeed's, read by ``tools/checkpoint/upgrade.py``)
hold a few DeepSpeed value classes: ``checkpoint_safe_globals`` names them.

**Optimizer wrappers**: the PyTorch optimizer inside ZeRO 1-3 and the bf16 optimizer, the tensors
AdamW keeps state for, and ZeRO-3's partitions.
"""

from __future__ import annotations

import functools

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
def engine_class(pipeline: bool = False, last_stage_backward: bool = False) -> type:
    """DeepSpeed's engine (``PipelineEngine`` for a pipeline, ``last_stage_backward_engine`` for
    a forward-only one) that keeps the float32 islands' parameters float32 under bf16/fp16."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if last_stage_backward:
        base = last_stage_backward_engine()
    else:
        base = PipelineEngine if pipeline else DeepSpeedEngine

    class Float32IslandEngine(base):
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


def fragment_range(parameter) -> tuple[int, int]:
    """``(start, numel)`` of this rank's fragment of a ZeRO 1-2 / bf16-optimizer parameter,
    within the flattened parameter; ``numel`` 0 where its partition holds none of it."""
    mapping = getattr(parameter, "_hp_mapping", None)
    if mapping is None:
        return 0, 0
    address = mapping.lp_fragment_address
    return int(address.start), int(address.numel)


def fragment_master(parameter) -> torch.Tensor:
    """The float32 master of this rank's fragment (1-D, a view into the optimizer's partition)."""
    return parameter._hp_mapping.hp_fragment


def fragment_state(parameter, key: str) -> torch.Tensor:
    """AdamW's ``key`` (``exp_avg``, ``exp_avg_sq``) of this rank's fragment (1-D view)."""
    return parameter._hp_mapping.get_optim_state_fragment(key)


def zero3_range(parameter) -> tuple[int, int]:
    """``(start, numel)`` of this rank's ZeRO-3 partition within the flattened parameter (its
    padding past the end left out)."""
    import torch.distributed as dist

    size = parameter.ds_tensor.numel()
    start = size * dist.get_rank(group=parameter.ds_process_group)
    return start, max(0, min(size, parameter.ds_numel - start))


def zero3_partition(parameter) -> torch.Tensor:
    """This rank's ZeRO-3 partition of the parameter's weight (1-D view, padding included)."""
    return parameter.ds_tensor.view(-1)


_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scale(engine) -> dict | None:
    """fp16's dynamic loss scaler state (its scale, counters and hysteresis); None without one."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    return {f: float(getattr(scaler, f)) for f in _SCALER_FIELDS if hasattr(scaler, f)}


def set_loss_scale(engine, state: dict | None) -> None:
    """Restore ``loss_scale``'s state (a run without a scaler ignores it)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or not state:
        return
    for f, value in state.items():
        current = getattr(scaler, f, None)
        setattr(scaler, f, type(current)(value) if isinstance(current, (int, float)) else value)
