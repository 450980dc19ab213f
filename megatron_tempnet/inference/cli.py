"""Flags shared by the inference tools (generate, evaluate, the lm-eval adapter)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_tempnet.data.tokenizers import (
    SentencePieceTokenizer,
    TokenizerConfig,
    TokenizerError,
    build_tokenizer,
)
from megatron_tempnet.inference.evaluation import fit_tau_max_eval
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
        "--tau-target-mean",
        type=float,
        help="set --tau-max-eval so that TempNet's mean tau over a sample is this (the paper's "
        "Table 1: 0.7 for instruction following); the sample: --tau-target-sample, else the "
        "tool's own input (generate: the prompts; evaluate: the scored text)",
    )
    g.add_argument(
        "--tau-target-sample",
        help="--tau-target-mean's sample: a text file (one text per line) or a .jsonl file of "
        '{"text": ...} (or {"prompt": ...}) objects',
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
    if args.tau_target_mean is not None:
        for flag, value in (("--fixed-tau", args.fixed_tau), ("--tau-max-eval", args.tau_max_eval)):
            if value is not None:
                raise InferenceError(f"--tau-target-mean chooses TempNet's upper bound: not with "
                                     f"{flag}")  # fmt: skip
    elif args.tau_target_sample:
        raise InferenceError("--tau-target-sample is the sample of --tau-target-mean: give both")
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


def read_texts(
    path: str, flag: str, keys: tuple[str, ...] = ("text", "prompt"), what: str = "texts"
) -> list[str]:
    """Texts from a text file (one per non-blank line), a ``.jsonl`` file of objects with one of
    ``keys``, or standard input (``-``, text lines); errors name ``flag`` and the line."""
    if path != "-" and not os.path.isfile(path):
        raise InferenceError(f"{flag} {path}: no such file")
    handle = sys.stdin if path == "-" else open(path, encoding="utf-8")
    texts = []
    with handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InferenceError(f"{path}:{number}: not valid JSON ({e.msg})") from None
                key = next((k for k in keys if isinstance(record, dict) and k in record), None)
                if key is None or not isinstance(record[key], str):
                    wanted = " or ".join(f'{{"{k}": "..."}}' for k in keys)
                    raise InferenceError(f"{path}:{number}: expected {wanted}")
                line = record[key]
            texts.append(line)
    if not texts:
        raise InferenceError(f"{flag} {path}: no {what} in it")
    return texts


def apply_tau_target(
    args: argparse.Namespace,
    model: InferenceModel,
    tokenizer,
    own: list[list[int]] | None = None,
    *,
    own_every_position: bool = True,
) -> dict | None:
    """``--tau-target-mean``: sets TempNet's upper bound at inference (``args.tau_max_eval``
    too) from the sample, ``--tau-target-sample`` or else the tool's own token sequences
    ``own`` (their scored tokens, or every token with ``own_every_position``); says so on rank
    0. None without the flag."""
    if args.tau_target_mean is None:
        return None
    if args.tau_target_sample:
        texts = read_texts(args.tau_target_sample, "--tau-target-sample")
        sequences = [tokenizer.tokenize(t) for t in texts]
        for i, sequence in enumerate(sequences):
            if not sequence:
                raise InferenceError(f"--tau-target-sample {args.tau_target_sample}: text "
                                     f"{i + 1} has no tokens")  # fmt: skip
        every, where = True, args.tau_target_sample
    elif own is None:
        raise InferenceError("--tau-target-mean needs --tau-target-sample: the texts TempNet's "
                             "mean tau is taken over")  # fmt: skip
    else:
        sequences, every, where = own, own_every_position, "the input"
    fitted = fit_tau_max_eval(model, sequences, args.tau_target_mean, every_position=every)
    args.tau_max_eval = fitted["tau_max_eval"]
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"--tau-target-mean {args.tau_target_mean:g}: TempNet's mean tau over "
              f"{fitted['tokens']:,} tokens of {where} is {fitted['tau_mean_trained']:.4f} at its "
              f"trained upper bound {model.tempnet.tau_max:g}; --tau-max-eval "
              f"{fitted['tau_max_eval']:.6g} makes it {args.tau_target_mean:g}",
              file=sys.stderr, flush=True)  # fmt: skip
    return fitted
