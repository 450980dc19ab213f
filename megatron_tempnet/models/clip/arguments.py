"""pretrain_clip.py's flags (Megatron-LM's and OpenCLIP's names), generated from its configs."""

from __future__ import annotations

import argparse

from megatron_tempnet.data.tokenizers import TokenizerConfig
from megatron_tempnet.models.clip.config import (
    CLIP_PRESETS,
    CLIPLossConfig,
    CLIPModelConfig,
    CLIPTempNetConfig,
)
from megatron_tempnet.models.clip.data.image_text import ImageTextDataConfig
from megatron_tempnet.models.clip.task import (
    CLIPEvalConfig,
    CLIPParallelConfig,
    CLIPRunConfig,
    CLIPTrainingConfig,
)
from megatron_tempnet.trainer import megatron_flags as run_flags
from megatron_tempnet.trainer.arguments import add_run_flags, run_configs
from megatron_tempnet.utils.flag_parser import FlagParser
from megatron_tempnet.utils.flags import add_flags, add_preset_flags, flag_values, from_flags


def build_clip_parser() -> FlagParser:
    p = FlagParser(
        description="Train a CLIP model with TempNet or a baseline loss.",
        refused={**run_flags.REFUSED, **run_flags.CLIP_REFUSED},
        refused_prefixes=run_flags.REFUSED_PREFIXES,
    )
    add_preset_flags(p, CLIPModelConfig, CLIP_PRESETS, "clip-tiny", "both towers' shapes")
    g = add_flags(p, ImageTextDataConfig, "data")
    add_flags(g, CLIPEvalConfig)
    add_flags(p, TokenizerConfig, "tokenizer")
    add_flags(p, CLIPLossConfig, "loss")
    add_flags(p, CLIPTempNetConfig, "TempNet")
    add_run_flags(p, parallel=CLIPParallelConfig, training=CLIPTrainingConfig)
    p.add_check(_clip_problems)
    return p


def _clip_problems(args: argparse.Namespace) -> list[str]:
    """Flags the shared trainer has that a CLIP run cannot use."""
    if args.use_checkpoint_args:
        return [
            "--use-checkpoint-args: pretrain_clip.py builds the towers from --model and its "
            "flags only"
        ]
    return []


def clip_config_from_args(args: argparse.Namespace) -> CLIPRunConfig:
    run = run_configs(args, parallel=CLIPParallelConfig, training=CLIPTrainingConfig)
    return CLIPRunConfig(
        model=CLIPModelConfig.from_preset(args.model, **flag_values(CLIPModelConfig, args)),
        loss=from_flags(CLIPLossConfig, args, tempnet=from_flags(CLIPTempNetConfig, args)),
        data=from_flags(ImageTextDataConfig, args, seed=run["training"].seed),
        tokenizer=from_flags(TokenizerConfig, args),
        evaluation=from_flags(CLIPEvalConfig, args),
        preset=args.model,
        **run,
    )
