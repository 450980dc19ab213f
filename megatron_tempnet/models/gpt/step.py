"""One GPT training iteration and one validation pass (one process per stage: PP = 1).

The loss of an iteration is the mean over the unmasked tokens of the whole global batch: the
token count is summed over micro-batches and data-parallel ranks first (one small all-reduce),
and every micro-batch's masked loss sum is divided by it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tempnet.models.gpt.objective import TokenLosses, masked_mean
from megatron_tempnet.trainer.stats import MAX, MIN, SUM, Statistics, StepStats, mean_and_std
from megatron_tempnet.trainer.step import accumulation, clip_grad_norm_, compute_device

TRAIN_STATS = {
    "tokens": SUM,
    "loss": SUM,
    "ce": SUM,
    "tau": SUM,
    "tau_sq": SUM,
    "tau_min": MIN,
    "tau_max": MAX,
}
VALID_STATS = {"tokens": SUM, "ce": SUM, "ts_ce": SUM, "tau": SUM}


def unpack_batch(batch: dict) -> tuple[torch.Tensor, ...]:
    """``(tokens, labels, loss_mask, position_ids)``, each ``[b, s]``, on the compute device
    (copied without waiting: the loader pins its batches on a GPU machine)."""
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    device = compute_device()
    return tuple(batch[k].to(device, non_blocking=True) for k in keys)


class TokenStatistics:
    """The iteration's token-weighted sums and tau extremes, and the last micro-batch's taus.

    Masked tokens are left out by ``where``, never by boolean indexing: a shape that depends on
    the mask would make the host wait for the device at every micro-batch.
    """

    def __init__(self):
        self.stats = Statistics(TRAIN_STATS, compute_device())
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, out: TokenLosses, mask: torch.Tensor) -> None:
        keep = mask.bool()
        tau = out.tau.detach().double()
        kept = torch.where(keep, tau, 0.0)
        self.stats.add(
            tokens=keep.sum(),
            loss=torch.where(keep, out.loss.detach().double(), 0.0).sum(),
            ce=torch.where(keep, out.ce.detach().double(), 0.0).sum(),
            tau=kept.sum(),
            tau_sq=(kept * kept).sum(),
            tau_min=torch.where(keep, tau, math.inf).min(),
            tau_max=torch.where(keep, tau, -math.inf).max(),
        )
        self.last = (out.tau.detach(), keep)

    def sample(self) -> torch.Tensor:
        """The last micro-batch's taus of its unmasked tokens, on the host (empty if none)."""
        if self.last is None:
            return torch.zeros(0)
        tau, keep = self.last
        return tau[keep].float().cpu()

    def reduce(self, *groups, grad_norm=None, applied: bool = True) -> StepStats:
        """Reduced over ``groups`` (data parallel; then the pipeline, whose last stage alone
        holds statistics), on the device."""
        totals = self.stats.reduce_on_device(*groups)
        return StepStats(
            totals, token_metrics, _tokens, "tokens", grad_norm, applied, tau_sample=self.sample
        )


def token_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The logged metrics from the iteration's reduced sums (``TRAIN_STATS``)."""
    tokens = max(totals["tokens"], 1.0)
    tau_mean, tau_std = mean_and_std(totals["tau"], totals["tau_sq"], tokens)
    return {
        "loss": totals["loss"] / tokens,
        "ce_loss": totals["ce"] / tokens,
        "tau_mean": tau_mean,
        "tau_std": tau_std,
        "tau_min": totals["tau_min"],
        "tau_max": totals["tau_max"],
        "tokens": tokens,
    }


def _tokens(totals: dict[str, float]) -> float:
    return max(totals["tokens"], 1.0)


def global_token_count(unpacked: list[tuple], dp_group) -> torch.Tensor:
    """Unmasked tokens in the global batch (at least 1): this rank's micro-batches, summed over
    DP; a float64 scalar on the device."""
    num_tokens = torch.stack([u[2].sum() for u in unpacked]).sum().double().reshape(1)
    dist.all_reduce(num_tokens, group=dp_group)
    return num_tokens.clamp(min=1.0).reshape(())


def train_step(engine, batches: list[dict], *, dp_group, max_grad_norm: float | None) -> StepStats:
    """Forward/backward over the iteration's micro-batches and one optimizer step.

    ``max_grad_norm``: clip here (ZeRO 0, where DeepSpeed reports no norm; 0 = measure only),
    or None to leave clipping to DeepSpeed. The stats carry the global gradient norm (before
    clipping). Nothing here waits for the device.
    """
    dp = dist.get_world_size(group=dp_group)
    unpacked = [unpack_batch(b) for b in batches]
    num_tokens = global_token_count(unpacked, dp_group)
    stats, grad_norm = TokenStatistics(), None
    for tokens, labels, mask, position_ids in accumulation(engine, unpacked):
        out = engine(tokens, position_ids, labels, mask)  # TrainModule.forward: TokenLosses
        loss = masked_mean(out.loss, mask, num_tokens)
        # `loss` is already this micro-batch's share of the global mean, but DeepSpeed averages
        # gradients over data-parallel ranks: scale by dp, and no further division by the
        # accumulation steps
        engine.backward(loss * dp, scale_wrt_gas=False)
        if max_grad_norm is not None and engine.is_gradient_accumulation_boundary():
            # gradients are reduced over DP by now
            grad_norm = clip_grad_norm_(engine.module.parameters(), max_grad_norm)
        engine.step()
        stats.add(out, mask)
    if max_grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    return stats.reduce(dp_group, grad_norm=grad_norm, applied=engine.was_step_applied())


def add_validation(stats: Statistics, out: TokenLosses, mask: torch.Tensor) -> None:
    """Fold one micro-batch's CE, T-LLM CE and tau into the validation sums."""
    keep = mask.bool()
    stats.add(
        tokens=keep.sum(),
        ce=torch.where(keep, out.ce.double(), 0.0).sum(),
        ts_ce=torch.where(keep, out.ts_ce.double(), 0.0).sum(),
        tau=torch.where(keep, out.tau.double(), 0.0).sum(),
    )


@torch.no_grad()
def evaluate(engine, batches, *, dp_group) -> dict:
    """Validation CE perplexity and the paper's T-LLM perplexity (probabilities of L / tau)."""
    engine.eval()
    stats = Statistics(VALID_STATS, compute_device())
    for batch in batches:
        tokens, labels, mask, position_ids = unpack_batch(batch)
        add_validation(stats, engine(tokens, position_ids, labels), mask)
    engine.train()
    return validation_metrics(stats.reduce(dp_group))


def validation_metrics(totals: dict[str, float]) -> dict:
    """From the reduced validation sums (tokens, CE, temperature-scaled CE, tau)."""
    tokens = max(totals["tokens"], 1.0)
    return {
        "val_ce_loss": totals["ce"] / tokens,
        "val_ppl": math.exp(min(totals["ce"] / tokens, 700.0)),
        "val_tllm_ppl": math.exp(min(totals["ts_ce"] / tokens, 700.0)),
        "val_tau_mean": totals["tau"] / tokens,
    }
