"""CLIP pipeline parallelism (--pipeline-model-parallel-size > 1) on DeepSpeed's pipeline engine.

The two towers travel together: the activation between stages is ``(vision [s, b, h_v], text
[L, b, h_t], lengths [b])``. The first stage holds both embeddings; the towers' layers are
interleaved in proportion (``v0 t0 v1 t1 ...`` for equal depths) and cut into stages with an equal
number of layers, so every stage carries its share of each tower; the last stage holds both final
norms and projections, the temperature (TempNet, TaU's heads, CLIP's global tau) and the loss.
Every piece is built right after ``seed_rngs(seed + its index in the one-process model)``, so the
weights are the one-process model's.

The per-sample state lives on the last stage's data-parallel ranks: the loss function
(``PipelineObjective``) fetches each micro-batch's rows, computes ``CLIPOutput`` and stores the
new rows, micro-batch by micro-batch in the schedule's order.

Outside the engine's schedule (TempNet's prototypes at start-up, evaluation), ``relay`` passes a
batch through the stages with point-to-point messages and hands the last stage's result to every
stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from megatron_tempnet import compat
from megatron_tempnet.models.clip.config import CLIPLossConfig, CLIPModelConfig
from megatron_tempnet.models.clip.objective import ContrastiveHead
from megatron_tempnet.models.clip.sample_state import ShardedSampleState
from megatron_tempnet.models.clip.step import ContrastiveStatistics, unpack_batch
from megatron_tempnet.models.clip.towers import (
    build_piece,
    image_pooled,
    piece_builders,
    text_pooled,
)
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.models.transformer import seed_rngs
from megatron_tempnet.trainer.pipeline import NormRecorder, Pipeline, train_through_schedule
from megatron_tempnet.trainer.stats import StepStats
from megatron_tempnet.trainer.step import compute_device
from megatron_tempnet.utils.precision import to_training_dtype

ONE_PROCESS = "clip.pieces."  # ``CLIPTrainModule``'s names of the towers' pieces


class CLIPEmbeddings(nn.Module):
    """The first piece: ``(images, tokens, lengths)`` -> ``(vision, text, lengths)``."""

    def __init__(self, builders: list, seed: int, dtype: torch.dtype):
        super().__init__()
        self.vision_embedding = build_piece(builders, "vision_embedding", seed, dtype)
        self.text_embedding = build_piece(builders, "text_embedding", seed, dtype)

    def forward(self, x):
        images, tokens, lengths = x
        vision = None if images is None else self.vision_embedding(images)
        text = None if tokens is None else self.text_embedding(tokens)
        return vision, text, lengths


class TowerLayer(nn.Module):
    """One tower's transformer layer; the other tower's stream passes through."""

    def __init__(self, builders: list, name: str, seed: int, dtype: torch.dtype):
        super().__init__()
        self.tower = name.split("_")[0]  # vision or text
        self.piece_name = name
        self.layer = build_piece(builders, name, seed, dtype)

    def forward(self, x):
        vision, text, lengths = x
        if self.tower == "vision" and vision is not None:
            vision = self.layer(vision)
        elif self.tower == "text" and text is not None:
            text = self.layer(text)
        return vision, text, lengths


class CLIPHead(ContrastiveHead, nn.Module):
    """The last piece: ``(vision, text, lengths)`` -> the features ``(image [b, d], text [b, d])``
    (the loss function normalises them); the temperature's parameters are its own."""

    TOWER_PARTS = ("vision_norm", "vision_projection", "text_norm", "text_projection")

    def __init__(self, builders: list, seed: int, dtype: torch.dtype, loss: CLIPLossConfig,
                 embed_dim: int):  # fmt: skip
        nn.Module.__init__(self)
        for name in self.TOWER_PARTS:
            self.add_module(name, build_piece(builders, name, seed, dtype))
        seed_rngs(seed + len(builders))  # as CLIPTrainModule after the towers
        self.init_temperature(loss, embed_dim)

    def features(self, x) -> dict[str, torch.Tensor]:
        vision, text, lengths = x
        out = {}
        if vision is not None:
            out["image"] = image_pooled(self.vision_norm, self.vision_projection, vision)
        if text is not None:
            out["text"] = text_pooled(self.text_norm, self.text_projection, text, lengths)
        return out

    def forward(self, x):
        f = self.features(x)
        return f["image"], f["text"]


def interleaved(model: CLIPModelConfig) -> list[str]:
    """The towers' layer names in proportion: layer ``i`` of a tower of ``n`` sits at
    ``(i + 1/2) / n`` (vision first on a tie)."""
    keys = [((i + 0.5) / model.vision_layers, 0, f"vision_layer{i}")
            for i in range(model.vision_layers)]  # fmt: skip
    keys += [((i + 0.5) / model.text_layers, 1, f"text_layer{i}") for i in range(model.text_layers)]
    return [name for _, _, name in sorted(keys)]


class PipelineObjective:
    """``loss_fn(features, indices)`` on the last stage: this micro-batch's ``CLIPOutput`` with
    its per-sample state, and its share of the iteration's mean over ``2 B`` anchors, scaled by
    the data-parallel size x accumulation steps (DeepSpeed divides by both)."""

    def __init__(self, sample_state: ShardedSampleState | None):
        self.sample_state = sample_state
        self.head: CLIPHead | None = None  # the stage's last piece, once built
        self.anchors, self.scale = 1.0, 1.0
        self.stats = ContrastiveStatistics()

    def start_step(self, anchors: float, scale: float) -> None:
        self.anchors, self.scale = anchors, scale
        self.stats = ContrastiveStatistics()

    def __call__(self, features, indices):
        state = seen = None
        if self.sample_state is not None:  # the indices were checked on the host
            state, seen = self.sample_state.fetch(indices, checked=True)
        out = self.head.contrastive(*features, state, seen)
        if self.sample_state is not None:
            self.sample_state.store(indices, out.state, checked=True)
        self.stats.add(out)
        return out.loss.sum() / self.anchors * self.scale


class CLIPPipeline(Pipeline):
    """This rank's stage; ``layout_free_parameters`` names the parameters as ``CLIPTrainModule``
    does."""

    def layout_free_parameters(self) -> list[tuple[str, nn.Parameter]]:
        named = []
        for index, piece in self.named_children():
            if not index.isdigit():
                continue
            for name, param in piece.named_parameters():
                child, _, rest = name.partition(".")
                if isinstance(piece, TowerLayer):
                    named.append((f"{ONE_PROCESS}{piece.piece_name}.{rest}", param))
                elif child in ("vision_embedding", "text_embedding", *CLIPHead.TOWER_PARTS):
                    named.append((f"{ONE_PROCESS}{name}", param))
                else:  # the temperature: CLIPTrainModule's own parameters
                    named.append((name, param))
        return named

    def head(self) -> CLIPHead | None:
        pieces = compat.pipeline_pieces(self)
        return pieces[-1] if pieces and isinstance(pieces[-1], CLIPHead) else None


def build_pipeline(
    model: CLIPModelConfig,
    loss: CLIPLossConfig,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    dtype: torch.dtype,
    recompute: Recompute,
    seed: int,
    dp_group,
    sample_state: ShardedSampleState | None,
) -> CLIPPipeline:
    """This rank's stage of the model; the same weights as the one-process model (on CPU)."""
    from deepspeed.pipe import LayerSpec

    builders = piece_builders(
        model, tensor_parallel_size=tensor_parallel, params_dtype=dtype, recompute=recompute
    )
    specs = [LayerSpec(CLIPEmbeddings, builders, seed, dtype)]
    specs += [LayerSpec(TowerLayer, builders, name, seed, dtype) for name in interleaved(model)]
    specs.append(LayerSpec(CLIPHead, builders, seed, dtype, loss, model.embed_dim))
    world = dist.get_world_size()
    module = CLIPPipeline(
        layers=specs,
        topology=PipeModelDataParallelTopology(
            num_pp=pipeline_parallel,
            num_mp=tensor_parallel,
            num_dp=world // (tensor_parallel * pipeline_parallel),
        ),
        loss_fn=PipelineObjective(sample_state),
        partition_method="type:TowerLayer",
    )
    layers = [p for p in compat.pipeline_pieces(module) if isinstance(p, TowerLayer)]
    for tower in ("vision", "text"):  # each tower's layers on this stage
        recompute.apply([p.layer for p in layers if p.tower == tower])
    head = module.head()
    if head is not None:
        head.dp_group = dp_group
        module.loss_fn.head = head
    to_training_dtype(module, dtype)  # the temperature stays float32
    seed_rngs(seed)  # dropout streams do not depend on which pieces this stage built
    return module


def _stage_ranks(pp_group) -> list[int]:
    return dist.get_process_group_ranks(pp_group)


@torch.no_grad()
def relay(module: CLIPPipeline, images, tokens, lengths, pp_group, finish) -> object:
    """``finish(head, features)`` of a batch (either side may be None) passed through every
    stage in evaluation mode; its result on every stage of ``pp_group``."""
    ranks = _stage_ranks(pp_group)
    stage = ranks.index(dist.get_rank())
    device = compute_device()
    was_training = module.training
    module.eval()
    x = (images, tokens, lengths)
    if stage > 0:
        received = [None]
        dist.recv_object_list(received, src=ranks[stage - 1], group=pp_group)
        x = tuple(None if t is None else t.to(device) for t in received[0])
    for piece in compat.pipeline_pieces(module):
        x = piece(x) if not isinstance(piece, CLIPHead) else piece.features(x)
    result = [None]
    if stage < len(ranks) - 1:
        dist.send_object_list([tuple(None if t is None else t.cpu() for t in x)],
                              dst=ranks[stage + 1], group=pp_group)  # fmt: skip
    else:
        result = [finish(module.head(), x)]
    dist.broadcast_object_list(result, src=ranks[-1], group=pp_group)
    module.train(was_training)
    return result[0]


class PipelineEncoder:
    """The evaluation's ``engine(images, tokens, lengths, encode=True)`` for a pipeline: the
    encoded dict (``ContrastiveHead.encoded``) on every stage."""

    def __init__(self, engine, pp_group):
        self.engine, self.pp_group = engine, pp_group

    def eval(self):
        self.engine.eval()

    def train(self):
        self.engine.train()

    def __call__(self, images, tokens, lengths, encode: bool = True) -> dict:
        def finish(head, features):
            return {k: v.cpu() for k, v in head.encoded(features).items()}

        out = relay(self.engine.module, images, tokens, lengths, self.pp_group, finish)
        return out


def init_prototypes(module: CLIPPipeline, batch: dict, pp_group) -> None:
    """TempNet's prototypes from a batch of pairs through the stages (``CLIPTemperature``)."""
    images, tokens, lengths, _ = unpack_batch(batch)

    def finish(head, features):
        e = head.encoded(features)
        head.set_prototypes(e["image"], e["text"])

    relay(module, images, tokens, lengths, pp_group, finish)


def _micro_batches(batches: list[dict]):
    for batch in batches:
        images, tokens, lengths, indices = unpack_batch(batch)
        yield (images, tokens, lengths), indices


def pipeline_train_step(
    engine, batches: list[dict], *, dp_group, pp_group, norm: NormRecorder | None
) -> StepStats:
    """One iteration through DeepSpeed's pipeline schedule; the same results as ``train_step``."""
    objective: PipelineObjective = engine.module.loss_fn
    if objective.sample_state is not None:  # on the host, before DeepSpeed moves them
        for batch in batches:
            objective.sample_state.check(batch["index"])
    dp = dist.get_world_size(group=dp_group)
    anchors = 2 * dp * sum(int(b["index"].shape[0]) for b in batches)
    objective.start_step(anchors, dp * len(batches))
    return train_through_schedule(
        engine,
        _micro_batches(batches),
        objective.stats,
        dp_group=dp_group,
        pp_group=pp_group,
        norm=norm,
    )
