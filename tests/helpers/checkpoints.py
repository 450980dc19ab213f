"""Reading a saved checkpoint in tests, whatever layout wrote it: its global tensors
(``weight/{name}``, ``master/{name}``, ``exp_avg/{name}``, ``exp_avg_sq/{name}``), its training
state and each rank's RNG and task state file."""

from __future__ import annotations

import json
import os

import torch

from megatron_tempnet.checkpoint.checkpoint_format import TRAIN_STATE
from megatron_tempnet.checkpoint.checkpoint_writer import rank_file
from megatron_tempnet.checkpoint.file_io import load_file
from megatron_tempnet.checkpoint.shard_reading import load_full, saved_tensors


def checkpoint_path(save_dir, tag: str | None = None) -> str:
    """``save_dir``'s checkpoint ``tag`` (default: the one ``latest`` names)."""
    save_dir = str(save_dir)
    if tag is None:
        with open(os.path.join(save_dir, "latest")) as f:
            tag = f.read().strip()
    return os.path.join(save_dir, tag)


def global_tensors(save_dir, tag: str | None = None, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every global tensor whose name starts with ``prefix`` (``"weight/"``, ``"exp_avg/"``),
    whole, in its saved dtype."""
    path = checkpoint_path(save_dir, tag)
    saved = saved_tensors(path)
    return {f: load_full(path, f, s) for f, s in saved.items() if f.startswith(prefix)}


def weights(save_dir, tag: str | None = None, *, master: bool = True) -> dict[str, torch.Tensor]:
    """``{parameter name: full tensor}``: the float32 master where one was saved (``master``),
    else the weight as saved."""
    path = checkpoint_path(save_dir, tag)
    saved = saved_tensors(path)
    out = {}
    for fqn in saved:
        if fqn.startswith("weight/"):
            name = fqn.removeprefix("weight/")
            source = f"master/{name}" if master and f"master/{name}" in saved else fqn
            out[name] = load_full(path, source, saved[source])
    return out


def train_state(save_dir, tag: str | None = None) -> dict:
    with open(os.path.join(checkpoint_path(save_dir, tag), TRAIN_STATE)) as f:
        return json.load(f)


def rank_state(save_dir, rank: int, tag: str | None = None) -> dict:
    """Rank ``rank``'s RNG states and ``rank_state`` (its task state)."""
    return load_file(os.path.join(checkpoint_path(save_dir, tag), rank_file(rank)))


def stored_bytes(save_dir, tag: str | None = None) -> int:
    """The bytes of the checkpoint's tensor files (``shards/rank*.bin``)."""
    shards = os.path.join(checkpoint_path(save_dir, tag), "shards")
    return sum(
        os.path.getsize(os.path.join(shards, f)) for f in os.listdir(shards) if f.endswith(".bin")
    )
