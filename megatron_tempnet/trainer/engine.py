"""Process groups, the optimizer, the DeepSpeed engine and the learning-rate schedule of a run.

The task's module is one ``nn.Module`` (or a pipeline stage) that DeepSpeed wraps, so ZeRO shards
and checkpoints all of it. The optimizer is AdamW over the task's parameter groups, each with its
own peak learning rate, floor and weight decay; every group follows the run's schedule
(``trainer.schedule``), scaled to its own peak. The engine knows nothing of what the model is.
"""

from __future__ import annotations

import json
import math
import os
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet import compat
from megatron_tempnet.distributed.groups import init_host_group
from megatron_tempnet.distributed.launch import (
    GlooInterfaceError,
    bind_device,
    gloo_interface_problem,
    init_default_group,
)
from megatron_tempnet.distributed.mpu import MegatronMPU
from megatron_tempnet.trainer import communication
from megatron_tempnet.trainer.config import ConfigError, OptimizerConfig, RunConfig
from megatron_tempnet.trainer.step import deepspeed_clips_grad_norm
from megatron_tempnet.trainer.task import ParamGroup, TrainModel
from megatron_tempnet.utils.logging import log_rank0
from megatron_tempnet.utils.precision import is_float32_island


def init_process_groups(config: RunConfig) -> None:
    """torch.distributed (gloo on CPU, NCCL on this process's GPU) and megatron-core's TP/PP/DP
    groups, all with --distributed-timeout-minutes (a process group that exists already keeps
    its own), and the host group with --checkpoint-timeout-minutes (``groups.init_host_group``).
    """
    import deepspeed

    compat.check_upstream()
    compat.apply_cpu_support()
    problem = gloo_interface_problem(os.environ)
    if problem is not None:
        raise GlooInterfaceError(problem)
    p = config.parallel
    timeout = timedelta(minutes=p.distributed_timeout_minutes)
    if dist.is_initialized():
        bind_device()
    else:
        init_default_group(timeout)  # DeepSpeed adopts it: its own would take cuda:LOCAL_RANK
    if not torch.cuda.is_available():  # DeepSpeed's init builds its CPU op: no stale lock
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            compat.remove_stale_build_locks()
        dist.barrier()
    deepspeed.init_distributed(dist_backend=dist.get_backend(), timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        distributed_timeout_minutes=p.distributed_timeout_minutes,
    )
    init_host_group(timedelta(minutes=config.checkpoint.checkpoint_timeout_minutes))


def decay_groups(
    name: str, params, lr: float, min_lr: float, weight_decay: float, schedule: str | None = None
) -> list[ParamGroup]:
    """``name`` (matrices, with weight decay) and ``{name}_no_decay`` (biases and norms), the
    trainable parameters only; empty groups are left out."""
    params = [p for p in params if p.requires_grad]
    split = [
        (name, [p for p in params if p.ndim >= 2], weight_decay),
        (f"{name}_no_decay", [p for p in params if p.ndim < 2], 0.0),
    ]
    return [
        ParamGroup(group, chosen, lr, min_lr, decay, schedule or name)
        for group, chosen, decay in split
        if chosen
    ]


def model_and_own_groups(
    module: torch.nn.Module,
    opt: OptimizerConfig,
    name: str,
    own: dict[str, tuple[list, float, float]],
    constant: frozenset[str] = frozenset(),
    floors: dict[str, float] | None = None,
) -> list[ParamGroup]:
    """The optimizer groups of a task's module: ``decay_groups(name, ...)`` for every trainable
    parameter outside ``own``, then one group per entry of ``own`` (``{group: (parameters, peak
    lr, weight decay)}``) on its own schedule, its floor ``floors[group]`` or else in the ratio
    --min-lr / --lr; the groups named in ``constant`` keep their peak throughout."""
    owned = {id(p) for params, _, _ in own.values() for p in params}
    rest = [p for p in module.parameters() if id(p) not in owned]
    groups = decay_groups(name, rest, opt.lr, opt.min_lr, opt.weight_decay)
    ratio = opt.min_lr / opt.lr if opt.lr > 0 else 0.0
    for group, (params, lr, weight_decay) in own.items():
        params = [p for p in params if p.requires_grad]
        if params:
            fixed = group in constant
            floor = lr if fixed else (floors or {}).get(group, lr * ratio)
            groups.append(ParamGroup(group, params, lr, floor, weight_decay, group, fixed))
    return groups


def deepspeed_config(config: RunConfig, world_size: int) -> dict:
    """The DeepSpeed JSON for this run; a --deepspeed-config file is the base, flags win."""
    base: dict = {}
    if config.parallel.deepspeed_config:
        try:
            with open(config.parallel.deepspeed_config) as f:
                base = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"--deepspeed-config {config.parallel.deepspeed_config!r}: {e}"
            ) from None
    t = config.training
    accumulation = config.gradient_accumulation_steps(world_size)
    zero = dict(base.get("zero_optimization", {}), stage=config.parallel.zero_stage)
    zero = communication.zero_overlap(config, zero)
    deepspeed_clips = deepspeed_clips_grad_norm(config)
    bf16 = communication.bf16_section(config, base, accumulation)
    base.update(
        train_micro_batch_size_per_gpu=t.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        train_batch_size=t.global_batch_size,
        zero_optimization=zero,
        # otherwise the training step clips (and measures the norm) itself
        gradient_clipping=config.optimizer.clip_grad if deepspeed_clips else 0.0,
        zero_allow_untested_optimizer=True,  # our AdamW, with its parameter groups
        steps_per_print=base.get("steps_per_print", 10**9),  # we log ourselves
    )
    # its throughput timer waits for the device twice per micro-batch; we time iterations
    base.setdefault("timers", {"throughput": {"enabled": False}})
    if bf16 is not None:  # the file's section under DeepSpeed's current name
        base.pop("bfloat16", None)
        base["bf16"] = bf16
    if t.bf16:
        precision = communication.precision_entries(config)
        base["data_types"] = {**base.get("data_types", {}), **precision.pop("data_types")}
        base.update(precision)
    if t.fp16:
        if not torch.cuda.is_available():
            raise ConfigError("--fp16 needs a GPU (DeepSpeed has no fp16 on CPU): use --bf16")
        base["fp16"] = {**fp16_section(t), **base.get("fp16", {}), "enabled": True}
    return base


def fp16_section(t) -> dict:
    """DeepSpeed's fp16 entries for Megatron-LM's loss-scale flags (a ``TrainingConfig``):
    ``loss_scale`` 0 is DeepSpeed's dynamic scaling."""
    return {
        "loss_scale": t.loss_scale or 0,
        "initial_scale_power": int(math.log2(t.initial_loss_scale)),
        "loss_scale_window": int(t.loss_scale_window),
        "hysteresis": t.hysteresis,
        "min_loss_scale": t.min_loss_scale,
    }


def _log_communication(config: RunConfig, ds_config: dict) -> None:
    """One start-up line per communication flag this run sets (and the gradients' dtype under
    --bf16, which Megatron-LM's default makes float32): what it maps to here."""
    p, t = config.parallel, config.training
    given = {
        "--overlap-grad-reduce": p.overlap_grad_reduce,
        "--overlap-param-gather": p.overlap_param_gather,
        "--grad-reduce-in-bf16": t.bf16,
    }
    for flag, phrase in communication.describe(config, ds_config).items():
        if given[flag]:
            log_rank0("%s: %s", flag, phrase)


def build_optimizer(groups: list[ParamGroup], opt: OptimizerConfig) -> torch.optim.AdamW:
    """PyTorch's fused AdamW over the groups; ``max_lr``/``min_lr``/``schedule``/``constant_lr``
    drive each group's schedule."""
    if not groups:
        raise ConfigError("nothing to train: every parameter is frozen")
    param_groups = [
        {
            "name": name,
            "params": params,
            "lr": g.lr,
            "max_lr": g.lr,
            "min_lr": g.min_lr,
            "weight_decay": g.weight_decay,
            "schedule": g.schedule,
            "constant_lr": g.constant,
        }
        for g in groups
        for name, params in _one_dtype_each(g)
    ]
    betas = (opt.adam_beta1, opt.adam_beta2)
    try:
        # one kernel for all tensors, on every device type PyTorch has it for (CUDA, CPU, ...);
        # DeepSpeed's mixed-precision and ZeRO wrappers step it on their float32 master copies
        return torch.optim.AdamW(param_groups, betas=betas, eps=opt.adam_eps, fused=True)
    except RuntimeError:  # a device without the fused kernel: the multi-tensor implementation
        return torch.optim.AdamW(param_groups, betas=betas, eps=opt.adam_eps, foreach=True)


def _one_dtype_each(group: ParamGroup) -> list[tuple[str, list]]:
    """The group, its float32 islands (``utils.precision``) apart as ``{name}_float32``: DeepSpeed's
    ZeRO flattens a group into one buffer, which would turn a mixed group's 16-bit parameters
    into float32 views."""
    islands = [p for p in group.params if is_float32_island(p)]
    rest = [p for p in group.params if not is_float32_island(p)]
    if not islands or not rest:
        return [(group.name, group.params)]
    return [(group.name, rest), (f"{group.name}_float32", islands)]


def build_engine(model: TrainModel, config: RunConfig, world_size: int):
    """DeepSpeed's engine over megatron-core's groups; returns (engine, optimizer).

    A pipeline stage brings DeepSpeed's own grid (the same groups as megatron-core's); a
    ``forward_only`` pipeline runs backward on its last stage only.
    """
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.config import DeepSpeedConfig

    optimizer = build_optimizer(model.param_groups, config.optimizer)
    ds_config = {**deepspeed_config(config, world_size), **model.engine_config}
    _log_communication(config, ds_config)
    module = model.module
    pipeline = isinstance(module, PipelineModule)
    forward_only = pipeline and getattr(module, "forward_only", False)
    # what deepspeed.initialize does, with an engine class that keeps TempNet float32 under
    # --bf16 (compat.engine_class); a pipeline brings its own grid as the mpu
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    mpu = module.mpu() if pipeline else MegatronMPU()
    device = bind_device()  # DeepSpeed would take LOCAL_RANK, wrong with one GPU per task
    engine = compat.engine_class(pipeline, forward_only)(
        args=None if device is None else SimpleNamespace(device_rank=device),
        model=module,
        optimizer=optimizer,
        mpu=mpu,
        config=ds_config,
        config_class=DeepSpeedConfig(ds_config, mpu),
    )
    return engine, engine.optimizer
