"""A model of this project written as a Megatron-LM torch_dist checkpoint.

The layout megatron-core's ``dist_checkpointing`` writes for ``GPTModel`` (``megatron_lm``
reads it): ``DIR/latest_checkpointed_iteration.txt`` naming ``DIR/release/`` (Megatron-LM's tag
of a converted checkpoint: ``--finetune`` starts at iteration 0), which holds the LM's tensors
under megatron-core's names in ``torch.distributed.checkpoint`` files (the layers stacked on a
leading axis, the norms under Transformer Engine's fused names, as both layer specs save them;
each linear's ``_extra_state`` an empty object), ``common.pt`` with Megatron-LM's ``args`` for the
model, and ``metadata.json``. The vocabulary is padded as Megatron-LM pads it for the TP size it
will load at (``--make-vocab-size-divisible-by`` x TP; zero rows). One process writes it, one
layer's tensor at a time; no CUDA, no process group.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemWriter, Metadata, SavePlan, SavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.checkpoint.file_io import FileWriter
from megatron_tempnet.distributed.sharding import split_kind
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.layers import PieceIndex
from megatron_tempnet.models.gpt.megatron_lm.rank_files import mcore_names
from megatron_tempnet.models.gpt.megatron_lm.saved import TRACKER

RELEASE = "release"
_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
"""The linears of a layer, each with an ``_extra_state`` megatron-core saves and loads."""


@dataclass(frozen=True)
class _Part:
    """One write: ``fqn``'s chunk at ``offsets`` of ``shape``; ``load`` gives its data (a
    tensor, or the bytes of an object)."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    load: Callable[[], object]

    @property
    def is_bytes(self) -> bool:
        return self.dtype is None


def megatron_name(name: str, at: PieceIndex) -> tuple[str, int | None]:
    """megatron-core's torch_dist name of ``GPTStack``'s ``name`` and its layer (stacked): the
    norms under the names both layer specs save them by (Transformer Engine's)."""
    names, layer = mcore_names(name, at)
    return (names[0], None) if layer is None else ("decoder.layers." + names[-1], layer)


def parts(
    model: ModelConfig, names: list[str], full: Callable[[str], torch.Tensor], padded_vocab: int
) -> list[_Part]:
    """What the export writes: every LM tensor (its layer's chunk of the stacked tensor) and
    every layer's ``_extra_state`` objects."""
    at, layers, out = PieceIndex(model.num_layers), model.num_layers, []
    shapes = {}
    for name in names:
        key, layer = megatron_name(name, at)
        if key not in shapes:  # one layer's tensor gives the stack's shape and dtype
            tensor = full(name)
            shapes[key] = tuple(tensor.shape), tensor.dtype
        shape, dtype = shapes[key]
        if split_kind(name) == "vocab":
            shape = (padded_vocab, *shape[1:])
        load = (
            _padded(full, name, padded_vocab) if split_kind(name) == "vocab" else _one(full, name)
        )
        if layer is None:
            out.append(_Part(key, shape, (0,) * len(shape), shape, dtype, load))
        else:
            offsets = (layer,) + (0,) * len(shape)
            out.append(_Part(key, (layers, *shape), offsets, (1, *shape), dtype, load))
    for layer in range(layers):
        for linear in _LINEARS:
            key = f"decoder.layers.{linear}._extra_state/shard_{layer}_{layers}"
            out.append(_Part(key, (), (), (), None, _empty_extra_state))
    return out


def _one(full, name):
    return lambda: full(name)


def _padded(full, name, rows: int):
    def load() -> torch.Tensor:
        tensor = full(name)
        out = tensor.new_zeros(rows, *tensor.shape[1:])
        out[: tensor.shape[0]] = tensor
        return out

    return load


def _empty_extra_state() -> io.BytesIO:
    """An ``_extra_state`` as megatron-core saves a ``ShardedObject``: its data in a list."""
    data = io.BytesIO()
    torch.save([None], data)
    data.seek(0)
    return data


class _PartsSavePlanner(SavePlanner):
    """Plans a one-process save of ``parts``, each loaded only when it is written."""

    def __init__(self, items: list[_Part]):
        self.parts = {(p.fqn, p.offsets): p for p in items}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.parts.values():
            index = MetadataIndex(p.fqn, torch.Size(p.offsets) if not p.is_bytes else None)
            if p.is_bytes:
                items.append(WriteItem(index, WriteItemType.BYTE_IO))
                continue
            chunk = ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.shape))
            data = TensorWriteData(
                chunk, TensorProperties(dtype=p.dtype), torch.Size(p.global_shape)
            )
            items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=data))
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        offsets = tuple(index.offset) if index.offset is not None else ()
        data = self.parts[(index.fqn, offsets)].load()
        if isinstance(data, torch.Tensor) and write_item.tensor_data is not None:
            want = tuple(write_item.tensor_data.chunk.sizes)
            data = data.reshape(want)
        return data


def megatron_args(
    model: ModelConfig, *, tp: int, pp: int, padded_vocab: int, tokenizer: dict | None
) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves for ``model`` (its model flags, layout and tokenizer),
    as ``--use-checkpoint-args`` reads them there."""
    heads = model.num_attention_heads
    fields = {
        name: getattr(model, name)
        for name in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "seq_length", "max_position_embeddings", "position_embedding_type", "rotary_base",
            "use_rope_scaling", "rope_scaling_factor", "normalization", "norm_epsilon",
            "apply_layernorm_1p", "swiglu", "openai_gelu", "add_bias_linear",
            "untie_embeddings_and_output_weights", "hidden_dropout", "attention_dropout",
            "init_method_std", "make_vocab_size_divisible_by",
        )
    }  # fmt: skip
    fields.update(
        group_query_attention=model.num_query_groups not in (None, heads),
        num_query_groups=model.num_query_groups or heads,
        kv_channels=model.hidden_size // heads,
        add_qkv_bias=False,  # a bias on q/k/v alone; add_bias_linear gives theirs
        rotary_percent=1.0,
        rotary_interleaved=False,
        padded_vocab_size=padded_vocab,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        transformer_impl="local",
        ckpt_format="torch_dist",
        iteration=0,
    )
    fields.update(tokenizer or {})
    return argparse.Namespace(**fields)


def write_torch_dist(
    save_dir: str,
    model: ModelConfig,
    names: list[str],
    full: Callable[[str], torch.Tensor],
    args: argparse.Namespace,
) -> str:
    """Write the LM (``full(name)`` gives each of ``names``' full tensors) as Megatron-LM's
    torch_dist checkpoint in ``save_dir``; returns the checkpoint's directory."""
    import torch.distributed.checkpoint as dcp

    from megatron_tempnet.checkpoint.shard_storage import single_process_quiet

    out = os.path.join(save_dir, RELEASE)
    os.makedirs(out, exist_ok=True)
    items = parts(model, names, full, args.padded_vocab_size)
    writer = FileSystemWriter(out, single_file_per_rank=True, thread_count=1)
    try:
        with single_process_quiet():
            dcp.save({}, storage_writer=writer, planner=_PartsSavePlanner(items), no_dist=True)
    except Exception as e:  # DCP wraps every failure in its own exception type
        raise CheckpointError(f"cannot write {out}: {str(e).splitlines()[0]}") from None
    files = FileWriter()
    files.save({"args": args, "checkpoint_version": 3.0, "iteration": 0}, f"{out}/common.pt")
    metadata = {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    files.write_text(os.path.join(out, "metadata.json"), json.dumps(metadata))
    files.write_text(os.path.join(save_dir, TRACKER), RELEASE)
    return out
