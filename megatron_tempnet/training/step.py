"""One training iteration and one validation pass.

The loss of an iteration is the mean over the unmasked tokens of the whole global batch: the
token count is summed over micro-batches and data-parallel ranks first (one small all-reduce),
and every micro-batch's masked loss sum is divided by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tempnet.training.loss import masked_mean


class TrainingError(RuntimeError):
    """The run cannot continue (a NaN/inf loss or gradient): names the iteration and rank."""


@dataclass
class StepStats:
    """Token-weighted sums over the global batch (identical on every rank after the reduce)."""

    tokens: float
    loss_sum: float
    ce_sum: float
    tau_sum: float
    tau_sq_sum: float
    tau_min: float
    tau_max: float
    tau_sample: torch.Tensor  # this rank's unmasked taus of the last micro-batch (histograms)
    unit = "tokens"  # what the loop's throughput counts

    @property
    def count(self) -> float:
        return self.tokens

    def metrics(self) -> dict:
        mean = self.tau_sum / self.tokens
        return {
            "loss": self.loss_sum / self.tokens,
            "ce_loss": self.ce_sum / self.tokens,
            "tau_mean": mean,
            "tau_std": math.sqrt(max(self.tau_sq_sum / self.tokens - mean * mean, 0.0)),
            "tau_min": self.tau_min,
            "tau_max": self.tau_max,
            "tokens": self.tokens,
        }


def compute_device() -> torch.device:
    """Where batches and reduced statistics live (NCCL reduces CUDA tensors only)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def unpack_batch(batch: dict) -> tuple[torch.Tensor, ...]:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return tuple(batch[k].to(compute_device()) for k in keys)


class StepAccumulator:
    def __init__(self):
        dev = compute_device()
        self.sums = torch.zeros(5, dtype=torch.float64, device=dev)  # tokens, loss, ce, tau, tau^2
        self.extremes = torch.full((2,), math.inf, dtype=torch.float64, device=dev)  # min, -max
        self.sample = torch.zeros(0)

    def add(self, out, mask: torch.Tensor) -> None:
        keep = mask.bool()
        tau = out.tau.double()[keep]
        self.sums += torch.stack([
            keep.sum().double(), out.loss.detach().double()[keep].sum(),
            out.ce.double()[keep].sum(), tau.sum(), (tau * tau).sum(),
        ])  # fmt: skip
        if tau.numel():
            self.extremes = torch.minimum(self.extremes, torch.stack([tau.min(), -tau.max()]))
        self.sample = tau.float().cpu()

    def reduce(self, group, pp_group=None) -> StepStats:
        """Sums over ``group`` (data parallel); with ``pp_group`` the last pipeline stage's
        statistics (the other stages hold none) reach every stage."""
        dist.all_reduce(self.sums, group=group)
        dist.all_reduce(self.extremes, op=dist.ReduceOp.MIN, group=group)
        if pp_group is not None:
            dist.all_reduce(self.sums, group=pp_group)
            dist.all_reduce(self.extremes, op=dist.ReduceOp.MIN, group=pp_group)
            self.sample = _share_sample(self.sample, pp_group)
        tokens, loss, ce, tau, tau_sq = self.sums.tolist()
        lo, neg_hi = self.extremes.tolist()
        return StepStats(max(tokens, 1.0), loss, ce, tau, tau_sq, lo, -neg_hi, self.sample)


def _share_sample(sample: torch.Tensor, pp_group) -> torch.Tensor:
    """The tau sample of the one stage that has it, on every stage of ``pp_group``."""
    count = torch.tensor([sample.numel()], dtype=torch.float64, device=compute_device())
    dist.all_reduce(count, group=pp_group)
    buffer = torch.zeros(int(count.item()), dtype=torch.float64, device=compute_device())
    if sample.numel():
        buffer.copy_(sample.to(buffer))
    dist.all_reduce(buffer, group=pp_group)
    return buffer.float().cpu()


def global_token_count(unpacked: list[tuple], dp_group) -> float:
    """Unmasked tokens in the global batch: this rank's micro-batches, summed over DP."""
    num_tokens = torch.stack([u[2].sum() for u in unpacked]).sum().double().reshape(1)
    dist.all_reduce(num_tokens, group=dp_group)
    return max(float(num_tokens), 1.0)


def train_step(
    engine, batches: list[dict], *, dp_group, clip_grad: float | None
) -> tuple[StepStats, float | None]:
    """Forward/backward over the iteration's micro-batches and one optimizer step.

    ``clip_grad``: clip here (ZeRO 0, where DeepSpeed reports no norm; 0 = measure only), or
    None to leave clipping to DeepSpeed's ZeRO optimizer. Returns the stats and the global
    gradient norm (before clipping).
    """
    dp = dist.get_world_size(group=dp_group)
    unpacked = [unpack_batch(b) for b in batches]
    num_tokens = global_token_count(unpacked, dp_group)
    acc, grad_norm = StepAccumulator(), None
    for tokens, labels, mask, position_ids in unpacked:
        out = engine(tokens, position_ids, labels)  # TrainModule.forward: TokenLosses
        loss = masked_mean(out.loss, mask, num_tokens)
        # `loss` is already this micro-batch's share of the global mean, but DeepSpeed averages
        # gradients over data-parallel ranks: scale by dp, and no further division by the
        # accumulation steps
        engine.backward(loss * dp, scale_wrt_gas=False)
        if clip_grad is not None and engine.is_gradient_accumulation_boundary():
            # gradients are reduced over DP by now
            grad_norm = clip_gradients(engine.module.parameters(), clip_grad)
        engine.step()
        acc.add(out, mask)
    if clip_grad is None:
        grad_norm = engine.get_global_grad_norm()
    return acc.reduce(dp_group), None if grad_norm is None else float(grad_norm)


def clip_gradients(parameters, clip_grad: float) -> float:
    """Global gradient norm over TP x PP, clipped in place to ``clip_grad`` (0 = measure only).

    Tensor-parallel shards count on every rank, replicated parameters on TP rank 0 only, and a
    tied weight's second pipeline copy (DeepSpeed marks it ``ds_pipe_replicated``) not at all.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = [p for p in parameters if p.grad is not None]
    counted = [
        p.grad for p in params
        if not getattr(p, "ds_pipe_replicated", False)
        and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
    ]  # fmt: skip
    square = torch.zeros(1, dtype=torch.float64, device=compute_device())
    for g in counted:
        square += g.detach().double().pow(2).sum()
    dist.all_reduce(square, group=parallel_state.get_model_parallel_group())
    norm = float(square.sqrt())
    if clip_grad > 0 and math.isfinite(norm):
        coef = clip_grad / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.detach().mul_(coef)
    return norm


def check_finite(stats, grad_norm: float | None, iteration: int) -> None:
    rank = dist.get_rank()
    loss = stats.metrics()["loss"]
    if not math.isfinite(loss):
        raise TrainingError(f"iteration {iteration}: the loss is {loss} (rank {rank}); stopping")
    if grad_norm is not None and not math.isfinite(grad_norm):
        raise TrainingError(
            f"iteration {iteration}: the gradient norm is {grad_norm} (rank {rank}); stopping"
        )


@torch.no_grad()
def evaluate(engine, batches, *, dp_group) -> dict:
    """Validation CE perplexity and the paper's T-LLM perplexity (probabilities of L / tau)."""
    engine.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=compute_device())  # tokens, ce, ts-ce, tau
    for batch in batches:
        tokens, labels, mask, position_ids = unpack_batch(batch)
        out = engine(tokens, position_ids, labels)
        keep = mask.bool()
        sums += torch.stack([
            keep.sum().double(), out.ce.double()[keep].sum(), out.ts_ce.double()[keep].sum(),
            out.tau.double()[keep].sum(),
        ])  # fmt: skip
    engine.train()
    dist.all_reduce(sums, group=dp_group)
    return validation_metrics(sums)


def validation_metrics(sums: torch.Tensor) -> dict:
    """From the reduced sums (tokens, CE, temperature-scaled CE, tau) of a validation pass."""
    tokens, ce, ts_ce, tau = sums.tolist()
    tokens = max(tokens, 1.0)
    return {
        "val_ce_loss": ce / tokens,
        "val_ppl": math.exp(min(ce / tokens, 700.0)),
        "val_tllm_ppl": math.exp(min(ts_ce / tokens, 700.0)),
        "val_tau_mean": tau / tokens,
    }
