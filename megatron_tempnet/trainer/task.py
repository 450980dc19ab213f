"""The contract between the trainer and a model family (GPT/LLaMA, CLIP, ...).

The trainer (``loop.pretrain``) owns what every run does the same way: processes and groups, the
DeepSpeed engine and optimizer, the learning-rate schedule, the data position, checkpoints and
resume, preemption, logging. A ``Task`` brings what differs, and returns everything it builds:

    inputs = task.prepare(config, world_size)       # every flag checked; e.g. the tokenizer
    data = task.build_data(config, inputs)          # TaskData: train/valid sets, per-rank state
    model = task.build_model(config, data)          # TrainModel: module and parameter groups
    engine, optimizer = build_engine(model, ...)    # the trainer's
    step = task.build_step(engine, optimizer, config, data)
    stats = step(micro_batches)                     # one iteration: StepStats (on the device)
    metrics = task.validate(engine, config, data)   # {"val_...": value}

A task keeps no state between these calls: what a later call needs is in what an earlier one
returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_tempnet.distributed.sharding import TensorLayout
from megatron_tempnet.trainer.stats import StepStats


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict | None) -> None:
        """``state`` is None when the checkpoint has none (the implementation says what to do)."""

    def load_state_dicts(self, states: list[dict]) -> None:
        """Every rank's saved state, from a checkpoint of another layout: keep this rank's part."""


@dataclass
class TaskData:
    """What a run trains and validates on."""

    train: Any
    """Sample ``i`` of the run is ``train[i]`` (a dict of tensors), ``len(train)`` of them; the
    trainer's resumable loader walks it in order from the checkpointed position."""
    valid: Any | None = None
    """The validation set (the task's ``validate`` reads it), or None."""
    rank_state: Stateful | None = None
    """This rank's own state, saved with its checkpoint files and restored on resume (CLIP's
    shard of the per-sample state)."""


@dataclass
class ParamGroup:
    """One AdamW parameter group and its learning-rate schedule."""

    name: str
    """Saved with the optimizer state (``lm``, ``lm_no_decay``, ``tempnet``, ...)."""
    params: list[torch.nn.Parameter]
    lr: float
    """Peak learning rate (after warmup)."""
    min_lr: float
    """Floor of the cosine decay."""
    weight_decay: float
    schedule: str
    """Groups with the same schedule have the same learning rate; the first schedule's is logged
    as ``lr``, every other one's as ``{schedule}_lr``."""
    constant: bool = False
    """The learning rate stays at ``lr`` (no warm-up, no decay: --tempnet-constant-lr)."""


@dataclass
class TrainModel:
    """What a task builds for the engine."""

    module: torch.nn.Module
    """The whole model (PP = 1) or this rank's pipeline stage (a ``trainer.pipeline.Pipeline``);
    its forward computes the objective, so every pass goes through the engine."""
    param_groups: list[ParamGroup]
    optional: dict[str, str] = field(default_factory=dict)
    """State-dict prefixes a weights-only checkpoint (--finetune, --pretrained-checkpoint) may
    lack, and what they are: ``{"tempnet.": "TempNet"}``. They keep their initialisation."""
    frozen_from_pretrained: bool = False
    """Frozen parameters are left out of the checkpoints: every resume reads them again from
    --pretrained-checkpoint (TempNet on a frozen LM: the checkpoint holds TempNet only)."""
    tensor_layout: TensorLayout | None = None
    """How the split tensors are cut (``distributed.sharding``): the checkpoints' global
    tensors (``checkpoint.sharded_state``) need it."""
    engine_config: dict = field(default_factory=dict)
    """DeepSpeed config entries the model needs, over the run's (``{"pipeline": {...}}``)."""
    foreign_checkpoint: Callable[[str, str], ForeignCheckpoint | None] | None = None
    """Opens another framework's checkpoint in a directory (and the flag naming it) for a
    weights-only load; None when it holds none. --load, --finetune and --pretrained-checkpoint
    read it when the directory holds no checkpoint of this project."""
    flops_per_sample: float | None = None
    """Training FLOPs of one sample, forward and backward, over the whole model
    (--log-throughput); None: the task has no count."""


class ForeignCheckpoint(Protocol):
    """Another framework's checkpoint (Megatron-LM's), read as weights to start from: its full
    tensors under the training module's parameter names."""

    path: str
    description: str
    """What it is, for the start-up line (``a Megatron-LM torch_dist checkpoint (...)``)."""

    def shapes(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        """The full shapes of the ``names`` it holds (the others: absent)."""

    def stray(self, names: list[str]) -> list[str]:
        """Its model tensors that none of ``names`` reads (a model of another structure)."""

    def full(self, name: str) -> torch.Tensor:
        """The full tensor of parameter ``name``."""


StepFunction = Callable[[list[dict]], StepStats]
"""One training iteration over its micro-batches: the reduced statistics, the global gradient
norm before clipping (None where DeepSpeed reports none) and whether the optimizer stepped, left
on the device (the loop reads them in one copy; a step never waits for the device itself)."""


class Task(Protocol):
    """A model family's part of a run (see the module docstring for the order of the calls)."""

    evaluate_at_end: bool
    """Validate after the last iteration as well as every --eval-interval."""

    def prepare(self, config, world_size: int) -> Any:
        """Fill what the data decides (the vocabulary size) and check every flag; returns what
        ``build_data`` needs. Nothing is built and no process group exists yet."""

    def build_data(self, config, inputs: Any) -> TaskData:
        """The datasets (process groups exist now)."""

    def build_model(self, config, data: TaskData) -> TrainModel:
        """The module (the same initial weights whatever the parallel layout) and its groups."""

    def build_step(self, engine, optimizer, config, data: TaskData) -> StepFunction:
        """The function that runs one iteration on this layout."""

    def validate(self, engine, config, data: TaskData) -> dict[str, float]:
        """Validation metrics (keys start with ``val_``), identical on every rank."""
