"""Convert this project's checkpoint (any TP x PP) into a Hugging Face model directory.

    python tools/checkpoint/convert_megatron_to_hf.py --load checkpoints/run --save hf-out \
        [--dtype bf16] [--max-shard-size-gb 5] [--tokenizer-dir Llama-2-7b-hf]

LLaMA-shaped models (RMSNorm, SwiGLU, RoPE) become ``LlamaForCausalLM`` (with ``rope_scaling``
for --use-rope-scaling), or ``MistralForCausalLM`` when the checkpoint's model is recorded as
Mistral (``--model mistral-7b`` or a converted Mistral; ``--hf-model-type`` chooses otherwise:
both compute the same), GPT-2-shaped ones ``GPT2LMHeadModel``: ``config.json`` plus
``model-0000i-of-0000n.safetensors`` shards and their index. Tensors are merged over TP ranks and
read one at a time (files are memory-mapped), so memory holds one output shard. TempNet is not
part of the HF model: export it with ``tools/export_tempnet.py`` and use it through
``TempNetLogitsProcessor``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.inference.checkpoint_io import open_reader
from megatron_tempnet.inference.hf_weights import hf_config, to_hf
from megatron_tempnet.utils.cli import run_tool
from megatron_tempnet.utils.progress import progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (its 'latest')")
    p.add_argument("--save", required=True, help="output Hugging Face model directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep)")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0)
    p.add_argument("--tokenizer-dir", help="copy the tokenizer files of this HF directory")
    p.add_argument(
        "--hf-model-type",
        choices=("llama", "mistral"),
        help="export a LLaMA-shaped model as this model_type (default: the checkpoint's record, "
        "else llama)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace files in --save")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reader = open_reader(args.load)
    if not reader.has_lm():
        raise CheckpointError(
            f"--load {args.load}: holds TempNet without the LM (a frozen-LM run): convert the "
            "LM's own checkpoint, and export TempNet with tools/export_tempnet.py"
        )
    if os.path.isfile(os.path.join(args.save, "config.json")) and not args.overwrite:
        raise CheckpointError(f"--save {args.save} already holds a model: use --overwrite")
    model = reader.model
    if args.hf_model_type:
        model = dataclasses.replace(model, hf_model_type=args.hf_model_type)
    names = [n for n in reader.names() if not n.startswith("tempnet.")]
    first = reader.full(names[0])
    dtype = DTYPES.get(args.dtype, first.dtype)
    config = hf_config(model, dtype)  # raises for models with no HF equivalent
    os.makedirs(args.save, exist_ok=True)
    with progress(f"converting {args.load}", len(names), unit="tensor") as bar:

        def read(name: str) -> torch.Tensor:  # to_hf reads each tensor once, in order
            tensor = reader.full(name)
            bar.update(1)
            return tensor

        max_bytes = int(args.max_shard_size_gb * 2**30)
        shards = _write_shards(to_hf(model, read, names), args.save, dtype, max_bytes)
    with open(os.path.join(args.save, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if args.tokenizer_dir:
        for name in _TOKENIZER_FILES:
            if os.path.isfile(os.path.join(args.tokenizer_dir, name)):
                shutil.copy(os.path.join(args.tokenizer_dir, name), args.save)
    print(f"wrote {args.save}: {config['architectures'][0]}, {shards} shard(s), {dtype}")
    return 0


def _write_shards(tensors, directory: str, dtype: torch.dtype, max_bytes: int) -> int:
    """Safetensors shards of at most ``max_bytes`` (one tensor may exceed it) + the index."""
    from safetensors.torch import save_file

    groups: list[dict] = [{}]
    size = total = 0
    paths = []
    for name, tensor in tensors:
        tensor = tensor.to(dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            paths.append(_flush(groups[-1], directory, len(paths), save_file))
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size, total = size + nbytes, total + nbytes
    paths.append(_flush(groups[-1], directory, len(paths), save_file))
    n = len(paths)
    weight_map = {}
    for i, (tmp, keys) in enumerate(paths):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(tmp, os.path.join(directory, final))
        weight_map.update(dict.fromkeys(keys, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return n


def _flush(group: dict, directory: str, i: int, save_file) -> tuple[str, list[str]]:
    tmp = os.path.join(directory, f"shard-{i}.partial")
    save_file(group, tmp, metadata={"format": "pt"})
    keys = list(group)
    group.clear()
    return tmp, keys


if __name__ == "__main__":
    sys.exit(run_tool(main))
