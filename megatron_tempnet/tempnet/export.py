"""TempNet on its own: ``tempnet.safetensors`` + ``tempnet_config.json`` in a directory.

The weights are the full network (``weight1 [d1, V]`` over the true vocabulary), whatever the
tensor-parallel size it was trained with. The JSON says how to use them::

    {"format": "megatron-tempnet/TempNetLM", "version": 1, "vocab_size": V, "d1": 256,
     "d2": 256, "tau0": 0.001, "tau_max": 2.0,
     "input_normalization": "l2", "input": "...", "trained_with": {...}}

``input_normalization: l2``: TempNet's input is the LM's logits over the first ``vocab_size``
tokens (padded columns dropped), divided by their L2 norm (docs/design.md §2).
"""

from __future__ import annotations

import json
import os

import torch

from megatron_tempnet.tempnet.llm import TempNetLM
from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.files import write_atomic

FORMAT = "megatron-tempnet/TempNetLM"
WEIGHTS, CONFIG = "tempnet.safetensors", "tempnet_config.json"
_INPUT = (
    "the language model's logits for the next token over the true vocabulary (the first "
    "vocab_size columns), divided by their L2 norm; tau = (tau_max - tau0) * sigmoid(s) + "
    "tau0; divide the logits by tau"
)


class TempNetFileError(UserError, ValueError):
    """An exported TempNet that cannot be used; names the path."""


def export_tempnet(
    state: dict[str, torch.Tensor],
    directory: str,
    *,
    tau_min: float,
    tau_max: float,
    trained_with: dict | None = None,
) -> dict:
    """Write ``state`` (``TempNetLM.state_dict()``) and its config to ``directory``."""
    from safetensors.torch import save_file

    d1, vocab = state["weight1"].shape
    config = {
        "format": FORMAT,
        "version": 1,
        "vocab_size": int(vocab),
        "d1": int(d1),
        "d2": int(state["weight2"].shape[0]),
        "tau0": tau_min,
        "tau_max": tau_max,
        "input_normalization": "l2",
        "input": _INPUT,
        "trained_with": trained_with or {},
    }
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    tmp = os.path.join(directory, WEIGHTS + ".partial")
    save_file(tensors, tmp, metadata={"format": FORMAT})
    os.replace(tmp, os.path.join(directory, WEIGHTS))
    write_atomic(os.path.join(directory, CONFIG), json.dumps(config, indent=2))
    return config


def read_tempnet_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS)):
        raise TempNetFileError(
            f"{directory}: not an exported TempNet (needs {CONFIG} and {WEIGHTS}; "
            "write one with tools/export_tempnet.py)"
        )
    with open(path) as f:
        config = json.load(f)
    if config.get("format") != FORMAT:
        raise TempNetFileError(f"{path}: format {config.get('format')!r}, expected {FORMAT!r}")
    return config


def load_tempnet(
    directory: str,
    *,
    padded_vocab_size: int | None = None,
    tp_group=None,
    tau_max_eval: float | None = None,
) -> TempNetLM:
    """The exported TempNet as a ``TempNetLM`` in eval mode (float32).

    ``padded_vocab_size`` and ``tp_group`` place it on vocabulary-parallel logits; by default it
    takes full ``[..., vocab_size]`` logits in one process.
    """
    from safetensors.torch import load_file

    config = read_tempnet_config(directory)
    tempnet = TempNetLM(
        config["vocab_size"],
        hidden_size=config["d1"],
        proj_size=config["d2"],
        tau_min=config["tau0"],
        tau_max=config["tau_max"],
        tp_group=tp_group,
        padded_vocab_size=padded_vocab_size,
    )
    state = load_file(os.path.join(directory, WEIGHTS))
    tempnet.load_state_dict({k: v.float() for k, v in state.items()})
    tempnet.tau_max_eval = tau_max_eval
    return tempnet.eval()
