"""Upgrade checkpoints of the earlier format (DeepSpeed's files and ``portable/``) to the
sharded one, in place or into --save.

    python tools/checkpoint/upgrade.py LOAD_DIR [--save OUT] [--all]

The earlier format kept DeepSpeed's per-rank files and, for a training checkpoint, a
layout-free copy (``portable/``: every tensor's float32 master and AdamW moments per TP rank
and pipeline stage, with ``index.json``: the iteration, data position, step and config); a
conversion (``WEIGHTS_ONLY``) had the module files only. The upgrade writes each checkpoint's
full tensors (``weight/{name}`` in float32, which is the master, and the moments) in the
sharded format, carries the RNG and task state files over unchanged and writes
``train_state.json``; a resume from the upgraded checkpoint at the layout that saved it is
exact, RNG streams included, and at any other layout as exact as any resume there.

In place, the new checkpoint is written beside the old one (``TAG.upgrading``), completed,
then swapped in (the old one renamed ``TAG.format1``, then deleted). Only the checkpoint
``latest`` names is upgraded, or with --all every complete one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron_tempnet.checkpoint.checkpoint_format import (  # noqa: E402
    CONFIG,
    CONFIG_YAML,
    FORMAT,
    FROZEN_LM_EXCLUDED,
    TRAIN_STATE,
    WEIGHTS_ONLY,
    CheckpointError,
    check_checkpoint,
    checkpoint_tags,
    is_complete,
    latest_tag,
    mark_complete,
    publish_latest,
)
from megatron_tempnet.checkpoint.file_io import load_file  # noqa: E402
from megatron_tempnet.checkpoint.shard_storage import DIRECTORY, write_full_tensors  # noqa: E402
from megatron_tempnet.distributed.sharding import merge_tensor, tensor_kind  # noqa: E402
from megatron_tempnet.utils.cli import run_tool  # noqa: E402

_STAGE = re.compile(r"stage_tp(\d+)_pp(\d+)\.pt$")
_LAYER = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
_MOMENTS = ("exp_avg", "exp_avg_sq")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("load", help="a --save directory holding checkpoints of the earlier format")
    p.add_argument("--save", help="write the upgraded checkpoints here (default: in place)")
    p.add_argument("--all", action="store_true", help="every complete checkpoint, not only latest")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _portable(directory: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """``portable/``'s index and every tensor merged to its full shape: ``{name: {"param",
    "exp_avg", "exp_avg_sq"}}`` (a frozen tensor: ``param`` only)."""
    with open(os.path.join(directory, "portable", "index.json")) as f:
        index = json.load(f)
    stages: dict[tuple[int, int], dict] = {}
    for path in glob.glob(os.path.join(directory, "portable", "stage_tp*_pp*.pt")):
        tp, pp = map(int, _STAGE.search(path).groups())
        stages[(tp, pp)] = load_file(path)["tensors"]
    layout = index["layout"]
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for pp in range(layout["pipeline_parallel"]):
        ranks = [stages[(tp, pp)] for tp in range(layout["tensor_parallel"])]
        for name, entry in ranks[0].items():
            if name in tensors:  # a tied weight is on two stages
                continue
            tensors[name] = {
                key: merge_tensor(entry["kind"], [r[name][key] for r in ranks],
                                  vocab_size=int(index["vocab_size"])).float()
                for key in ("param", *_MOMENTS) if key in entry
            }  # fmt: skip
    return index, tensors


def _module_files(directory: str, config: dict) -> dict[str, torch.Tensor]:
    """A conversion's module files (per TP rank; one per piece and TP rank with pipeline
    parallelism) merged to full tensors under the training module's names."""
    model = config["model"]
    swiglu, vocab = bool(model.get("swiglu")), int(model["vocab_size"])
    shards: dict[str, list] = {}
    layers = sorted(f for f in os.listdir(directory) if _LAYER.match(f))
    if layers:
        for name in layers:
            index, rank = map(int, _LAYER.match(name).groups())
            for k, v in load_file(os.path.join(directory, name)).items():
                shards.setdefault(f"lm.pieces.{index}.{k}", {})[rank] = v
    else:
        for path in sorted(glob.glob(os.path.join(directory, "mp_rank_*_model_states.pt"))):
            rank = int(os.path.basename(path)[8:10])
            for k, v in (load_file(path).get("module") or {}).items():
                shards.setdefault(k, {})[rank] = v
    full = {}
    for name, by_rank in shards.items():
        if not all(isinstance(v, torch.Tensor) for v in by_rank.values()):
            continue  # megatron-core's empty extra states
        parts = [by_rank[r] for r in sorted(by_rank)]
        full[name] = merge_tensor(tensor_kind(name, swiglu=swiglu), parts, vocab_size=vocab)
    return full


def _saved_config(directory: str) -> dict:
    files = sorted(glob.glob(os.path.join(directory, "mp_rank_*_model_states.pt")))
    if not files:
        raise CheckpointError(
            f"{directory} has no mp_rank_*_model_states.pt: not the earlier format"
        )
    return load_file(files[0], mmap=True)


def upgrade(source: str, target: str) -> None:
    """Write the checkpoint directory ``source`` (the earlier format) as ``target``."""
    check_checkpoint(source, f"upgrade {source}")
    first = _saved_config(source)
    config = first.get("config") or {}
    os.makedirs(target, exist_ok=True)
    if os.path.isdir(os.path.join(source, "portable")):
        index, tensors = _portable(source)
        order = [
            (f"{value}/{name}", lambda t=t, k=key: t[k])
            for name, t in tensors.items()
            for value, key in (("weight", "param"), *((m, m) for m in _MOMENTS))
            if key in t
        ]
        write_full_tensors(target, order)
        state = {
            "format": FORMAT,
            "iteration": int(index["iteration"]),
            "data": index.get("data"),
            "schedule": first.get("schedule"),
            "config": index.get("config") or config,
            "step": int(index["step"]),
            "layout": index["layout"],
            "vocab_size": int(index["vocab_size"]),
        }
        for path in glob.glob(os.path.join(source, "rng_rank*.pt")):
            shutil.copyfile(path, os.path.join(target, os.path.basename(path)))
    elif os.path.exists(os.path.join(source, WEIGHTS_ONLY)):
        full = _module_files(source, config)
        write_full_tensors(target, ((f"weight/{n}", lambda t=t: t) for n, t in full.items()))
        state = {"format": FORMAT, "iteration": 0, "config": config}
    else:
        raise CheckpointError(
            f"{source} has neither portable/ nor {WEIGHTS_ONLY}: a checkpoint of the earlier "
            "format always has one of them"
        )
    with open(os.path.join(target, TRAIN_STATE), "w") as f:
        json.dump(state, f, indent=1)
    for marker in (FROZEN_LM_EXCLUDED, WEIGHTS_ONLY):
        if os.path.exists(os.path.join(source, marker)):
            shutil.copyfile(os.path.join(source, marker), os.path.join(target, marker))
    mark_complete(target)


def main(argv=None) -> int:
    args = parse_args(argv)
    latest = latest_tag(args.load) if os.path.isdir(args.load) else None
    if latest is None:
        raise CheckpointError(f"{args.load}: no checkpoint there (no 'latest')")
    complete = [t for t in checkpoint_tags(args.load) if is_complete(os.path.join(args.load, t))]
    tags = complete if args.all else [latest]
    out = args.save or args.load
    for tag in tags:
        source = os.path.join(args.load, tag)
        if os.path.isdir(os.path.join(source, DIRECTORY)):
            print(f"{source}: already in the sharded format")
            continue
        if args.save:
            upgrade(source, os.path.join(out, tag))
        else:  # beside the old one, then swapped in
            fresh, old = f"{source}.upgrading", f"{source}.format1"
            shutil.rmtree(fresh, ignore_errors=True)
            upgrade(source, fresh)
            os.rename(source, old)
            os.rename(fresh, source)
            shutil.rmtree(old)
        print(f"upgraded {source} -> {os.path.join(out, tag)}")
    if args.save:
        for name in (CONFIG, CONFIG_YAML):
            if os.path.isfile(os.path.join(args.load, name)):
                shutil.copyfile(os.path.join(args.load, name), os.path.join(out, name))
        publish_latest(out, latest)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
