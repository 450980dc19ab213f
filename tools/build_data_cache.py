"""Build the sample-index cache of a training run ahead of time, on one process.

Give it the data flags the run will use (and the batch/iteration flags that decide how many
samples each split needs); the run then loads the cached indices from --data-cache-path instead
of building them at start-up on rank 0 while every other rank waits. The datasets are checked
against the tokenizer as the run checks them, and their token id ranges (one scan of each .bin)
are cached there too.

    python tools/build_data_cache.py --data-path 0.7 A_text_document 0.3 B_text_document \
        --split 949,50,1 --seq-length 2048 --train-iters 20000 --global-batch-size 512 \
        --eval-interval 1000 --eval-iters 10 --data-cache-path /scratch/cache \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_tempnet.data.gpt_data import GPTDataConfig, build_gpt_datasets, split_samples
from megatron_tempnet.data.loader import DataConfigError, dataset_fingerprint
from megatron_tempnet.data.tokenizers import TokenizerConfig
from megatron_tempnet.trainer.config import ConfigError, TrainingConfig
from megatron_tempnet.trainer.schedule import validate_rampup
from megatron_tempnet.utils.cli import run_tool
from megatron_tempnet.utils.flags import add_flags, from_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_flags(p, GPTDataConfig, "data")
    add_flags(p, TokenizerConfig, "tokenizer")
    g = p.add_argument_group("samples needed (pretrain_gpt.py's flags, with its defaults)")
    g.add_argument("--train-iters", type=int, help="the run's --train-iters (or --train-samples)")
    g.add_argument("--train-samples", type=int, help="the run's --train-samples")
    g.add_argument("--global-batch-size", type=int, required=True, help="the run's batch")
    g.add_argument(
        "--rampup-batch-size", type=int, nargs=3, metavar="N", help="the run's batch ramp"
    )
    t, same = TrainingConfig, "the run's (default: %(default)s)"
    g.add_argument("--eval-interval", type=int, default=t.eval_interval, help=same)
    g.add_argument("--eval-iters", type=int, default=t.eval_iters, help=same)
    return p


def training_config(args: argparse.Namespace) -> TrainingConfig:
    """The run's training flags that decide how many samples each split needs, checked."""
    if (args.train_iters is None) == (args.train_samples is None):
        raise DataConfigError("give one of --train-iters and --train-samples (the run's)")
    for flag in ("train_iters", "train_samples", "global_batch_size", "eval_iters"):
        value = getattr(args, flag)
        if value is not None and (value < 0 or (flag != "eval_iters" and value == 0)):
            raise DataConfigError(f"--{flag.replace('_', '-')} ({value}) is invalid")
    training = TrainingConfig(
        train_iters=args.train_iters,
        train_samples=args.train_samples,
        global_batch_size=args.global_batch_size,
        rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
    )
    try:
        validate_rampup(training, 1)
    except ConfigError as e:
        raise DataConfigError(str(e)) from None
    return training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.data_cache_path:
        raise DataConfigError("--data-cache-path is required: it is where the cache is built")
    sizes = split_samples(training_config(args))
    tokenizer = from_flags(TokenizerConfig, args).build()
    datasets = build_gpt_datasets(from_flags(GPTDataConfig, args), tokenizer, sizes)
    for name, size, ds in zip(("train", "valid", "test"), sizes, datasets):
        if ds is None:
            print(f"{name}: empty split")
        else:
            print(f"{name}: {len(ds)} samples (needs {size}), hash {dataset_fingerprint(ds)}")
    files = os.listdir(args.data_cache_path)
    print(f"cache: {args.data_cache_path} ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
