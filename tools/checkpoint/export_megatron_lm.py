r"""Write a checkpoint of this project (any TP x PP) as a Megatron-LM torch_dist checkpoint.

    python tools/checkpoint/export_megatron_lm.py --load checkpoints/run \
        --save megatron_ckpt --target-tp 8 --target-pp 2

writes ``megatron_ckpt/latest_checkpointed_iteration.txt`` (``release``) and
``megatron_ckpt/release/``: the LM's weights under megatron-core's ``GPTModel`` names in
megatron-core's ``dist_checkpointing`` layout (``.metadata``, ``__0_0.distcp``, ``common.pt``
with Megatron-LM's ``args`` for the model, ``metadata.json``), which Megatron-LM loads with
``--load megatron_ckpt --finetune --ckpt-format torch_dist`` (add ``--use-checkpoint-args`` for
the model flags; ``--no-load-optim --no-load-rng``) at any TP x PP. The vocabulary is padded
as Megatron-LM pads it for ``--target-tp`` (``--make-vocab-size-divisible-by``, default the
model's, x TP; zero rows): Megatron-LM loads the checkpoint at a TP size that pads it the
same. A run's float32 master weights are written where it saved them (``--dtype`` casts).

A run's TempNet goes beside it, as ``tools/export_tempnet.py`` writes it, in
``megatron_ckpt/tempnet/``. A run that trained TempNet on a frozen LM holds TempNet only: its
LM is read from the checkpoint it started from (its ``--pretrained-checkpoint``, or this tool's).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.inference.checkpoint_io import (
    export_reader_tempnet,
    lm_names,
    open_reader,
)
from megatron_tempnet.models.gpt.megatron_lm import TRACKER
from megatron_tempnet.models.gpt.megatron_lm.export import megatron_args, write_torch_dist
from megatron_tempnet.utils.cli import run_tool

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", required=True, help="this project's checkpoint directory")
    p.add_argument(
        "--pretrained-checkpoint",
        help="the LM, when --load holds TempNet only (default: its run's)",
    )
    p.add_argument("--save", required=True, help="the Megatron-LM checkpoint directory to write")
    p.add_argument("--target-tp", "--target-tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--target-pp", "--target-pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, help="default: the model's")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint in --save")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp < 1 or args.pp < 1:
        raise CheckpointError(f"--target-tp ({args.tp}) and --target-pp ({args.pp}) must be >= 1")
    if os.path.exists(os.path.join(args.save, TRACKER)) and not args.overwrite:
        raise CheckpointError(f"--save {args.save} already holds a checkpoint: use --overwrite")
    reader = open_reader(args.load)
    lm = reader
    if not reader.has_lm():
        saved = reader.config.get("checkpoint", {}).get("pretrained_checkpoint")
        source = args.pretrained_checkpoint or saved
        if not source:
            raise CheckpointError(
                f"--load {args.load}: holds TempNet without the LM: add --pretrained-checkpoint"
            )
        lm = open_reader(source, "--pretrained-checkpoint", vocab_size=reader.model.vocab_size)
    model = lm.model
    if args.make_vocab_size_divisible_by:
        model.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by
    model.validate(args.tp)
    if model.num_layers % args.pp:
        raise CheckpointError(
            f"--target-pp ({args.pp}) must divide the model's {model.num_layers} layers"
        )
    padded = model.padded_vocab_size(args.tp)
    names = [n for n in lm_names(model) if not n.endswith("_extra_state")]
    cast = DTYPES.get(args.dtype)
    tokenizer = lm.config.get("tokenizer") or reader.config.get("tokenizer")
    margs = megatron_args(model, tp=args.tp, pp=args.pp, padded_vocab=padded, tokenizer=tokenizer)
    path = write_torch_dist(
        args.save, model, names, (lambda n: lm.full(n).to(cast)) if cast else lm.full, margs
    )
    print(
        f"wrote {path} (Megatron-LM torch_dist, vocabulary padded to {padded} for TP {args.tp}); "
        f"load it with --load {args.save} --finetune --ckpt-format torch_dist "
        "--use-checkpoint-args --no-load-optim --no-load-rng"
    )
    if reader.has_tempnet():
        out = os.path.join(args.save, "tempnet")
        config = export_reader_tempnet(reader, out)
        print(f"wrote {out}: TempNet d1={config['d1']} d2={config['d2']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
