"""Flags shared by the inference tools (generate, evaluate, the lm-eval adapter)."""

from __future__ import annotations

import argparse

import torch

from megatron_tempnet.data.tokenizers import (
    SentencePieceTokenizer,
    TokenizerConfig,
    TokenizerError,
    build_tokenizer,
)
from megatron_tempnet.inference.model import (
    InferenceError,
    InferenceModel,
    init_inference,
    load_inference_model,
)
from megatron_tempnet.models.attention import ATTENTION_BACKENDS
from megatron_tempnet.utils.flags import add_flags, from_flags


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
    g.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="core attention: auto = PyTorch's fused scaled_dot_product_attention, unfused = "
        "megatron-core's DotProductAttention (default: %(default)s)",
    )
    # default: the tokenizer saved with the checkpoint
    add_flags(parser, TokenizerConfig, "tokenizer", required=False)


def load_from_args(
    args: argparse.Namespace, *, need_tempnet: bool = True
) -> tuple[InferenceModel, object]:
    """``init_inference``, the model and its tokenizer (flags, else the checkpoint's).
    ``need_tempnet``: refuse a checkpoint without TempNet unless --fixed-tau is given."""
    if args.fixed_tau is not None and not args.fixed_tau > 0:
        raise InferenceError(f"--fixed-tau ({args.fixed_tau}) must be > 0")
    init_inference(args.tensor_model_parallel_size)
    tokenizer = from_flags(TokenizerConfig, args).build() if args.tokenizer_type else None
    model = load_inference_model(
        args.load,
        pretrained_checkpoint=args.pretrained_checkpoint,
        tempnet_dir=args.tempnet,
        tau_max_eval=args.tau_max_eval,
        dtype=torch.bfloat16 if args.bf16 else torch.float32,
        attention_backend=args.attention_backend,
        vocab_size=tokenizer.vocab_size if tokenizer else None,
    )
    if tokenizer is None:
        spec = model.config.get("tokenizer")
        if not spec:
            raise TokenizerError(
                f"--load {args.load}: no tokenizer saved with it: give --tokenizer-type and its "
                "files"
            )
        tokenizer = build_tokenizer(**spec)
    if tokenizer.vocab_size > model.vocab_size:
        hint = ""
        if isinstance(tokenizer, SentencePieceTokenizer):
            hint = (
                " (SentencePieceTokenizer adds Megatron-LM's special tokens to the model's: "
                "for the model's own ids give --tokenizer-type GPTSentencePieceTokenizer)"
            )
        raise TokenizerError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.vocab_size}{hint}"
        )
    if need_tempnet and args.fixed_tau is None and model.tempnet is None:
        raise InferenceError(f"--load {args.load}: no TempNet in it: give --tempnet or --fixed-tau")
    return model, tokenizer
