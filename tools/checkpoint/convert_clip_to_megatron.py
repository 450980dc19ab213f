"""Convert a pretrained CLIP (Hugging Face ``CLIPModel`` directory or OpenCLIP ViT state dict)
into a weights-only checkpoint of this project's towers.

    python tools/checkpoint/convert_clip_to_megatron.py --hf-dir clip-vit-base-patch16 \
        --target-tp 2 --save checkpoints/clip-b16
    python tools/checkpoint/convert_clip_to_megatron.py --open-clip-checkpoint b16.pt \
        --quick-gelu --save checkpoints/openclip-b16

Train from it with ``pretrain_clip.py --pretrained-checkpoint DIR`` and the model flags this tool
prints (also in ``DIR/model_flags.txt``), at the same TP and PP = 1. The temperature (TempNet,
TaU's heads) starts from its initialisation; ``--clip-loss clip`` starts its tau from the
checkpoint's logit scale. The vocabulary is padded for the target TP; padded rows are zero.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError, latest_tag
from megatron_tempnet.checkpoint.file_io import load_file
from megatron_tempnet.inference.checkpoint_io import write_model_flags, write_weights
from megatron_tempnet.inference.hf_weights import HFWeights
from megatron_tempnet.models.clip import pretrained
from megatron_tempnet.models.clip.config import CLIPModelConfig
from megatron_tempnet.utils.cli import run_tool

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-dir", help="a local transformers CLIPModel directory")
    source.add_argument("--open-clip-checkpoint", help="an OpenCLIP ViT CLIP state dict (.pt)")
    p.add_argument(
        "--quick-gelu",
        action="store_true",
        help="the OpenCLIP model uses QuickGELU (OpenAI's weights, -quickgelu models)",
    )
    p.add_argument("--save", required=True, help="output checkpoint directory")
    p.add_argument("--target-tp", "--target-tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: float32)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint in --save")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _read(args) -> tuple[dict, dict]:
    """(model config fields, our full tensors)."""
    if args.hf_dir:
        hf = HFWeights(args.hf_dir)
        fields = pretrained.config_from_hf(hf.config)
        model = CLIPModelConfig(**fields)
        state = _HFState(hf)
        return fields, pretrained.full_from_hf(state, model)
    try:
        state = load_file(args.open_clip_checkpoint)  # weights only: never unpickles code
    except CheckpointError as e:
        raise CheckpointError(f"--open-clip-checkpoint {e}") from None
    state = state.get("state_dict", state)
    state = {k.removeprefix("module."): v for k, v in state.items()}  # DDP-saved
    if "visual.conv1.weight" not in state:
        raise CheckpointError(
            f"--open-clip-checkpoint {args.open_clip_checkpoint}: no visual.conv1.weight (not "
            "an OpenCLIP ViT state dict)"
        )
    fields = pretrained.config_from_open_clip(state, args.quick_gelu)
    hf_named = pretrained.hf_names_from_open_clip(state)
    return fields, pretrained.full_from_hf(hf_named, CLIPModelConfig(**fields))


class _HFState:
    """``name in state`` and ``state[name]`` over a lazily read HF directory."""

    def __init__(self, hf: HFWeights):
        self.hf = hf

    def __contains__(self, name: str) -> bool:
        try:
            self.hf.get(name)
        except CheckpointError:
            return False
        return True

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.hf.get(name)


def model_flags(fields: dict) -> list[str]:
    """The pretrain_clip.py model flags of a converted model."""
    flags = []
    for name, value in fields.items():
        if name == "vocab_size":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, str(value)]
    return flags


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tp < 1:
        raise CheckpointError(f"--target-tp ({args.tp}) must be >= 1")
    if os.path.isdir(args.save) and latest_tag(args.save) and not args.overwrite:
        raise CheckpointError(f"--save {args.save} already holds a checkpoint: use --overwrite")
    fields, full = _read(args)
    model = CLIPModelConfig(
        **fields, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by
    )
    model.validate(args.tp)
    padded, cast = model.padded_vocab_size(args.tp), DTYPES.get(args.dtype, torch.float32)

    source = os.path.abspath(args.hf_dir or args.open_clip_checkpoint)
    path = write_weights(
        args.save,
        ((name, lambda v=value, n=name: v.to(cast if n != "log_tau" else torch.float32))
         for name, value in full.items()),
        len(full),
        config={"model": model.__dict__.copy(), "converted_from": source},
        note=f"Weights only, converted from {source}.\n",
    )  # fmt: skip
    flags = write_model_flags(args.save, model_flags(fields))
    print(
        f"wrote {path} (TP {args.tp}, vocabulary {fields['vocab_size']} padded to {padded}); "
        f"train from it with\n  pretrain_clip.py {flags} --tensor-model-parallel-size {args.tp} "
        f"--pretrained-checkpoint {args.save} ..."
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
