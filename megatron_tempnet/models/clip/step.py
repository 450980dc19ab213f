"""One CLIP training iteration: per-sample state in, contrastive loss, state out, one step.

The global batch is one micro-batch per data-parallel rank (the contrastive candidates are the
global batch). The loss of an iteration is the mean over its ``2 B`` anchors (every image and
every text): each rank's per-anchor sum is divided by ``2 B``, and DeepSpeed's average over the
data-parallel ranks is undone by scaling with ``dp``, as in the GPT step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tempnet.models.clip.objective import CLIPOutput
from megatron_tempnet.models.clip.sample_state import ShardedSampleState
from megatron_tempnet.trainer.stats import MAX, MIN, SUM, Statistics, StepStats, mean_and_std
from megatron_tempnet.trainer.step import clip_grad_norm_, compute_device

STATS = {
    "anchors": SUM,
    "loss": SUM,
    "tau_image": SUM,
    "tau_text": SUM,
    "tau_sq": SUM,
    "tau_min": MIN,
    "tau_max": MAX,
}


def unpack_batch(batch: dict) -> tuple[torch.Tensor, ...]:
    """``(images [b, C, S, S], tokens [b, L], lengths [b], indices [b])`` on the device."""
    device = compute_device()
    return tuple(batch[k].to(device) for k in ("image", "tokens", "length", "index"))


def train_step(
    engine,
    batches: list[dict],
    *,
    dp_group,
    max_grad_norm: float | None,
    sample_state: ShardedSampleState | None,
) -> tuple[StepStats, float | None]:
    """Forward/backward of the global batch and one optimizer step; updates the state.

    ``max_grad_norm``: clip here (0 = measure only), or None to leave it to DeepSpeed.
    """
    (batch,) = batches  # validated: no gradient accumulation for contrastive losses
    images, tokens, lengths, indices = unpack_batch(batch)
    dp = dist.get_world_size(group=dp_group)
    state = seen = None
    if sample_state is not None:
        state, seen = sample_state.fetch(indices)
    out = engine(images, tokens, lengths, state, seen)  # CLIPTrainModule.forward
    anchors = 2 * images.shape[0] * dp
    engine.backward(out.loss.sum() / anchors * dp, scale_wrt_gas=False)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = clip_grad_norm_(engine.module.parameters(), max_grad_norm)
    engine.step()
    if max_grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    if sample_state is not None:
        sample_state.store(indices, out.state)
    stats = _reduce(out, images.shape[0], dp_group)
    return stats, None if grad_norm is None else float(grad_norm)


def _reduce(out: CLIPOutput, n: int, dp_group) -> StepStats:
    """The global batch's loss and tau statistics from this rank's ``2 n`` anchors."""
    tau = out.tau.double()
    stats = Statistics(STATS, compute_device())
    stats.add(
        anchors=2.0 * n,
        loss=out.loss.detach().double().sum(),
        tau_image=tau[:n].sum(),
        tau_text=tau[n:].sum(),
        tau_sq=(tau * tau).sum(),
        tau_min=tau.min(),
        tau_max=tau.max(),
    )
    totals = stats.reduce(dp_group)
    anchors = totals["anchors"]
    tau_mean, tau_std = mean_and_std(
        totals["tau_image"] + totals["tau_text"], totals["tau_sq"], anchors
    )
    metrics = {
        "loss": totals["loss"] / anchors,
        "tau_mean": tau_mean,
        "tau_image_mean": 2 * totals["tau_image"] / anchors,
        "tau_text_mean": 2 * totals["tau_text"] / anchors,
        "tau_std": tau_std,
        "tau_min": totals["tau_min"],
        "tau_max": totals["tau_max"],
    }
    return StepStats(metrics, count=anchors / 2, unit="samples", tau_sample=out.tau.float().cpu())
