"""pretrain_gpt.py's flags (Megatron-LM's names), generated from the run's config dataclasses."""

from __future__ import annotations

import argparse

from megatron_tempnet.data.gpt_data import GPTDataConfig
from megatron_tempnet.data.tokenizers import TokenizerConfig
from megatron_tempnet.models.gpt.config import PRESETS, ModelConfig
from megatron_tempnet.models.gpt.objective import LossConfig
from megatron_tempnet.models.gpt.task import GPTRunConfig, GPTTrainingConfig
from megatron_tempnet.tempnet.config import TEMPNET_FIELDS, TempNetConfig
from megatron_tempnet.trainer.arguments import add_run_flags, run_configs
from megatron_tempnet.utils.flags import add_flags, add_preset_flags, flag_values, from_flags

_DERIVED_DATA = ("seq_length", "seed")  # the model's --seq-length, the run's --seed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain or finetune a GPT/LLaMA with TempNet.")
    add_preset_flags(p, ModelConfig, PRESETS, "tiny", "architecture preset")
    add_flags(p, GPTDataConfig, "data", exclude=_DERIVED_DATA)
    add_flags(p, TokenizerConfig, "tokenizer")
    add_flags(p, LossConfig, "loss", exclude=TEMPNET_FIELDS)
    add_flags(p, TempNetConfig, "TempNet")
    add_run_flags(p, training=GPTTrainingConfig)
    return p


def config_from_args(args: argparse.Namespace) -> GPTRunConfig:
    overrides = flag_values(ModelConfig, args)
    preset = PRESETS[args.model]
    if overrides["seq_length"] is None:
        overrides["seq_length"] = preset["seq_length"]
    if overrides["max_position_embeddings"] is None:
        overrides["max_position_embeddings"] = max(
            overrides["seq_length"], preset["max_position_embeddings"]
        )
    model = ModelConfig.from_preset(args.model, **overrides)
    run = run_configs(args, training=GPTTrainingConfig)
    data = from_flags(GPTDataConfig, args, seq_length=model.seq_length, seed=run["training"].seed)
    return GPTRunConfig(
        model=model,
        loss=from_flags(LossConfig, args),
        data=data,
        tokenizer=from_flags(TokenizerConfig, args),
        preset=args.model,
        **run,
    )
