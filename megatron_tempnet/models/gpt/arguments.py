"""pretrain_gpt.py's flags (Megatron-LM's names), generated from the run's config dataclasses.

Without ``--model`` the architecture is what its flags say, with Megatron-LM's defaults; with
``--model X`` a preset fills the flags not given, and each override is listed at start-up
(``megatron_flags``). Megatron-LM's other spellings are accepted and mapped; flags of features
that are not built stop the run before it starts, all named in one error.
"""

from __future__ import annotations

import argparse
import os

from megatron_tempnet.data.gpt_data import GPTDataConfig
from megatron_tempnet.data.tokenizers import TokenizerConfig
from megatron_tempnet.models.gpt import megatron_flags
from megatron_tempnet.models.gpt.checkpoint_args import (
    model_args_from_checkpoint,
    saved_run_config,
)
from megatron_tempnet.models.gpt.config import PRESETS, ModelConfig
from megatron_tempnet.models.gpt.objective import LossConfig
from megatron_tempnet.models.gpt.task import (
    GPTOptimizerConfig,
    GPTRunConfig,
    GPTTrainingConfig,
)
from megatron_tempnet.tempnet.config import TempNetConfig
from megatron_tempnet.trainer import megatron_flags as run_flags
from megatron_tempnet.trainer.arguments import add_run_flags, run_configs
from megatron_tempnet.utils.flag_parser import FlagError, FlagParser
from megatron_tempnet.utils.flags import add_flags, add_preset_flags, flag_values, from_flags
from megatron_tempnet.utils.logging import log_startup

_DERIVED_DATA = ("seq_length", "seed")  # the model's --seq-length, the run's --seed


def build_parser() -> FlagParser:
    p = FlagParser(
        description="Pretrain or finetune a GPT/LLaMA with TempNet.",
        refused=run_flags.REFUSED,
        refused_prefixes=run_flags.REFUSED_PREFIXES,
    )
    add_preset_flags(p, ModelConfig, PRESETS, None, "architecture preset",
                     required=megatron_flags.required_shape())  # fmt: skip
    add_flags(p, GPTDataConfig, "data", exclude=_DERIVED_DATA)
    add_flags(p, TokenizerConfig, "tokenizer")
    add_flags(p, LossConfig, "loss")
    add_flags(p, TempNetConfig, "TempNet")
    add_run_flags(p, training=GPTTrainingConfig, optimizer=GPTOptimizerConfig)
    add_flags(p, megatron_flags.GPTSpellings, "other spellings of Megatron-LM and TempNet")
    add_flags(p, run_flags.RunSpellings, "accepted for Megatron-LM's launch scripts")
    p.add_fill(megatron_flags.infer_tokenizer)
    p.add_fill(lambda args: megatron_flags.apply(args, args.given_flags))
    p.add_fill(run_flags.apply)
    p.add_check(lambda args: megatron_flags.model_problems(args, args.given_flags))
    p.add_check(run_flags.problems)
    return p


def config_from_args(args: argparse.Namespace) -> GPTRunConfig:
    given = getattr(args, "given_flags", set())
    log_startup(_use_tempnet_start(args))
    log_startup(megatron_flags.model_notes(args, given) + run_flags.notes(args, given))
    model = _model(args)
    run = run_configs(args, training=GPTTrainingConfig, optimizer=GPTOptimizerConfig)
    data = from_flags(GPTDataConfig, args, seq_length=model.seq_length, seed=run["training"].seed)
    return GPTRunConfig(
        model=model,
        loss=from_flags(LossConfig, args, tempnet=from_flags(TempNetConfig, args)),
        data=data,
        tokenizer=from_flags(TokenizerConfig, args),
        preset=args.model,
        **run,
    )


def _use_tempnet_start(args: argparse.Namespace) -> list[str]:
    """--use-tempnet (TempNet's code) starts from an LM checkpoint in --load: its weights are
    loaded and TempNet starts fresh, as there; once --load holds a TempNet checkpoint the run
    resumes from it."""
    if not (args.use_tempnet and args.load and not args.finetune):
        return []
    saved = saved_run_config(args.load)
    if saved is None or saved[1].get("loss", {}).get("tau_source") == "tempnet":
        return []
    args.finetune = True
    return [
        f"--use-tempnet: {os.path.join(args.load, saved[0])} is an LM without TempNet: its "
        "weights are loaded and TempNet starts fresh at iteration 0 (--finetune)"
    ]


def _model(args: argparse.Namespace) -> ModelConfig:
    overrides = flag_values(ModelConfig, args)
    if args.use_checkpoint_args and args.load:
        overrides, lines = model_args_from_checkpoint(
            args.load, overrides, require=args.exit_on_missing_checkpoint
        )
        log_startup(lines)
    if args.model is None:
        missing = [n for n in megatron_flags.required_shape() if overrides.get(n) is None]
        if missing:
            flags = " ".join("--" + n.replace("_", "-") for n in missing)
            raise FlagError(
                f"{flags}: required without --model, and --load {args.load} holds no checkpoint "
                "to read them from (--use-checkpoint-args)"
            )
        return ModelConfig(**{k: v for k, v in overrides.items() if v is not None})
    preset = PRESETS[args.model]
    if overrides["seq_length"] is None:
        overrides["seq_length"] = preset["seq_length"]
    if overrides["max_position_embeddings"] is None:
        overrides["max_position_embeddings"] = max(
            overrides["seq_length"], preset["max_position_embeddings"]
        )
    return ModelConfig.from_preset(args.model, **overrides)
