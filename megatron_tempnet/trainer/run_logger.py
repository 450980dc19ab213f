"""Where a run reports: the console, TensorBoard, Weights & Biases and a JSON-lines metrics file
(rank 0 only).

A resumed run continues every record from the iteration it resumes at: the metrics file drops
its rows past that iteration (left there by the run that crashed or was preempted after its last
checkpoint) and TensorBoard purges its events past it, so no iteration appears twice.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megatron_tempnet.trainer.config import LoggingConfig
from megatron_tempnet.utils.files import write_atomic
from megatron_tempnet.utils.logging import get_logger

logger = get_logger(__name__)


class RunLogger:
    """One object per run; every method is a no-op on ranks other than 0.

    ``start``: the iteration the run resumes from (0 for a fresh run). ``resolved``: the run's
    resolved config, recorded by Weights & Biases.
    """

    def __init__(self, config: LoggingConfig, start: int = 0, resolved: dict | None = None):
        self.enabled = dist.get_rank() == 0
        self.metrics_file = config.metrics_file
        self._tb = self._wandb = None
        if not self.enabled:
            return
        if config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events past the resumed iteration are dropped from the curves
            purge = start + 1 if start else None
            self._tb = SummaryWriter(config.tensorboard_dir, purge_step=purge)
        if self.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)
            if start:
                truncate_metrics(self.metrics_file, start)
        if config.wandb_project:
            self._wandb = _start_wandb(config, resolved)

    def log(self, iteration: int, metrics: dict, tau_sample: torch.Tensor | None = None) -> None:
        if not self.enabled:
            return
        line = " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
        logger.info("iteration %d | %s", iteration, line)
        histogram = tau_sample is not None and tau_sample.numel() > 0
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(_tb_name(key), value, iteration)
            if histogram:
                self._tb.add_histogram("tau/histogram", tau_sample, iteration)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            record = {_tb_name(key): value for key, value in metrics.items()}
            if histogram:
                record["tau/histogram"] = wandb.Histogram(tau_sample.float().cpu().numpy())
            self._wandb.log(record, step=iteration)
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(config: LoggingConfig, resolved: dict | None):
    import wandb

    if config.wandb_save_dir:
        os.makedirs(config.wandb_save_dir, exist_ok=True)
    return wandb.init(
        project=config.wandb_project,
        entity=config.wandb_entity,
        name=config.wandb_exp_name,
        dir=config.wandb_save_dir,
        config=resolved,
    )


def truncate_metrics(path: str, start: int) -> int:
    """Drop the rows of the metrics file at ``path`` past iteration ``start`` (and a partial last
    line); returns how many were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash
        if isinstance(row, dict) and row.get("iteration", 0) <= start:
            kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        write_atomic(path, "".join(line + "\n" for line in kept))
        logger.info(
            "--metrics-file %s: dropped %d row(s) past iteration %d, where this run resumes",
            path,
            dropped,
            start,
        )
    return dropped


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _tb_name(key: str) -> str:
    if key.startswith("tau_"):
        return f"tau/{key[4:]}"
    if key.startswith("val_"):
        return f"validation/{key[4:]}"
    if key.endswith("loss"):
        return f"loss/{key}"
    return f"train/{key}"


def memory_mb() -> float:
    """Peak memory of this process: the CUDA allocator's, else the resident high-water mark."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
