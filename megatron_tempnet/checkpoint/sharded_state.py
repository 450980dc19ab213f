"""Each rank's share of the training state, as boxes of layout-free global tensors.

Every parameter has one *global tensor* per kind of value, named by the parameter's
layout-free name (the one-process model's, ``lm.pieces.3.mlp.linear_fc1.weight``) and shaped
as its full tensor (``distributed.sharding``: the vocabulary unpadded, SwiGLU's fc1 as
``[gate; up]``):

    weight/{name}      the weight in the run's dtype (bf16, or the float32 master itself)
    master/{name}      the float32 master, where the weight is not float32
    exp_avg/{name}     AdamW's first moment (trained parameters)
    exp_avg_sq/{name}  AdamW's second moment

A rank holds a tensor-parallel shard of each parameter of its pipeline stage, and of that
shard a flat range: ZeRO 1-2's fragment of the master and moments (DeepSpeed's fragment
address: start and length in the flattened shard), ZeRO-3's partition, or all of it. A flat
range of a shard is a few boxes of the global tensor (``_flat_boxes``: a partial row, whole
rows, a partial row, recursively), and so is every shard (``_Placement``: its offset in the
global tensor; SwiGLU's gate and up halves are two). So:

- **save**: each value is written by one rank only: ZeRO 1-2's fragment owners write the master,
  the moments and the same range of the weight; ZeRO-3 ranks their partitions; the rest (ZeRO
  0, frozen parameters) is split evenly over the data-parallel ranks. Nothing is gathered. A
  tied parameter's second pipeline copy is not written.
- **load**: each rank asks for what it holds (the whole shard of a weight it keeps whole, its
  fragment of the master and moments) at whatever layout it runs: the boxes are filled in
  place, from whichever saved boxes they overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet import compat
from megatron_tempnet.checkpoint.shard_storage import Box
from megatron_tempnet.distributed.groups import compute_device, vocab_partition
from megatron_tempnet.distributed.sharding import TensorLayout, parameter_kind

MOMENTS = ("exp_avg", "exp_avg_sq")
WEIGHT, MASTER = "weight", "master"


def key(value: str, name: str) -> str:
    """The global tensor of ``value`` (``weight``, ``master``, a moment) of parameter ``name``."""
    return f"{value}/{name}"


def layout_free_parameters(module) -> list[tuple[str, torch.nn.Parameter]]:
    """The module's parameters under the names they have in the one-process model (a pipeline
    stage's tied copies on the later stage included: they load, they are not saved)."""
    if hasattr(module, "layout_free_parameters"):  # a pipeline stage
        return module.layout_free_parameters()
    return list(module.named_parameters())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, tuple, tuple]]:
    """The flat range ``[a, b)`` of a row-major tensor of ``shape`` as boxes, each contiguous:
    ``(flat start, offsets, sizes)`` in order."""
    if a >= b:
        return []
    if len(shape) == 1:
        return [(a, (a,), (b - a,))]
    inner = _prod(shape[1:])
    boxes = []
    if a % inner:  # a partial first row
        row, end = a // inner, min(b, (a // inner + 1) * inner)
        for start, off, size in _flat_boxes(shape[1:], a - row * inner, end - row * inner):
            boxes.append((row * inner + start, (row, *off), (1, *size)))
        a = end
    if b - a >= inner:  # whole rows
        rows = (b - a) // inner
        boxes.append((a, (a // inner,) + (0,) * (len(shape) - 1), (rows, *shape[1:])))
        a += rows * inner
    if a < b:  # a partial last row
        row = a // inner
        for start, off, size in _flat_boxes(shape[1:], 0, b - row * inner):
            boxes.append((row * inner + start, (row, *off), (1, *size)))
    return boxes


@dataclass(frozen=True)
class _Placement:
    """Where this rank's tensor-parallel shard of a parameter lies in its global tensor."""

    global_shape: tuple[int, ...]
    view: tuple[int, ...]
    """The shard's true part (vocabulary padding left out) as the view ``_global`` maps."""
    origin: tuple[int, ...]
    gated: bool = False

    @property
    def numel(self) -> int:
        return _prod(self.view)

    def boxes(self, a: int, b: int) -> list[tuple[int, tuple, tuple]]:
        """The flat range ``[a, b)`` of the shard (clipped to its true part) as global boxes."""
        result = []
        for start, off, size in _flat_boxes(self.view, a, min(b, self.numel)):
            if not self.gated:
                result.append((start, tuple(o + g for o, g in zip(off, self.origin)), size))
                continue
            # view [2, rows, ...]: each half is its own box in the global [gate; up]
            half = self.view[1] * _prod(self.view[2:])
            rows = self.global_shape[0] // 2
            for i in range(off[0], off[0] + size[0]):
                first = off[1] + self.origin[0] + i * rows
                result.append((start + (i - off[0]) * half, (first, *off[2:]), size[1:]))
        return result


def placement(
    kind: str, shape: tuple[int, ...], layout: TensorLayout, rank: int, tp: int
) -> _Placement:
    """The placement of TP rank ``rank``'s shard (``shape``) of a parameter of ``kind``."""
    shape = tuple(shape) or (1,)  # a 0-d parameter is saved as one element
    zeros = (0,) * len(shape)
    if kind == "vocab":
        rows, vocab = shape[0], layout.vocab_size
        true = max(0, min(rows, vocab - rank * rows))
        return _Placement((vocab, *shape[1:]), (true, *shape[1:]), (rank * rows, *zeros[1:]))
    if kind == "vocab_columns":
        part = vocab_partition(layout.padded_vocab_size // tp, rank, layout.vocab_size)
        return _Placement((shape[0], layout.vocab_size), shape, (0, part.start))
    if kind == "row":
        return _Placement((shape[0], shape[1] * tp, *shape[2:]), shape, (0, rank * shape[1]))
    if kind == "column":
        return _Placement((shape[0] * tp, *shape[1:]), shape, (rank * shape[0], *zeros[1:]))
    if kind == "gated":
        half = shape[0] // 2
        view = (2, half, *shape[1:])
        return _Placement((shape[0] * tp, *shape[1:]), view, (rank * half,), gated=True)
    return _Placement(shape, shape, zeros)


@dataclass
class _Range:
    """A flat range of one value of a parameter's shard that this rank writes or fills:
    ``flat`` holds elements ``[start, start + flat.numel())`` of the flattened shard."""

    value: str
    start: int
    flat: torch.Tensor


def _even_split(numel: int) -> tuple[int, int]:
    """This data-parallel rank's share of a value every data-parallel rank holds whole."""
    rank = parallel_state.get_data_parallel_rank()
    size = parallel_state.get_data_parallel_world_size()
    return numel * rank // size, numel * (rank + 1) // size


def _ranges(engine, param, *, saving: bool, moments: bool) -> list[_Range]:
    """What this rank writes of the parameter (``saving``: each value written by one rank) or
    fills on a load (all it holds); ``moments``: AdamW's too (its state exists)."""
    trained = param.requires_grad
    moment_names = MOMENTS if moments else ()
    master_needed = not saving or param.dtype != torch.float32
    if compat.zero3_shape(param) is not None:  # ZeRO-3: the partition of everything
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        start, n = compat.zero3_range(param)
        ranges = [_Range(WEIGHT, start, compat.zero3_partition(param)[:n])]
        if trained:
            if master_needed:
                ranges.append(_Range(MASTER, start, safe_get_local_fp32_param(param)[:n]))
            for m in moment_names:
                ranges.append(_Range(m, start, safe_get_local_optimizer_state(param, m)[:n]))
        return ranges
    weight = param.data.view(-1)
    if trained and compat.has_fragment_mapping(param):  # ZeRO 1-2, bf16: the fragment
        start, n = compat.fragment_range(param)
        held = [
            _Range(WEIGHT, start, weight[start : start + n])
            if saving
            else _Range(WEIGHT, 0, weight)
        ]
        if n and master_needed:
            held.append(_Range(MASTER, start, compat.fragment_master(param)))
        if n:
            held += [_Range(m, start, compat.fragment_state(param, m)) for m in moment_names]
        return held
    # ZeRO 0 and frozen parameters: every data-parallel rank holds all of it
    start, end = _even_split(weight.numel()) if saving else (0, weight.numel())
    ranges = [_Range(WEIGHT, start, weight[start:end])]
    if trained:
        state = compat.base_optimizer(engine.optimizer).state.get(param, {})
        for m in moment_names:
            moment = state[m] if m in state else torch.zeros_like(param)
            ranges.append(_Range(m, start, moment.view(-1)[start:end]))
    return ranges


def _share(place: _Placement, rank: int, tp: int) -> tuple[int, int]:
    return place.numel * rank // tp, place.numel * (rank + 1) // tp


def _shape(param) -> tuple[int, ...]:
    return tuple(compat.zero3_shape(param) or param.shape)


@dataclass
class ParamBoxes:
    """One parameter's boxes on this rank: by value (``weight``, ``master``, moments)."""

    name: str
    param: torch.nn.Parameter
    global_shape: tuple[int, ...]
    boxes: dict[str, list[Box]]


def parameter_boxes(
    engine, layout: TensorLayout, *, saving: bool, skip_frozen: bool, moments: bool
) -> list[ParamBoxes]:
    """This rank's boxes of every parameter of its stage (``saving``: those it writes; else
    those it fills). ``skip_frozen``: leave the parameters that do not train out;
    ``moments``: AdamW's moments too (the optimizer has its state)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    result = []
    for name, param in layout_free_parameters(engine.module):
        if (skip_frozen and not param.requires_grad) or (
            saving and compat.is_pipe_replicated(param)
        ):
            continue
        kind = parameter_kind(name, param, swiglu=layout.swiglu)
        place = placement(kind, _shape(param), layout, rank, tp)
        # a replicated parameter is the same on every TP rank: each writes its share
        low, high = (
            (0, place.numel) if not saving or kind != "replicated" else _share(place, rank, tp)
        )
        boxes: dict[str, list[Box]] = {}
        for r in _ranges(engine, param, saving=saving, moments=moments):
            a, b = max(low, r.start), min(high, r.start + r.flat.numel())
            for start, offsets, sizes in place.boxes(a, b):
                first = start - r.start
                tensor = r.flat[first : first + _prod(sizes)].view(sizes)
                boxes.setdefault(r.value, []).append(
                    Box(key(r.value, name), place.global_shape, offsets, tensor)
                )
        result.append(ParamBoxes(name, param, place.global_shape, boxes))
    return result


def optimizer_step(engine) -> int:
    """AdamW's step count (collective: a stage without trained parameters has none)."""
    states = compat.base_optimizer(engine.optimizer).state.values()
    local = max((float(s["step"]) for s in states if "step" in s), default=0.0)
    # on the compute device: NCCL reduces device tensors only
    step = torch.full((1,), local, dtype=torch.float64, device=compute_device())
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return int(step.item())


def prepare_optimizer_states(engine, step: int) -> None:
    """AdamW's state for every tensor it steps, at ``step``: created (zero moments) where the
    engine has none yet (before its first step), then mapped by DeepSpeed's wrappers."""
    base = compat.base_optimizer(engine.optimizer)
    on_device = base.defaults.get("fused") or base.defaults.get("capturable")
    for tensor in compat.optimizer_tensors(engine.optimizer):
        state = base.state[tensor]
        for m in MOMENTS:
            if m not in state:
                state[m] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
        # PyTorch's AdamW keeps the step as a float32 tensor (on the device when fused)
        device = tensor.device if on_device else None
        state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
    compat.link_optimizer_states(engine.optimizer)
