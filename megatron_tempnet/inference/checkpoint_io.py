"""Reading and writing this project's checkpoints without building the model or a process group.

A checkpoint directory ``DIR`` has ``DIR/latest`` naming ``DIR/iter_XXXXXXX/``, which holds
DeepSpeed's files (``trainer.checkpoint_format``):

- pipeline parallelism 1: ``mp_rank_{t:02d}_model_states.pt`` per TP rank ``t``, the module's
  state under ``"module"`` (keys ``lm.pieces.{i}.…`` and ``tempnet.…``);
- pipeline parallelism > 1: ``layer_{i:02d}-model_{t:02d}-model_states.pt`` per model piece ``i``
  and TP rank (keys inside the piece), and ``mp_rank_{r:02d}_model_states.pt`` per stage x TP
  rank without the module.

Every ``mp_rank`` file carries the run's resolved config under ``"config"``. ``CheckpointReader``
gives full (TP-merged, vocabulary-unpadded) tensors under ``GPTStack``'s names one at a time,
from files opened with ``mmap`` so that nothing is read twice or held whole. A ZeRO-3 checkpoint
keeps no weights in those files: it is read from its layout-free copy (``trainer.portable``).
``write_checkpoint`` writes a weights-only checkpoint (marked ``WEIGHTS_ONLY``) for any TP x PP,
one file at a time, which ``pretrain_gpt.py`` loads with ``--load``, ``--finetune`` or
``--pretrained-checkpoint`` (at any layout).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable

import torch

from megatron_tempnet.distributed.sharding import merge, shard
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.trainer.checkpoint_format import (
    FROZEN_LM_EXCLUDED,
    WEIGHTS_ONLY,
    CheckpointError,
    checkpoint_dir,
    mark_complete,
    publish_latest,
    tag_for,
)
from megatron_tempnet.trainer.file_io import FileWriter, load_file
from megatron_tempnet.trainer.portable import PortableState, has_portable_state
from megatron_tempnet.utils.progress import progress

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
TEMPNET_PREFIX = "tempnet."


def _load(path: str) -> dict:
    return load_file(path, mmap=True)


def lm_names(model: ModelConfig) -> list[str]:
    """The LM's state-dict keys in ``GPTStack`` (``pieces.{i}.…``), in order."""
    bias = model.add_bias_linear
    norm = ["weight", "bias"] if model.normalization == "LayerNorm" else ["weight"]
    linear = ["weight", "bias", "_extra_state"] if bias else ["weight", "_extra_state"]
    names = ["pieces.0.word_embeddings.weight"]
    tied = not model.untie_embeddings_and_output_weights
    if tied:
        names.append("pieces.0.output_layer._extra_state")
    if model.position_embedding_type == "learned_absolute":
        names.append("pieces.1.position_embeddings.weight")
    for i in range(2, model.num_layers + 2):
        layer = f"pieces.{i}.layer."
        names += [layer + "input_layernorm." + n for n in norm]
        for part in ("self_attention.linear_proj", "self_attention.linear_qkv"):
            names += [f"{layer}{part}.{n}" for n in linear]
        names += [layer + "pre_mlp_layernorm." + n for n in norm]
        for part in ("mlp.linear_fc1", "mlp.linear_fc2"):
            names += [f"{layer}{part}.{n}" for n in linear]
    names += [f"pieces.{model.num_layers + 2}.norm.{n}" for n in norm]
    if not tied:
        last = model.num_layers + 3
        names += [f"pieces.{last}.output_layer.weight", f"pieces.{last}.output_layer._extra_state"]
    return names


class CheckpointReader:
    """The full tensors of a checkpoint of any TP x PP layout.

    ``model`` is the saved ``ModelConfig``, ``config`` the saved run config (a dict),
    ``tensor_parallel``/``pipeline`` the layout it was saved with. ``path``: the checkpoint's own
    directory (``load_dir``'s newest by default).
    """

    def __init__(self, load_dir: str, flag: str = "--load", *, path: str | None = None):
        self.path = path or checkpoint_dir(load_dir, flag)
        self.flag = f"{flag} {load_dir}"
        self.lm_excluded = os.path.exists(os.path.join(self.path, FROZEN_LM_EXCLUDED))
        self.portable = None
        if has_portable_state(self.path):
            state = PortableState(self.path)
            if state.layout.zero_stage == 3:  # the module files hold no weights
                self._read_portable(state)
                return
        layer_files = [f for f in os.listdir(self.path) if _LAYER_FILE.match(f)]
        self.pipeline = bool(layer_files)
        mp_files = sorted(glob.glob(os.path.join(self.path, "mp_rank_*_model_states.pt")))
        if not mp_files:
            raise CheckpointError(f"{self.flag}: {self.path} has no mp_rank_*_model_states.pt")
        first = _load(mp_files[0])
        self.config = first.get("config") or {}
        if "model" not in self.config:
            raise CheckpointError(f"{self.flag}: {mp_files[0]} carries no run config")
        self.model = ModelConfig(**self.config["model"])
        if self.pipeline:
            self.tensor_parallel = 1 + max(int(_LAYER_FILE.match(f).group(2)) for f in layer_files)
            self._states = self._pipeline_states()
        else:
            self.tensor_parallel = len(mp_files)
            modules = [first.get("module")] + [_load(f).get("module") for f in mp_files[1:]]
            if any(not m for m in modules):
                raise CheckpointError(
                    f"{self.flag}: {self.path} keeps its weights in ZeRO-3 partitions; convert "
                    "it with DeepSpeed's zero_to_fp32.py or save it again with --zero-stage < 3"
                )
            self._states = [{k.removeprefix("lm."): v for k, v in m.items()} for m in modules]

    def _read_portable(self, state: PortableState) -> None:
        self.portable = state
        self.config = state.index.get("config") or {}
        if "model" not in self.config:
            raise CheckpointError(f"{self.flag}: {self.path}'s portable state carries no config")
        self.model = ModelConfig(**self.config["model"])
        self.tensor_parallel = state.layout.tensor_parallel
        self.pipeline = state.layout.pipeline_parallel > 1
        self._states = [{_inner(n): None for n in state.names()}]

    def _pipeline_states(self) -> list[dict]:
        states: list[dict] = [{} for _ in range(self.tensor_parallel)]
        for name in sorted(os.listdir(self.path)):
            match = _LAYER_FILE.match(name)
            if match:
                index, rank = int(match.group(1)), int(match.group(2))
                prefix = "" if index == self._tempnet_index else f"pieces.{index}."
                for key, value in _load(os.path.join(self.path, name)).items():
                    states[rank][prefix + key] = value
        return states

    @property
    def _tempnet_index(self) -> int:
        return self.model.num_layers + 4  # after the output layer (a tied one has no file)

    def names(self) -> list[str]:
        return [k for k in self._states[0] if not k.endswith("_extra_state")]

    def has_lm(self) -> bool:
        return "pieces.0.word_embeddings.weight" in self._states[0]

    def has_tempnet(self) -> bool:
        return any(k.startswith(TEMPNET_PREFIX) for k in self._states[0])

    def full(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (merged over TP ranks, vocabulary unpadded)."""
        if name not in self._states[0]:
            raise CheckpointError(f"{self.flag}: {self.path} has no tensor {name!r}")
        if self.portable is not None:
            return self.portable.full(_outer(name))
        if name.startswith(TEMPNET_PREFIX):  # TempNet's state is TP-agnostic
            return self._states[0][name]
        shards = [s[name] for s in self._states]
        return merge(name, shards, swiglu=self.model.swiglu, vocab_size=self.model.vocab_size)

    def tempnet_state(self) -> dict[str, torch.Tensor]:
        """TempNet's parameters (keys without the ``tempnet.`` prefix)."""
        return {
            k.removeprefix(TEMPNET_PREFIX): self.full(k) if self.portable is not None else v
            for k, v in self._states[0].items()
            if k.startswith(TEMPNET_PREFIX)
        }


def _outer(name: str) -> str:
    """A ``GPTStack``/TempNet key as the training module names it (``lm.pieces.…``)."""
    return name if name.startswith(TEMPNET_PREFIX) else "lm." + name


def _inner(name: str) -> str:
    return name.removeprefix("lm.")


class LayoutFreeWeights:
    """A checkpoint's module files under the training module's names (``lm.pieces.…``,
    ``tempnet.…``, full tensors): the weights-only source ``trainer.resharding.restore`` reads
    for a conversion saved at another layout."""

    def __init__(self, directory: str):
        self.reader = CheckpointReader(os.path.dirname(directory), path=directory)
        self.tensor_parallel, self.pipeline = self.reader.tensor_parallel, self.reader.pipeline
        self._names = {_outer(n): n for n in self.reader.names()}

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def has(self, name: str, key: str) -> bool:
        return key == "param" and name in self._names

    def full(self, name: str, key: str = "param") -> torch.Tensor:
        return self.reader.full(self._names[name])

    def full_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.full(name).shape)


def write_checkpoint(
    save_dir: str,
    model: ModelConfig,
    full: Callable[[str], torch.Tensor],
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    config: dict | None = None,
    note: str = "",
) -> str:
    """Write the LM (``full(name)`` gives each full tensor) as a weights-only checkpoint.

    The files are written one at a time (PP = 1: one per TP rank; PP > 1: one per piece and TP
    rank); ``latest`` is written last. Returns the checkpoint's directory.
    """
    tp, pp = tensor_parallel, pipeline_parallel
    model.validate(tp)
    padded = model.padded_vocab_size(tp)
    tag = tag_for(0)
    out = os.path.join(save_dir, tag)
    os.makedirs(out, exist_ok=True)
    names = lm_names(model)

    def sharded(rank: int, keys: list[str]) -> dict:
        def one(k: str):
            if k.endswith("_extra_state"):
                return None
            return shard(k, full(k), rank, tp, swiglu=model.swiglu, padded_vocab=padded)

        return {k: one(k) for k in keys}

    run_config = dict(config or {}, model=model.__dict__.copy())
    if pp == 1:
        return write_module_checkpoint(
            save_dir,
            lambda rank: {"lm." + k: v for k, v in sharded(rank, names).items()},
            tensor_parallel=tp,
            config=run_config,
            note=note,
        )
    pieces = model.num_layers + 3 + model.untie_embeddings_and_output_weights
    with progress(f"writing {save_dir}", pieces * tp, unit="file") as bar:
        for index in range(pieces):
            keys = [n for n in names if n.startswith(f"pieces.{index}.")]
            for rank in range(tp):
                piece = {k.split(".", 2)[2]: v for k, v in sharded(rank, keys).items()}
                _save(piece, out, f"layer_{index:02d}-model_{rank:02d}-model_states.pt")
                bar.update(1)
    for rank in range(tp * pp):
        _save(_mp_state(None, tp * pp, run_config), out, f"mp_rank_{rank:02d}_model_states.pt")
    with open(os.path.join(out, WEIGHTS_ONLY), "w") as f:
        f.write(note or "Weights only: no optimizer, RNG or data position.\n")
    mark_complete(out)
    publish_latest(save_dir, tag)
    return out


def write_module_checkpoint(
    save_dir: str,
    module_of_rank: Callable[[int], dict],
    *,
    tensor_parallel: int,
    config: dict,
    note: str = "",
) -> str:
    """A weights-only checkpoint of a one-process model (PP = 1): ``module_of_rank(r)`` is TP
    rank ``r``'s state dict, written one rank at a time; ``latest`` last. Returns its directory."""
    tag = tag_for(0)
    out = os.path.join(save_dir, tag)
    os.makedirs(out, exist_ok=True)
    with progress(f"writing {save_dir}", tensor_parallel, unit="file") as bar:
        for rank in range(tensor_parallel):
            module = module_of_rank(rank)
            name = f"mp_rank_{rank:02d}_model_states.pt"
            _save(_mp_state(module, tensor_parallel, config), out, name)
            del module  # one rank's share in memory at a time
            bar.update(1)
    with open(os.path.join(out, WEIGHTS_ONLY), "w") as f:
        f.write(note or "Weights only: no optimizer, RNG or data position.\n")
    mark_complete(out)
    publish_latest(save_dir, tag)
    return out


def write_model_flags(save_dir: str, flags: list[str]) -> str:
    """``DIR/model_flags.txt``: the model flags that build a converted checkpoint's model."""
    line = " ".join(flags)
    with open(os.path.join(save_dir, "model_flags.txt"), "w") as f:
        f.write(line + "\n")
    return line


def _mp_state(module: dict | None, mp_world_size: int, config: dict) -> dict:
    """The engine file DeepSpeed reads for a module-only load (and our run config)."""
    return {
        "module": module,
        "buffer_names": [],
        "dp_world_size": 1,
        "mp_world_size": mp_world_size,
        "global_steps": 0,
        "skipped_steps": 0,
        "iteration": 0,
        "config": config,
    }


def _save(obj, directory: str, name: str) -> None:
    FileWriter().save(obj, os.path.join(directory, name))
