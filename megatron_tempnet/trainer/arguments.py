"""The flags every training entry point shares, generated from the trainer's config dataclasses."""

from __future__ import annotations

import argparse

from megatron_tempnet.trainer.config import (
    CheckpointConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
)
from megatron_tempnet.utils.flags import add_flags, from_flags
from megatron_tempnet.utils.yaml_cfg import add_yaml_flag

_GROUPS = {
    "parallel": (ParallelConfig, "parallelism"),
    "optimizer": (OptimizerConfig, "optimizer and schedule"),
    "training": (TrainingConfig, "training"),
    "checkpoint": (CheckpointConfig, "checkpoints"),
    "logging": (LoggingConfig, "logging"),
}


def add_run_flags(parser: argparse.ArgumentParser, **families: type) -> None:
    """Parallelism, optimizer, training, checkpoint and logging flags; ``families`` replaces a
    group's config by a family's subclass (``training=GPTTrainingConfig``); and ``--yaml-cfg``."""
    add_yaml_flag(parser)
    for name, (cls, title) in _GROUPS.items():
        add_flags(parser, families.get(name, cls), title)


def run_configs(args: argparse.Namespace, **families: type) -> dict:
    """``RunConfig``'s shared fields from the parsed flags, by field name (``families`` as in
    ``add_run_flags``)."""
    return {name: from_flags(families.get(name, cls), args) for name, (cls, _) in _GROUPS.items()}
