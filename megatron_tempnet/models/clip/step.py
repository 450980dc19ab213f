"""One CLIP training iteration: per-sample state in, contrastive loss, state out, one step.

Each micro-batch, gathered over the data-parallel ranks, is one contrastive batch (its
candidates); with ``--global-batch-size`` > micro-batch x DP the micro-batches' gradients are
accumulated before the step, and the per-sample state is fetched and stored once per
micro-batch. The loss of an iteration is the mean over all its ``2 B`` anchors (every image and
every text of the global batch): each micro-batch's per-anchor sum is divided by ``2 B``, and
DeepSpeed's average over the data-parallel ranks is undone by scaling with ``dp``, as in the GPT
step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tempnet.models.clip.objective import CLIPOutput
from megatron_tempnet.models.clip.sample_state import ShardedSampleState
from megatron_tempnet.trainer.stats import MAX, MIN, SUM, Statistics, StepStats, mean_and_std
from megatron_tempnet.trainer.step import accumulation, clip_grad_norm_, compute_device

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
    """``(images [b, C, S, S], tokens [b, L], lengths [b], indices [b])`` on the device (copied
    without waiting: the loader pins its batches on a GPU machine)."""
    device = compute_device()
    return tuple(
        batch[k].to(device, non_blocking=True) for k in ("image", "tokens", "length", "index")
    )


class ContrastiveStatistics:
    """An iteration's loss and tau sums over its micro-batches, and the last one's taus."""

    def __init__(self):
        self.stats = Statistics(STATS, compute_device())
        self.last: torch.Tensor | None = None

    def add(self, out: CLIPOutput) -> None:
        """One micro-batch's ``2 n`` anchors (images first)."""
        tau, n = out.tau.double(), out.tau.shape[0] // 2
        self.stats.add(
            anchors=2.0 * n,
            loss=out.loss.detach().double().sum(),
            tau_image=tau[:n].sum(),
            tau_text=tau[n:].sum(),
            tau_sq=(tau * tau).sum(),
            tau_min=tau.min(),
            tau_max=tau.max(),
        )
        self.last = out.tau.detach()

    def sample(self) -> torch.Tensor:
        """The last micro-batch's taus, on the host (empty if none)."""
        return torch.zeros(0) if self.last is None else self.last.float().cpu()

    def reduce(self, *groups, grad_norm=None, applied: bool = True) -> StepStats:
        """Reduced over ``groups`` (data parallel; then the pipeline, whose last stage alone
        holds statistics), on the device."""
        totals = self.stats.reduce_on_device(*groups)
        return StepStats(
            totals, contrastive_metrics, _pairs, "samples", grad_norm, applied, self.sample
        )


def contrastive_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The logged metrics from the iteration's reduced sums (``STATS``)."""
    anchors = max(totals["anchors"], 1.0)
    tau_mean, tau_std = mean_and_std(
        totals["tau_image"] + totals["tau_text"], totals["tau_sq"], anchors
    )
    return {
        "loss": totals["loss"] / anchors,
        "tau_mean": tau_mean,
        "tau_image_mean": 2 * totals["tau_image"] / anchors,
        "tau_text_mean": 2 * totals["tau_text"] / anchors,
        "tau_std": tau_std,
        "tau_min": totals["tau_min"],
        "tau_max": totals["tau_max"],
    }


def _pairs(totals: dict[str, float]) -> float:
    return max(totals["anchors"], 1.0) / 2


def train_step(
    engine,
    batches: list[dict],
    *,
    dp_group,
    max_grad_norm: float | None,
    sample_state: ShardedSampleState | None,
) -> StepStats:
    """Forward/backward of every micro-batch, then one optimizer step; updates the state.

    ``max_grad_norm``: clip here (0 = measure only), or None to leave it to DeepSpeed. Nothing
    here waits for the device.
    """
    dp = dist.get_world_size(group=dp_group)
    anchors = 2 * dp * sum(int(b["index"].shape[0]) for b in batches)  # 2 B
    stats, grad_norm = ContrastiveStatistics(), None
    for batch in accumulation(engine, batches):
        images, tokens, lengths, _ = unpack_batch(batch)
        state = seen = None
        if sample_state is not None:  # the host's indices: checked without waiting
            state, seen = sample_state.fetch(batch["index"])
        out = engine(images, tokens, lengths, state, seen)  # CLIPTrainModule.forward
        engine.backward(out.loss.sum() / anchors * dp, scale_wrt_gas=False)
        if max_grad_norm is not None and engine.is_gradient_accumulation_boundary():
            grad_norm = clip_grad_norm_(engine.module.parameters(), max_grad_norm)
        engine.step()
        if sample_state is not None:
            sample_state.store(batch["index"], out.state)
        stats.add(out)
    if max_grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    return stats.reduce(dp_group, grad_norm=grad_norm, applied=engine.was_step_applied())
