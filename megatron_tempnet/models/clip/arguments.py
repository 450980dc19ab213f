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
from megatron_tempnet.models.clip.task import CLIPEvalConfig, CLIPOptimizerConfig, CLIPRunConfig
from megatron_tempnet.tempnet.config import TEMPNET_FIELDS
from megatron_tempnet.trainer.arguments import add_run_flags, run_configs
from megatron_tempnet.utils.flags import add_flags, add_preset_flags, flag_values, from_flags


def build_clip_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train a CLIP model with TempNet or a baseline loss.")
    add_preset_flags(p, CLIPModelConfig, CLIP_PRESETS, "clip-tiny", "both towers' shapes")
    g = add_flags(p, ImageTextDataConfig, "data")
    add_flags(g, CLIPEvalConfig)
    add_flags(p, TokenizerConfig, "tokenizer")
    add_flags(p, CLIPLossConfig, "loss", exclude=TEMPNET_FIELDS)
    add_flags(p, CLIPTempNetConfig, "TempNet")
    add_run_flags(p, optimizer=CLIPOptimizerConfig)
    return p


def clip_config_from_args(args: argparse.Namespace) -> CLIPRunConfig:
    run = run_configs(args, optimizer=CLIPOptimizerConfig)
    return CLIPRunConfig(
        model=CLIPModelConfig.from_preset(args.model, **flag_values(CLIPModelConfig, args)),
        loss=from_flags(CLIPLossConfig, args),
        data=from_flags(ImageTextDataConfig, args, seed=run["training"].seed),
        tokenizer=from_flags(TokenizerConfig, args),
        evaluation=from_flags(CLIPEvalConfig, args),
        preset=args.model,
        **run,
    )
