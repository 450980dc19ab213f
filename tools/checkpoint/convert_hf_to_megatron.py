r"""Convert a Hugging Face LLaMA-1/2/3.x, Mistral or GPT-2 model directory, or a llama.cpp GGUF
file of a LLaMA-architecture model, into a checkpoint of this project.

    python tools/checkpoint/convert_hf_to_megatron.py --hf-dir Llama-2-70b-chat-hf \
        --target-tp 8 --target-pp 2 --save checkpoints/llama2-70b-chat
    python tools/checkpoint/convert_hf_to_megatron.py --gguf SmolLM2.Q4_1.gguf --save ckpt/smollm2

LLaMA-3.1/3.2's RoPE scaling (``rope_type: llama3``, in ``rope_scaling`` or transformers 5's
``rope_parameters``) becomes ``--use-rope-scaling`` and its ``--rope-scaling-*`` values; a
setting the model here does not compute (another RoPE type, a sliding window, a ``head_dim``
other than hidden / heads, an activation other than SiLU, ...) stops the tool with its name
and value before anything is written.

The HF directory's tokenizer files (``tokenizer.json``, ``tokenizer.model``,
``tokenizer_config.json``, ``special_tokens_map.json`` and the others ``AutoTokenizer`` reads,
with ``config.json``, whose model type ``AutoTokenizer`` consults) are copied into
``DIR/tokenizer/`` once the model has passed its checks. That folder is recorded as the
checkpoint's tokenizer (``--tokenizer-type HuggingFaceTokenizer``): preprocess and train with
``--tokenizer-model DIR/tokenizer``; ``tools/generate.py --load DIR`` and ``tools/evaluate.py
--load DIR`` need no tokenizer flags.

The result loads with ``pretrain_gpt.py --load DIR`` (weights only: the run starts at iteration
0), ``--load DIR --finetune`` or ``--pretrained-checkpoint DIR``, with the model flags this tool
prints (also in ``DIR/model_flags.txt``), at any TP and PP: ``--target-tp`` and ``--target-pp``
only check that the model divides for the layout you mean to train with. Tensors are read
lazily and written one output file at a time: memory holds one TP rank's part of the model
(PP = 1) or one layer (PP > 1), never the whole model twice. The vocabulary is padded for the
target TP (``--make-vocab-size-divisible-by``); padded rows are zero.

``--gguf FILE`` (needs ``pip install -e '.[gguf]'``) reads a GGUF file whose
``general.architecture`` is ``llama`` (LLaMA, Mistral, SmolLM and others llama.cpp writes under
that name): every tensor is dequantised to float32 when it is written (F32, F16, BF16, Q4_0 to
Q8_0, the K-quants and IQ types that the ``gguf`` package reads; ``--dtype`` casts the result), and
llama.cpp's order of the q/k rows is put back. Its tokenizer (``tokenizer.ggml.*``) is saved as a
Hugging Face tokenizer in ``DIR/tokenizer/`` and recorded with the checkpoint, so
``tools/generate.py --load DIR`` and ``tools/evaluate.py --load DIR`` need no tokenizer flags. A
file with anything the model here does not compute (another architecture, RoPE scaling, a
per-frequency ``rope_freqs`` tensor, biases, experts, a type ``gguf`` cannot dequantise) is refused
by name before anything is written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError, latest_tag
from megatron_tempnet.inference.checkpoint_io import write_checkpoint, write_model_flags
from megatron_tempnet.inference.gguf_weights import GGUFWeights
from megatron_tempnet.inference.hf_weights import HFWeights, from_hf, model_config_from_hf
from megatron_tempnet.models.gpt.config import model_flags
from megatron_tempnet.utils.cli import run_tool

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files of an HF directory that ``AutoTokenizer`` may read for the tokenizer itself."""
_TOKENIZER_CONTEXT = ("config.json",)
"""Copied with them: ``AutoTokenizer`` reads the model type from it to choose the class."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-dir", help="a local transformers model directory (or --gguf)")
    p.add_argument("--gguf", help="a llama.cpp GGUF file of a LLaMA model (or --hf-dir)")
    p.add_argument("--save", required=True, help="output checkpoint directory")
    p.add_argument("--target-tp", "--target-tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--target-pp", "--target-pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint in --save")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.hf_dir is None) == (args.gguf is None):
        raise CheckpointError(
            "give the model as --hf-dir DIR or as --gguf FILE"
            if args.gguf is None
            else f"--hf-dir {args.hf_dir} and --gguf {args.gguf}: give one of them, not both"
        )
    if args.tp < 1 or args.pp < 1:
        raise CheckpointError(f"--target-tp ({args.tp}) and --target-pp ({args.pp}) must be >= 1")
    if os.path.isdir(args.save) and latest_tag(args.save) and not args.overwrite:
        raise CheckpointError(f"--save {args.save} already holds a checkpoint: use --overwrite")
    source = os.path.abspath(args.hf_dir or args.gguf)
    weights = HFWeights(args.hf_dir) if args.hf_dir else GGUFWeights(args.gguf)
    model = model_config_from_hf(weights.config)
    model.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by
    if model.num_layers % args.pp:
        raise CheckpointError(
            f"--target-pp ({args.pp}) must divide the model's {model.num_layers} layers"
        )
    model.validate(args.tp)  # before the tokenizer is written
    read = from_hf(model, weights)
    cast = DTYPES.get(args.dtype)
    out = os.path.join(args.save, "tokenizer")
    if args.hf_dir:
        tokenizer = _saved_tokenizer(copy_tokenizer(args.hf_dir, out))
    else:
        tokenizer = _saved_tokenizer(weights.save_tokenizer(out))
    path = write_checkpoint(
        args.save,
        model,
        (lambda n: read(n).to(cast)) if cast else read,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        config={"tokenizer": tokenizer, "converted_from": source},
        note=f"Weights only, converted from {source}.\n",
    )
    flags = write_model_flags(args.save, model_flags(model))
    print(
        f"wrote {path} (TP {args.tp} x PP {args.pp}); train it with\n  pretrain_gpt.py {flags} "
        f"--tensor-model-parallel-size {args.tp} --pipeline-model-parallel-size {args.pp} "
        f"--pretrained-checkpoint {args.save} ..."
    )
    return 0


def copy_tokenizer(hf_dir: str, out_dir: str) -> str | None:
    """Copy the tokenizer files ``hf_dir`` has into ``out_dir`` (emptied first: a file of an
    earlier conversion would change the tokenizer); returns ``out_dir``, or None when
    ``hf_dir`` holds no tokenizer (nothing is written then)."""
    present = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    if not present:
        return None
    present += [f for f in _TOKENIZER_CONTEXT if os.path.isfile(os.path.join(hf_dir, f))]
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    for name in present:
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    return out_dir


def _saved_tokenizer(directory: str | None) -> dict | None:
    """An HF tokenizer directory as the checkpoint records it (tools build it with no flags)."""
    if directory is None:
        return None
    return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(directory)}


if __name__ == "__main__":
    sys.exit(run_tool(main))
