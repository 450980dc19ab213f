"""Convert a Hugging Face LLaMA-1/2/3.x, Mistral or GPT-2 model directory into a checkpoint of
this project.

    python tools/checkpoint/convert_hf_to_megatron.py --hf-dir Llama-2-70b-chat-hf \
        --target-tp 8 --target-pp 2 --save checkpoints/llama2-70b-chat

LLaMA-3.1/3.2's RoPE scaling (``rope_type: llama3``, in ``rope_scaling`` or transformers 5's
``rope_parameters``) becomes ``--use-rope-scaling`` and its ``--rope-scaling-*`` values; a
setting the model here does not compute (another RoPE type, a sliding window, a ``head_dim``
other than hidden / heads, an activation other than SiLU, ...) stops the tool with its name
and value before anything is written.

The result loads with ``pretrain_gpt.py --load DIR`` (weights only: the run starts at iteration
0), ``--load DIR --finetune`` or ``--pretrained-checkpoint DIR``, with the same TP and PP and the
model flags this tool prints (also in ``DIR/model_flags.txt``). Tensors are read lazily and
written one output file at a time: memory holds one TP rank's part of the model (PP = 1) or one
layer (PP > 1), never the whole model twice. The vocabulary is padded for the target TP
(``--make-vocab-size-divisible-by``); padded rows are zero.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_tempnet.inference.checkpoint_io import write_checkpoint, write_model_flags
from megatron_tempnet.inference.hf_weights import HFWeights, from_hf, model_config_from_hf
from megatron_tempnet.models.gpt.config import model_flags
from megatron_tempnet.trainer.checkpoint_format import CheckpointError, latest_tag
from megatron_tempnet.utils.cli import run_tool

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="a local transformers model directory")
    p.add_argument("--save", required=True, help="output checkpoint directory")
    p.add_argument("--target-tp", "--target-tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--target-pp", "--target-pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint in --save")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tp < 1 or args.pp < 1:
        raise CheckpointError(f"--target-tp ({args.tp}) and --target-pp ({args.pp}) must be >= 1")
    if os.path.isdir(args.save) and latest_tag(args.save) and not args.overwrite:
        raise CheckpointError(f"--save {args.save} already holds a checkpoint: use --overwrite")
    hf = HFWeights(args.hf_dir)
    model = model_config_from_hf(hf.config)
    model.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by
    if model.num_layers % args.pp:
        raise CheckpointError(
            f"--target-pp ({args.pp}) must divide the model's {model.num_layers} layers"
        )
    read = from_hf(model, hf)
    cast = DTYPES.get(args.dtype)
    config = {"tokenizer": _tokenizer(args.hf_dir), "converted_from": os.path.abspath(args.hf_dir)}
    path = write_checkpoint(
        args.save,
        model,
        (lambda n: read(n).to(cast)) if cast else read,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        config=config,
        note=f"Weights only, converted from {os.path.abspath(args.hf_dir)}.\n",
    )
    flags = write_model_flags(args.save, model_flags(model))
    print(
        f"wrote {path} (TP {args.tp} x PP {args.pp}); train it with\n  pretrain_gpt.py {flags} "
        f"--tensor-model-parallel-size {args.tp} --pipeline-model-parallel-size {args.pp} "
        f"--pretrained-checkpoint {args.save} ..."
    )
    return 0


def _tokenizer(hf_dir: str) -> dict | None:
    """The HF directory's own tokenizer, as --tokenizer-type HuggingFaceTokenizer."""
    if any(os.path.isfile(os.path.join(hf_dir, f)) for f in _TOKENIZER_FILES):
        return {
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": os.path.abspath(hf_dir),
        }
    return None


if __name__ == "__main__":
    sys.exit(run_tool(main))
