"""The project's one logger, with rank-0 helpers for distributed runs."""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "megatron_tempnet"


def get_logger(name: str = _ROOT) -> logging.Logger:
    """Logger under the ``megatron_tempnet`` hierarchy (configure it once in the application)."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def _rank() -> int:
    # torch not imported yet means no process group either (keeps data tools free of torch)
    dist = sys.modules.get("torch.distributed")
    return dist.get_rank() if dist is not None and dist.is_initialized() else 0


def log_rank0(msg: str, *args, level: int = logging.INFO, logger: logging.Logger | None = None):
    """Log on global rank 0 only (every rank when torch.distributed is not initialised)."""
    if _rank() == 0:
        (logger or get_logger()).log(level, msg, *args)


def warn_rank0(msg: str, *args, logger: logging.Logger | None = None) -> None:
    """Warning on global rank 0 only."""
    log_rank0(msg, *args, level=logging.WARNING, logger=logger)


def log_startup(lines: list[str], logger: logging.Logger | None = None) -> None:
    """Log ``lines`` once per job, before torch.distributed starts: on the process whose
    launcher rank (torchrun's ``RANK``, srun's ``SLURM_PROCID``) is 0."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return
    for line in lines:
        (logger or get_logger()).info("%s", line)
