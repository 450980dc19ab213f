"""Per-GPU memory of a CLIP training run, before it is queued (arithmetic only).

The towers follow the shared accounting (``models/memory.py``): each tower's layers keep what a
transformer layer keeps for backward over its own sequence (``1 + patches`` tokens for the ViT,
``--context-length`` for the text), model states per ZeRO stage. The contrastive loss adds, on
the last stage, for a micro-batch of ``b`` pairs per rank and a contrastive batch of
``B = b x DP``:

- the gathered embeddings ``[B, d]`` of both sides (float32);
- per side, the similarity rows ``[b, B]`` and what the loss keeps of them for backward (float32:
  InfoNCE its scaled logits; the robust losses the differences ``d`` and the weights ``w``), and
  while a side's robust estimator runs, its float64 temporaries (``d``, ``z``, ``exp``, ``w``:
  ``4 x 8 b B`` bytes, gone before the next side; InfoNCE's backward holds its softmax and
  gradients, about five float32 ``[b, B]`` at its peak);
- the per-sample state shard of this data-parallel rank, ``ceil(N / DP) (4 k + 1)`` bytes for
  ``N`` pairs and ``k`` values per pair (``sample_state.ShardedSampleState``);
- TempNet (image and text, ``d1 d0 + d1 + d1 d2 + d2 + 2`` parameters each) or TaU's heads.

With --async-save a rank also holds its checkpoint share in host memory (``checkpoint_share``:
14 B per parameter under bf16/fp16, 12 B in float32, over DP; ``models/memory.py``); the
per-sample state is serialised with each save beside it, not counted there.

With pipeline parallelism the towers' layers are interleaved and cut as ``models/clip/pipeline``
does; the first stage holds both embeddings, the last the norms, projections, temperature, loss
and per-sample state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_tempnet.models.clip.config import CLIPModelConfig
from megatron_tempnet.models.clip.sample_state import ShardedSampleState
from megatron_tempnet.models.memory import (
    PRECISIONS,
    BatchLayout,
    checkpoint_share_bytes,
    layer_activation_bytes,
    layer_params,
    model_state_bytes,
    norm_params,
)
from megatron_tempnet.models.transformer import ModelConfigError

STATE_FIELDS = {"clip": 0, "tau": 0, "sogclr": 4, "tempnet": 4, "isogclr": 8}


@dataclass
class CLIPLayout(BatchLayout):
    clip_loss: str = "tempnet"
    num_samples: int = 0
    """Training pairs (the per-sample state's size)."""
    tempnet_proj_size: int = 256


@dataclass
class CLIPStage:
    stage: int
    vision_layers: int
    text_layers: int
    params: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    checkpoint_share: int = 0
    """Bytes of a rank's checkpoint share: host memory with --async-save, not GPU memory."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _stage_layers(model: CLIPModelConfig, pp: int) -> list[tuple[int, int]]:
    """(vision, text) layers per stage: the interleaved order cut into equal counts."""
    keys = [((i + 0.5) / model.vision_layers, 0) for i in range(model.vision_layers)]
    keys += [((i + 0.5) / model.text_layers, 1) for i in range(model.text_layers)]
    order = [tower for _, tower in sorted(keys)]
    n = len(order)
    bounds = [round(i * n / pp) for i in range(pp + 1)]
    return [(order[a:b].count(0), order[a:b].count(1)) for a, b in zip(bounds, bounds[1:])]


def temperature_params(model: CLIPModelConfig, layout: CLIPLayout) -> int:
    d = model.embed_dim
    if layout.clip_loss == "tempnet":
        d2 = layout.tempnet_proj_size
        return 2 * (d * d + d + d * d2 + d2 + 2)
    if layout.clip_loss == "tau":
        return 2 * (d + 1)
    return 1 if layout.clip_loss == "clip" else 0


def contrastive_bytes(model: CLIPModelConfig, layout: CLIPLayout) -> dict[str, int]:
    """The last stage's loss buffers (see the module docstring)."""
    b, d = layout.micro_batch_size, model.embed_dim
    big_b = b * layout.data_parallel
    robust = layout.clip_loss in ("sogclr", "isogclr", "tempnet")
    rows = 2 * (3 if robust else 2) * 4 * b * big_b  # both sides' [b, B] float32 rows
    k = STATE_FIELDS[layout.clip_loss]
    state = (
        ShardedSampleState.bytes_per_rank(layout.num_samples, k, layout.data_parallel) if k else 0
    )
    # robust: a side's float64 estimator; InfoNCE: its backward's softmax and gradients
    temporaries = 4 * 8 * b * big_b if robust else 5 * 4 * b * big_b
    return {
        "similarity rows": rows + 2 * 4 * big_b * d,
        "loss temporaries": temporaries,
        "per-sample state": state,
    }


def estimate(model: CLIPModelConfig, layout: CLIPLayout) -> list[CLIPStage]:
    """Per-GPU estimate of every pipeline stage."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    model.validate(tp)
    if pp > model.vision_layers + model.text_layers:
        raise ModelConfigError(
            f"--pipeline-model-parallel-size ({pp}) must be at most the towers' layers"
        )
    vision, text = model.vision_tower(), model.text_tower()
    hv, ht, d = vision.hidden_size, text.hidden_size, model.embed_dim
    tokens_v, tokens_t = model.num_patches + 1, model.context_length
    vocab = model.padded_vocab_size(tp) // tp * ht
    embeddings = (model.image_channels * model.patch_size**2 + 1 + tokens_v) * hv
    embeddings += norm_params(vision) + vocab + tokens_t * ht
    head = norm_params(vision) + norm_params(text) + d * (hv + ht)
    per_v, per_t = layer_params(vision, tp), layer_params(text, tp)
    act_v = layer_activation_bytes(vision, layout, tokens_v)
    act_t = layer_activation_bytes(text, layout, tokens_t)
    e = PRECISIONS[layout.precision]
    stages = []
    for i, (nv, nt) in enumerate(_stage_layers(model, pp)):
        s = CLIPStage(i, nv, nt)
        s.params = nv * per_v + nt * per_t
        largest = max(per_v if nv else 0, per_t if nt else 0)
        if i == 0:
            s.params += embeddings
            largest = max(largest, vocab)
        if i == pp - 1:
            s.params += head + temperature_params(model, layout)
        s.parts = model_state_bytes(s.params, 0, largest, layout)
        s.checkpoint_share = checkpoint_share_bytes(s.params, layout)
        in_flight = min(pp - i, layout.micro_batches)
        s.parts["activations"] = in_flight * (nv * act_v + nt * act_t)
        if i == 0:  # the images and the embeddings' outputs
            b = layout.micro_batch_size
            pixels = b * model.image_channels * model.image_size**2
            s.parts["activations"] += in_flight * (
                4 * pixels + e * b * (tokens_v * hv + tokens_t * ht)
            )
        if i == pp - 1:
            s.parts.update(contrastive_bytes(model, layout))
        stages.append(s)
    return stages


def largest(stages: list[CLIPStage]) -> CLIPStage:
    return max(stages, key=lambda s: s.total)
