"""A Megatron-LM checkpoint's tensors under ``GPTStack``'s names, full and unpadded, at any
layout; the same as a training run's starting weights."""

from __future__ import annotations

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.distributed.sharding import full_shape, merge, split_kind
from megatron_tempnet.models.gpt.config import SHAPE, STRUCTURE, ModelConfig
from megatron_tempnet.models.gpt.layers import PieceIndex
from megatron_tempnet.models.gpt.megatron_lm.rank_files import (
    DeepSpeedFiles,
    LegacyFiles,
    mcore_names,
)
from megatron_tempnet.models.gpt.megatron_lm.saved import (
    DEEPSPEED,
    TORCH_DIST,
    Located,
    locate,
    model_fields,
    saved_args,
    tokenizer_spec,
    vocabulary,
)
from megatron_tempnet.models.gpt.state_names import lm_names

_MODEL_ROOTS = ("embedding", "decoder", "output_layer")
"""The first name part of a ``GPTModel`` tensor (the optimizer's and others' are not)."""


class MegatronLMCheckpoint:
    """The full tensors of a Megatron-LM checkpoint under ``GPTStack``'s names.

    ``vocab_size``: the true vocabulary (its tokenizer's); the checkpoint's padded rows are
    dropped. ``model``: the ``ModelConfig`` its saved args describe, with that vocabulary.
    """

    def __init__(self, located: Located, source: str, vocab_size: int):
        self.located, self.source = located, source
        self.path = located.directory
        self._torch_dist = located.format == TORCH_DIST
        self.args = saved_args(located, source)
        fields = model_fields(self.args, source)
        self.model = ModelConfig(**fields, vocab_size=vocab_size)
        self.tp = int(getattr(self.args, "tensor_model_parallel_size", 1) or 1)
        self.pp = int(getattr(self.args, "pipeline_model_parallel_size", 1) or 1)
        self._at = PieceIndex(self.model.num_layers)
        if self._torch_dist:
            from torch.distributed.checkpoint import FileSystemReader

            self._saved = FileSystemReader(self.path).read_metadata().state_dict_metadata
        else:
            files = DeepSpeedFiles if located.format == DEEPSPEED else LegacyFiles
            self._files = files(self.path, source, self.args, self._at, self.tp, self.pp)
        self.config = {"model": self.model.__dict__.copy(), "tokenizer": tokenizer_spec(self.args)}

    def has_lm(self) -> bool:
        return True

    def has_tempnet(self) -> bool:
        return False

    def tempnet_state(self) -> dict[str, torch.Tensor]:
        return {}

    @property
    def description(self) -> str:
        return (
            f"a Megatron-LM {self.located.format} checkpoint ({self.path}, iteration "
            f"{self.located.iteration}, saved at TP {self.tp} x PP {self.pp})"
        )

    # ------------------------------------------------------------- names and shapes

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The full (unpadded) shape of ``name``; None when the checkpoint lacks it."""
        found = self._find(name)
        if found is None:
            return None
        if self._torch_dist:
            key, layer = found
            shape = tuple(self._saved[key].size)[0 if layer is None else 1 :]
        else:
            shard = self._files.shard(found, 0)
            kind = split_kind(name)
            shape = full_shape(kind, shard.shape, self.tp, vocab_size=self.model.vocab_size)
        if split_kind(name) == "vocab":
            shape = (self.model.vocab_size, *shape[1:])
        return shape

    def shapes(self, wanted: list[str]) -> dict[str, tuple[int, ...]]:
        """The shapes of ``wanted``'s names that the checkpoint holds."""
        shapes = {n: self.shape(n) for n in wanted}
        return {n: s for n, s in shapes.items() if s is not None}

    def names(self) -> list[str]:
        """``GPTStack``'s names of the tensors it holds, in order."""
        every = [n for n in lm_names(self.model) if not n.endswith("_extra_state")]
        return [n for n in every if self._find(n) is not None]

    def stray(self, wanted: list[str]) -> list[str]:
        """The checkpoint's model tensors that none of ``wanted`` reads (a bias this model
        lacks, say), under megatron-core's names."""
        tied = not self.model.untie_embeddings_and_output_weights
        if self._torch_dist:
            read = {found[0] for found in map(self._find, wanted) if found is not None}
            saved = {k for k, v in self._saved.items() if hasattr(v, "size")}
            model = {k for k in saved if k.split(".")[0] in _MODEL_ROOTS}
        else:
            read = {self._files.key(f) for f in map(self._find, wanted) if f is not None}
            read |= {self._files.tied_output} if tied and self._files.tied_output else set()
            model = self._files.keys()
        return sorted(model - read)

    def _find(self, name: str):
        if not self._torch_dist:
            return self._files.find(name)
        names, layer = mcore_names(name, self._at)
        for n in names:
            if layer is not None and f"decoder.layers.{layer}.{n}" in self._saved:
                return f"decoder.layers.{layer}.{n}", None
            key = n if layer is None else f"decoder.layers.{n}"
            if key in self._saved and hasattr(self._saved[key], "size"):
                return key, layer
        return None

    # ------------------------------------------------------------- tensors

    def full(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (vocabulary unpadded), in its saved dtype."""
        found = self._find(name)
        if found is None:
            raise CheckpointError(f"{self.source}: {self.path} has no tensor for {name}")
        if self._torch_dist:
            tensor = self._read_dist(*found)
        else:
            shards = [self._files.shard(found, t) for t in range(self.tp)]
            tensor = merge(name, shards, swiglu=self.model.swiglu, vocab_size=self.model.vocab_size)
        if split_kind(name) == "vocab":
            if tensor.shape[0] < self.model.vocab_size:
                raise CheckpointError(
                    f"{self.source}: {name} has {tensor.shape[0]} rows, fewer than the "
                    f"tokenizer's {self.model.vocab_size} ids: another tokenizer trained it"
                )
            tensor = tensor[: self.model.vocab_size]
        return tensor.contiguous()

    def _read_dist(self, key: str, layer: int | None) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.api import CheckpointException

        from megatron_tempnet.checkpoint.shard_reading import BoxLoadPlanner
        from megatron_tempnet.checkpoint.shard_storage import (
            Box,
            first_failure,
            single_process_quiet,
        )

        saved = self._saved[key]
        size = tuple(saved.size)
        shape = size if layer is None else (1, *size[1:])
        out = torch.empty(shape, dtype=saved.properties.dtype)
        offsets = (0,) * len(size) if layer is None else (layer,) + (0,) * (len(size) - 1)
        box = Box(key, size, offsets, out)
        try:
            with single_process_quiet():
                dcp.load(
                    {},
                    storage_reader=FileSystemReader(self.path),
                    planner=BoxLoadPlanner([box]),
                    no_dist=True,
                )
        except CheckpointException as e:
            raise CheckpointError(f"{self.source}: {key}: {first_failure(e)}") from None
        return out if layer is None else out[0]


def open_checkpoint(path: str, source: str, vocab_size: int | None = None):
    """The Megatron-LM checkpoint in ``path`` (None when it holds none), its vocabulary
    ``vocab_size`` (default: its saved tokenizer's)."""
    located = locate(path, source)
    if located is None:
        return None
    if vocab_size is None:
        vocab_size = vocabulary(saved_args(located, source), source)
    return MegatronLMCheckpoint(located, source, vocab_size)


class TrainingWeights:
    """A Megatron-LM checkpoint as ``trainer.task.ForeignCheckpoint``: the LM's parameters
    under the training module's names (``GPTStack``'s behind ``prefix``)."""

    def __init__(self, checkpoint: MegatronLMCheckpoint, prefix: str):
        self.checkpoint, self.prefix = checkpoint, prefix
        self.path, self.description = checkpoint.path, checkpoint.description

    def _lm(self, names: list[str]) -> list[str]:
        return [n.removeprefix(self.prefix) for n in names if n.startswith(self.prefix)]

    def shapes(self, names: list[str]) -> dict[str, tuple[int, ...]]:
        found = self.checkpoint.shapes(self._lm(names))
        return {self.prefix + n: shape for n, shape in found.items()}

    def stray(self, names: list[str]) -> list[str]:
        return self.checkpoint.stray(self._lm(names))

    def full(self, name: str) -> torch.Tensor:
        return self.checkpoint.full(name.removeprefix(self.prefix))


_SAME_MODEL = SHAPE[:4] + tuple(
    n for n in STRUCTURE if n not in ("vocab_size", "make_vocab_size_divisible_by", "hf_model_type")
)
"""What the weights' shapes and meaning depend on (``--use-checkpoint-args``' sizes but the
sequence length, and its structure but the vocabulary, which is the tokenizer's): a run reading
the checkpoint has its values."""


def check_same_model(saved: ModelConfig, run: ModelConfig, source: str) -> None:
    """The run's model computes what the checkpoint's did (a RoPE base or a norm epsilon
    differs without changing a shape: loading would be silently another model)."""
    for name in _SAME_MODEL:
        mine, theirs = getattr(run, name), getattr(saved, name)
        if name == "num_query_groups":  # None: one group per head
            mine = mine or run.num_attention_heads
            theirs = theirs or saved.num_attention_heads
        if mine != theirs:
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"{source}: the checkpoint's model has {flag} {theirs}, this run {mine}: give "
                f"{flag} {theirs}, or --use-checkpoint-args to take the model from it"
            )
