"""One CLIP training iteration: per-sample state in, contrastive loss, state out, one step.

The global batch is one micro-batch per data-parallel rank (the contrastive candidates are the
global batch). The loss of an iteration is the mean over its ``2 B`` anchors (every image and
every text): each rank's per-anchor sum is divided by ``2 B``, and DeepSpeed's average over the
data-parallel ranks is undone by scaling with ``dp``, as in the GPT step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tempnet.training.sample_state import ShardedSampleState
from megatron_tempnet.training.step import clip_gradients, compute_device


@dataclass
class CLIPStepStats:
    """Sums over the global batch's anchors (identical on every rank after the reduce)."""

    anchors: float
    loss_sum: float
    tau_sums: tuple[float, float]  # images, texts
    tau_sq_sum: float
    tau_min: float
    tau_max: float
    tau_sample: torch.Tensor  # this rank's taus (histograms)
    unit = "samples"

    @property
    def count(self) -> float:
        return self.anchors / 2  # image-text pairs

    def metrics(self) -> dict:
        mean = sum(self.tau_sums) / self.anchors
        return {
            "loss": self.loss_sum / self.anchors,
            "tau_mean": mean,
            "tau_image_mean": 2 * self.tau_sums[0] / self.anchors,
            "tau_text_mean": 2 * self.tau_sums[1] / self.anchors,
            "tau_std": math.sqrt(max(self.tau_sq_sum / self.anchors - mean * mean, 0.0)),
            "tau_min": self.tau_min,
            "tau_max": self.tau_max,
        }


def clip_batch(batch: dict) -> tuple[torch.Tensor, ...]:
    device = compute_device()
    return tuple(batch[k].to(device) for k in ("image", "tokens", "length", "index"))


def clip_train_step(
    engine, batches: list[dict], *, dp_group, clip_grad: float | None,
    sample_state: ShardedSampleState | None,
) -> tuple[CLIPStepStats, float | None]:  # fmt: skip
    """Forward/backward of the global batch and one optimizer step; updates the state."""
    (batch,) = batches  # validated: no gradient accumulation for contrastive losses
    images, tokens, lengths, indices = clip_batch(batch)
    dp = dist.get_world_size(group=dp_group)
    state = seen = None
    if sample_state is not None:
        state, seen = sample_state.fetch(indices)
    out = engine(images, tokens, lengths, state, seen)  # CLIPTrainModule.forward
    anchors = 2 * images.shape[0] * dp
    engine.backward(out.loss.sum() / anchors * dp, scale_wrt_gas=False)
    grad_norm = None
    if clip_grad is not None:
        grad_norm = clip_gradients(engine.module.parameters(), clip_grad)
    engine.step()
    if clip_grad is None:
        grad_norm = engine.get_global_grad_norm()
    if sample_state is not None:
        sample_state.store(indices, out.state)
    return _reduce(out, images.shape[0], dp_group), None if grad_norm is None else float(grad_norm)


def _reduce(out, n: int, dp_group) -> CLIPStepStats:
    tau = out.tau.double()
    sums = torch.stack([
        torch.tensor(2.0 * n, dtype=torch.float64), out.loss.detach().double().sum().cpu(),
        tau[:n].sum().cpu(), tau[n:].sum().cpu(), (tau * tau).sum().cpu(),
    ]).to(compute_device())  # fmt: skip
    extremes = torch.stack([tau.min(), -tau.max()]).to(compute_device())
    dist.all_reduce(sums, group=dp_group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=dp_group)
    anchors, loss, tau_i, tau_t, tau_sq = sums.tolist()
    lo, neg_hi = extremes.tolist()
    return CLIPStepStats(anchors, loss, (tau_i, tau_t), tau_sq, lo, -neg_hi, out.tau.float().cpu())
