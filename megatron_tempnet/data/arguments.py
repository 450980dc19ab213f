"""Megatron-LM's tokenizer and data flags, shared by the tools and the training entry points."""

from __future__ import annotations

import argparse

from megatron_tempnet.data.gpt_data import GPTDataConfig
from megatron_tempnet.data.tokenizers import TOKENIZER_TYPES


def add_tokenizer_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=required, choices=TOKENIZER_TYPES)
    g.add_argument(
        "--tokenizer-model", help="SentencePiece .model file, or a Hugging Face tokenizer directory"
    )
    g.add_argument("--vocab-file", help="GPT-2 vocab.json")
    g.add_argument("--merge-file", help="GPT-2 merges.txt")


def add_data_args(parser: argparse.ArgumentParser, seq_length_default: int | None = 1024) -> None:
    g = parser.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="+",
        required=True,
        metavar="[WEIGHT] PREFIX",
        help="indexed dataset prefixes, each optionally preceded by its blending weight",
    )
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions")
    g.add_argument("--seq-length", type=int, default=seq_length_default, help="tokens per sample")
    g.add_argument("--seed", type=int, default=1234, help="data shuffling seed")
    g.add_argument(
        "--data-cache-path", help="directory for the cached sample indices (default: beside data)"
    )
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def data_config_from_args(args: argparse.Namespace) -> GPTDataConfig:
    return GPTDataConfig(
        data_path=list(args.data_path),
        split=args.split,
        seq_length=args.seq_length,
        seed=args.seed,
        data_cache_path=args.data_cache_path,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
    )
