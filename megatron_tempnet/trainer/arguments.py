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

_GROUPS = {
    "parallel": (ParallelConfig, "parallelism"),
    "optimizer": (OptimizerConfig, "optimizer and schedule"),
    "training": (TrainingConfig, "training"),
    "checkpoint": (CheckpointConfig, "checkpoints"),
    "logging": (LoggingConfig, "logging"),
}


def add_run_flags(
    parser: argparse.ArgumentParser, optimizer: type[OptimizerConfig] = OptimizerConfig
) -> None:
    """Parallelism, optimizer, training, checkpoint and logging flags (``optimizer``: a family's
    subclass with its own defaults)."""
    for name, (cls, title) in _GROUPS.items():
        add_flags(parser, optimizer if name == "optimizer" else cls, title)


def run_configs(
    args: argparse.Namespace, optimizer: type[OptimizerConfig] = OptimizerConfig
) -> dict:
    """``RunConfig``'s shared fields from the parsed flags, by field name."""
    return {
        name: from_flags(optimizer if name == "optimizer" else cls, args)
        for name, (cls, _) in _GROUPS.items()
    }
