"""Where a run reports: the console, TensorBoard and a JSON-lines metrics file (rank 0 only)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megatron_tempnet.trainer.config import LoggingConfig
from megatron_tempnet.utils.logging import get_logger

logger = get_logger(__name__)


class RunLogger:
    """One object per run; every method is a no-op on ranks other than 0."""

    def __init__(self, config: LoggingConfig):
        self.enabled = dist.get_rank() == 0
        self.metrics_file = config.metrics_file
        self._tb = None
        if self.enabled and config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(config.tensorboard_dir)
        if self.enabled and self.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)

    def log(self, iteration: int, metrics: dict, tau_sample: torch.Tensor | None = None) -> None:
        if not self.enabled:
            return
        line = " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
        logger.info("iteration %d | %s", iteration, line)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(_tb_name(key), value, iteration)
            if tau_sample is not None and tau_sample.numel():
                self._tb.add_histogram("tau/histogram", tau_sample, iteration)
            self._tb.flush()
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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
