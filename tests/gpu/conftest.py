"""The GPU acceptance run's rules: where it may run, and its summary.

The ``gpu`` tests are deselected by default (pyproject's ``-m "not gpu"``); ``make gpu-check``
selects them with ``-m gpu``. Without CUDA they are skipped with one reason (unless
``GPU_CHECK_ON_CPU=1`` asks for the CPU smoke run). Each check's wall time is recorded; at the
end of the session the summary tables (``report.py``) are printed, failed checks or not, and,
when ``GPU_CHECK_REPORT`` names a file, written there as markdown.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest

from tests.gpu import harness, report
from tests.gpu.report import check_phase

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if not ours:
        return
    reason = harness.skip_reason()
    if reason is not None:
        for item in ours:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    """Each phase of each test here (pytest calls a directory's conftest for its own tests
    only), for the table of the checks' times. ``report`` is pytest's report of the phase."""
    check_phase(report.nodeid.rsplit("::", 1)[-1], report.when, report.duration, report.outcome)


def _header() -> str:
    import torch

    mode = "CPU smoke run (GPU_CHECK_ON_CPU=1, shrunk sizes)" if harness.on_cpu() else "GPU run"
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    return (
        f"GPU acceptance run ({mode}): {harness.device_name()}, torch {torch.__version__}{cuda}, "
        f"{datetime.date.today().isoformat()}"
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    text = report.markdown()
    if not text:
        return
    text = f"{_header()}\n\n{text}\n"
    terminalreporter.section("gpu-check summary")
    terminalreporter.write(text)
    path = os.environ.get(harness.REPORT_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
        terminalreporter.write_line(f"written to {path}")


@pytest.fixture(autouse=True)
def _compiled_logit_passes(monkeypatch):
    """The GPU run checks the output stage as users run it: its logit passes compiled (Triton),
    not eager as in the rest of the suite (tests/conftest.py)."""
    monkeypatch.setenv("MEGATRON_TEMPNET_COMPILE", "1")
