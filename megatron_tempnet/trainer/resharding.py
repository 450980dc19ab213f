"""The training state between a DeepSpeed engine and a checkpoint's layout-free copy.

``save_portable_state`` writes ``portable/`` (``trainer.portable``) from any engine: ZeRO 0
(the parameters and PyTorch's AdamW state), ZeRO 1-2 and the bf16 optimizer (the float32 master
fragments, gathered with DeepSpeed's ``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state``), ZeRO-3 (the same accessors; frozen parameters gathered with
``GatheredParameters``), a pipeline stage (its parameters under their one-process names,
``Pipeline.layout_free_parameters``). ``restore`` does the reverse into an engine of any layout:
every parameter's full tensor is cut to this rank's shard and written to the module's weight,
the float32 master and AdamW's moments (``safe_set_full_*``; ZeRO 0: the tensors themselves),
and AdamW's step count is set, so the next step is the one the saving run would have taken.

``restore`` reads from a *source*: ``PortableState`` or, for a weights-only load of a checkpoint
without ``portable/`` (a ``WEIGHTS_ONLY`` conversion at another layout), the task's reader of
the module files (``names``, ``full``; no kinds, no moments).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tempnet import compat
from megatron_tempnet.distributed.sharding import (
    TensorLayout,
    full_shape,
    parameter_kind,
    shard_tensor,
)
from megatron_tempnet.trainer.checkpoint_format import CheckpointError
from megatron_tempnet.trainer.file_io import FileWriter
from megatron_tempnet.trainer.portable import MOMENTS, Layout, write_index, write_stage
from megatron_tempnet.trainer.step import compute_device
from megatron_tempnet.utils.logging import log_rank0


def current_layout(engine) -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        engine.zero_optimization_stage(),
    )


def layout_free_parameters(module) -> list[tuple[str, torch.nn.Parameter]]:
    """The module's parameters under the names they have in the one-process model."""
    if hasattr(module, "layout_free_parameters"):  # a pipeline stage
        return module.layout_free_parameters()
    return list(module.named_parameters())


def _shape(param) -> tuple[int, ...]:
    return tuple(compat.zero3_shape(param) or param.shape)


def _has_master(param) -> bool:
    """DeepSpeed keeps this parameter's float32 master and AdamW state in its own partitions."""
    return compat.zero3_shape(param) is not None or compat.has_fragment_mapping(param)


def _optimizer_step(engine) -> int:
    states = compat.base_optimizer(engine.optimizer).state.values()
    return int(max((float(s["step"]) for s in states if "step" in s), default=0))


def _gathered_weight(param) -> torch.Tensor:
    """The parameter's (full TP-shard) weight; a ZeRO-3 one is gathered (collective)."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().cpu().clone()
    return param.detach().cpu().clone()


def _trained_state(engine, param) -> dict[str, torch.Tensor]:
    """The float32 master and AdamW's moments of a trained parameter (collective over DP)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if _has_master(param):
        state = {"param": safe_get_full_fp32_param(param)}
        for key in MOMENTS:
            state[key] = safe_get_full_optimizer_state(param, key)
    else:  # ZeRO 0 in float32: the parameter is the master, its state PyTorch's
        saved = compat.base_optimizer(engine.optimizer).state.get(param, {})
        state = {"param": param.detach()}
        for key in MOMENTS:
            state[key] = saved[key] if key in saved else torch.zeros_like(param)
    return {k: v.detach().float().view(_shape(param)).cpu().clone() for k, v in state.items()}


def save_portable_state(
    engine,
    directory: str,
    *,
    writer: FileWriter,
    tensor_layout: TensorLayout,
    exclude_frozen: bool,
    **index,
) -> None:
    """Write this (TP rank, stage)'s ``portable/`` file; rank 0 writes the index (collective).

    ``writer``: the save's (``trainer.file_io``); ``index``: what the index carries besides the
    layout (iteration, data position, config).
    """
    from megatron.core import parallel_state as ps

    tensors = {}
    compat.link_optimizer_states(engine.optimizer)
    for name, param in layout_free_parameters(engine.module):
        if not param.requires_grad and exclude_frozen:
            continue
        kind = parameter_kind(name, param, swiglu=tensor_layout.swiglu)
        if param.requires_grad:
            tensors[name] = {"kind": kind, **_trained_state(engine, param)}
        else:
            tensors[name] = {"kind": kind, "param": _gathered_weight(param)}
    if ps.get_data_parallel_rank() == 0:
        write_stage(
            directory,
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            tensors,
            writer,
        )
    # on the compute device: NCCL reduces device tensors only
    step = torch.full((1,), _optimizer_step(engine), dtype=torch.float64, device=compute_device())
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a stage without trained parameters has 0
    dist.barrier()
    if dist.get_rank() == 0:
        write_index(
            directory,
            current_layout(engine),
            writer,
            vocab_size=tensor_layout.vocab_size,
            step=int(step.item()),
            **index,
        )


def _prepare_optimizer_states(engine, step: int) -> None:
    """AdamW's state for every tensor it steps, at ``step``: created (zero moments) where the
    engine has none yet (before its first step), then mapped by DeepSpeed's wrappers."""
    base = compat.base_optimizer(engine.optimizer)
    on_device = base.defaults.get("fused") or base.defaults.get("capturable")
    for tensor in compat.optimizer_tensors(engine.optimizer):
        state = base.state[tensor]
        for key in MOMENTS:
            if key not in state:
                state[key] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
        # PyTorch's AdamW keeps the step as a float32 tensor (on the device when fused)
        device = tensor.device if on_device else None
        state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
    compat.link_optimizer_states(engine.optimizer)


def _assign(engine, param, value: torch.Tensor, moments: dict[str, torch.Tensor]) -> None:
    """Write a parameter's shard: its weight, and its master and moments if it trains."""
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    device = param.device
    if hasattr(param, "ds_id"):  # ZeRO-3: gather, write on the group's first rank, re-partition
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(value.view(param.shape).to(param.dtype))
    else:
        param.data.copy_(value.to(device, param.dtype))
    if not param.requires_grad:
        return
    if hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition of master and moments
        safe_set_local_fp32_param(param, compat.zero3_local(param, value.to(device, torch.float32)))
        for key, moment in moments.items():
            local = compat.zero3_local(param, moment.to(device, torch.float32))
            safe_set_local_optimizer_state(param, local, key)
    elif _has_master(param):  # ZeRO 1-2, bf16: the fragments this rank holds
        safe_set_full_fp32_param(param, value.to(device, torch.float32))
        for key, moment in moments.items():
            safe_set_full_optimizer_state(param, moment.to(device, torch.float32), key)
    else:
        state = compat.base_optimizer(engine.optimizer).state[param]
        for key, moment in moments.items():
            state[key].copy_(moment.to(device, state[key].dtype))


def restore(
    engine,
    source,
    *,
    label: str,
    tensor_layout: TensorLayout,
    step: int | None,
    optional: dict[str, str],
    skip_frozen: bool,
) -> None:
    """Every parameter of the engine from ``source``'s full tensors, cut for this rank.

    ``step``: AdamW's step count to restore with the moments (None: weights only; the optimizer
    keeps its fresh state). ``optional``: prefixes the source may lack (weights only). Frozen
    parameters are left as they are with ``skip_frozen`` (read from --pretrained-checkpoint).
    ``label`` names the source in errors.
    """
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    params = check_shapes(
        engine,
        source,
        label=label,
        tensor_layout=tensor_layout,
        whole=step is not None,
        optional=optional,
        skip_frozen=skip_frozen,
    )
    if step is not None:
        _prepare_optimizer_states(engine, step)
    fresh_moments = []
    padded_vocab = tensor_layout.padded_vocab_size
    for name, param, kind in params:
        shape = _shape(param)

        def mine(tensor: torch.Tensor, kind: str = kind, shape: tuple = shape) -> torch.Tensor:
            return shard_tensor(kind, tensor, rank, tp, padded_vocab=padded_vocab).view(shape)

        moments = {}
        if step is not None and param.requires_grad:
            if all(source.has(name, key) for key in MOMENTS):
                moments = {key: mine(source.full(name, key)) for key in MOMENTS}
            else:  # it was frozen when saved
                fresh_moments.append(name)
        _assign(engine, param, mine(source.full(name)), moments)
    if fresh_moments:
        log_rank0(
            "%d tensor(s) did not train in the checkpoint (e.g. %s): their AdamW moments start "
            "at zero",
            len(fresh_moments),
            fresh_moments[0],
        )


def check_shapes(
    engine,
    source,
    *,
    label: str,
    tensor_layout: TensorLayout,
    whole: bool,
    optional: dict[str, str],
    skip_frozen: bool,
) -> list[tuple[str, torch.nn.Parameter, str]]:
    """The checkpoint fits this model: every parameter is there (but ``optional`` ones when not
    ``whole``), with the same full shape, and (``whole``) the checkpoint has nothing else.
    Returns this rank's (name, parameter, kind) to read; errors name the first misfit."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    named = layout_free_parameters(engine.module)
    if whole:
        every = [None] * dist.get_world_size()  # every stage's names: the whole model's
        dist.all_gather_object(every, [name for name, _ in named])
        names = {name for stage in every for name in stage}
        extra = [n for n in source.names() if n not in names]
        if extra:
            raise CheckpointError(
                f"{label}: the checkpoint's tensor {extra[0]} has no place in this model "
                f"({len(extra)} such): a checkpoint of another architecture or loss?"
            )
    params, fresh = [], set()
    for name, param in named:
        if skip_frozen and not param.requires_grad:
            continue
        kind = parameter_kind(name, param, swiglu=tensor_layout.swiglu)
        if name not in source:
            what = next((w for p, w in optional.items() if name.startswith(p)), None)
            if not whole and what is not None:
                fresh.add(what)  # e.g. TempNet on an LM-only checkpoint: keeps its initialisation
                continue
            raise CheckpointError(
                f"{label}: the checkpoint has no tensor {name}, which this model has: a "
                "checkpoint of another architecture or loss?"
            )
        saved = tuple(source.full_shape(name))
        expected = full_shape(kind, _shape(param), tp, vocab_size=tensor_layout.vocab_size)
        if saved != expected:
            raise CheckpointError(
                f"{label}: tensor {name} is {saved} in the checkpoint and {expected} in this "
                "model (full, unsharded shapes): a checkpoint of another model shape, "
                "vocabulary or TempNet size?"
            )
        params.append((name, param, kind))
    for what in sorted(fresh):
        log_rank0("%s starts from its initialisation: %s has no %s", what, label, what)
    return params
