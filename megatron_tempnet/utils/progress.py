"""Progress of long work: a ``tqdm`` bar on a terminal, periodic plain lines elsewhere.

A bar redrawn in place is what a person at a terminal wants; in a CI log or a SLURM ``.out`` file
it becomes thousands of carriage returns. So when standard error is not a terminal the same
progress is logged as one line every ``MEGATRON_TEMPNET_PROGRESS_INTERVAL`` seconds (default 30)
and once at the end::

    preprocessing: 45% 91.2/203.0 MB | 3.04 MB/s | elapsed 0:00:30 | ETA 0:00:36
    preprocessing: 100% 203.0/203.0 MB in 0:01:07 (3.03 MB/s)

Usage::

    with progress("evaluating", total=len(windows), unit="window") as bar:
        for window in windows:
            ...
            bar.update(1)
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import TextIO

from megatron_tempnet.utils.logging import get_logger

INTERVAL_ENV = "MEGATRON_TEMPNET_PROGRESS_INTERVAL"
"""Seconds between plain progress lines (when standard error is not a terminal)."""

logger = get_logger(__name__)


def progress(
    desc: str,
    total: float | None,
    *,
    unit: str = "it",
    scale: float = 1.0,
    enabled: bool = True,
    stream: TextIO | None = None,
):
    """A progress reporter for ``total`` units of work (None: unknown).

    ``scale`` divides the counts for display (``scale=2**20, unit="MB"`` for bytes).
    ``enabled=False`` reports nothing (other ranks than 0). Use it as a context manager and call
    ``update(n)`` as work completes.
    """
    stream = stream or sys.stderr
    if not enabled:
        return _Silent()
    if _is_terminal(stream):
        return _Bar(desc, total, unit=unit, scale=scale, stream=stream)
    return PlainProgress(desc, total, unit=unit, scale=scale)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _interval() -> float:
    value = os.environ.get(INTERVAL_ENV, "30")
    try:
        return max(float(value), 0.0)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={value!r}: expected a number of seconds") from None


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _Reporter:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close(completed=exc[0] is None)


class _Silent(_Reporter):
    def update(self, n: float = 1) -> None:
        pass

    def close(self, completed: bool = True) -> None:
        pass


class _Bar(_Reporter):
    """``tqdm`` with counts divided by ``scale`` (bytes shown as MB); log lines printed while it
    is shown go above it instead of through it."""

    def __init__(self, desc: str, total: float | None, *, unit: str, scale: float, stream):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        bar_format = None
        if total is not None and scale != 1:
            # one decimal for scaled counts (tqdm would print 91.23456789/203.0); the rate
            # always per second (tqdm turns a rate below 1 into s/MB)
            bar_format = (
                "{l_bar}{bar}| {n:.1f}/{total:.1f} {unit} [{elapsed}<{remaining}, {rate_noinv_fmt}]"
            )
        self._redirect = contextlib.ExitStack()
        self._redirect.enter_context(logging_redirect_tqdm())
        # tqdm counts in the caller's units and scales only for display: summed scaled floats
        # overshoot the total. Total and format at construction: tqdm draws its first line there.
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            unit_scale=1 / scale if scale != 1 else False,
            file=stream,
            dynamic_ncols=True,
            bar_format=bar_format,
        )

    def update(self, n: float = 1) -> None:
        self.bar.update(n)

    def close(self, completed: bool = True) -> None:
        self.bar.close()
        self._redirect.close()


class PlainProgress(_Reporter):
    """Log lines with the percentage, rate and ETA, at most one per interval, and a last one."""

    def __init__(self, desc: str, total: float | None, *, unit: str = "it", scale: float = 1.0):
        self.desc, self.total, self.unit, self.scale = desc, total, unit, scale
        self.done = 0.0
        self.interval = _interval()
        self.start = self.last = time.monotonic()

    def update(self, n: float = 1) -> None:
        if not n:
            return
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            logger.info("%s", self.line(now - self.start))

    def line(self, elapsed: float) -> str:
        """``desc: 45% 91.2/203.0 MB | 3.04 MB/s | elapsed 0:00:30 | ETA 0:00:36``."""
        rate = self.done / self.scale / max(elapsed, 1e-9)
        parts = [f"{self.desc}:"]
        if self.total:
            parts.append(f"{100 * self.done / self.total:.0f}%")
            parts.append(f"{self._count(self.done)}/{self._count(self.total)} {self.unit}")
        else:
            parts.append(f"{self._count(self.done)} {self.unit}")
        text = " ".join(parts) + f" | {rate:.3g} {self.unit}/s | elapsed {_clock(elapsed)}"
        if self.total and rate > 0:
            remaining = max(self.total - self.done, 0) / self.scale / rate
            text += f" | ETA {_clock(remaining)}"
        return text

    def _count(self, value: float) -> str:
        return f"{value / self.scale:.1f}" if self.scale != 1 else f"{value:g}"

    def close(self, completed: bool = True) -> None:
        if not completed:
            return
        elapsed = time.monotonic() - self.start
        rate = self.done / self.scale / max(elapsed, 1e-9)
        share = f"{100 * self.done / self.total:.0f}% " if self.total else ""
        total = f"/{self._count(self.total)}" if self.total else ""
        logger.info(
            "%s: %s%s%s %s in %s (%.3g %s/s)",
            self.desc,
            share,
            self._count(self.done),
            total,
            self.unit,
            _clock(elapsed),
            rate,
            self.unit,
        )
