"""Flags shared by the inference tools (generate, evaluate, the lm-eval adapter)."""

from __future__ import annotations

import argparse
import os

import torch

from megatron_tempnet.data.arguments import add_tokenizer_args
from megatron_tempnet.data.tokenizers import TokenizerError, build_tokenizer, tokenizer_spec
from megatron_tempnet.inference.model import (
    InferenceError,
    InferenceModel,
    init_inference,
    load_inference_model,
)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--load", required=True, help="checkpoint directory (any saved TP x PP)")
    g.add_argument(
        "--pretrained-checkpoint",
        help="the LM, when --load holds TempNet only (default: the one its run used)",
    )
    g.add_argument("--tempnet", help="an exported TempNet directory (default: --load's TempNet)")
    g.add_argument(
        "--fixed-tau", type=float, help="one temperature for every token instead of TempNet's"
    )
    g.add_argument(
        "--tau-max-eval", type=float, help="TempNet's upper bound at inference (paper's Figure 9)"
    )
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="processes to split the model over (launch that many with torchrun)",
    )
    g.add_argument("--bf16", action="store_true", help="run the LM in bfloat16")
    add_tokenizer_args(parser, required=False)  # default: the checkpoint's own


def load_from_args(args: argparse.Namespace) -> tuple[InferenceModel, object]:
    """``init_inference``, the model and its tokenizer (flags, else the checkpoint's)."""
    if args.fixed_tau is not None and not args.fixed_tau > 0:
        raise InferenceError(f"--fixed-tau ({args.fixed_tau}) must be > 0")
    init_inference(args.tensor_model_parallel_size)
    model = load_inference_model(
        args.load, pretrained_checkpoint=args.pretrained_checkpoint, tempnet_dir=args.tempnet,
        tau_max_eval=args.tau_max_eval, dtype=torch.bfloat16 if args.bf16 else torch.float32,
    )  # fmt: skip
    if args.tokenizer_type:
        spec = tokenizer_spec(args)
    else:
        spec = model.config.get("tokenizer")
        if not spec:
            raise TokenizerError(f"--load {args.load}: no tokenizer saved with it: give "
                                 "--tokenizer-type and its files")  # fmt: skip
    tokenizer = build_tokenizer(**spec)
    if tokenizer.vocab_size > model.vocab_size:
        raise TokenizerError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.vocab_size}"
        )
    if args.fixed_tau is None and model.tempnet is None:
        raise InferenceError(f"--load {args.load}: no TempNet in it: give --tempnet or --fixed-tau")
    return model, tokenizer


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions the inference tools report as one line (exit status 1)."""
    from megatron_tempnet.models.gpt import ModelConfigError
    from megatron_tempnet.tempnet.export import TempNetFileError
    from megatron_tempnet.training.checkpoint import CheckpointError

    return (InferenceError, CheckpointError, TokenizerError, TempNetFileError, ModelConfigError)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` under a temporary name, then rename: a failure leaves no partial file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".partial", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".partial", path)
