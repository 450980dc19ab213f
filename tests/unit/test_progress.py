"""Progress of long work as plain lines (no terminal): the CLIP demo following its runs. The
terminal bar and preprocessing's lines are tested in tests/unit/test_preprocess.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

from megatron_tempnet.utils.progress import INTERVAL_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _demo():
    path = os.path.join(REPO, "examples", "clip_digits_demo.py")
    spec = importlib.util.spec_from_file_location("clip_digits_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_clip_demo_follows_a_run_through_its_metrics_file(tmp_path, monkeypatch, caplog):
    metrics = tmp_path / "m.jsonl"
    rows = [{"iteration": i, "loss": 1.0 / i} for i in (10, 20, 30)] + [{"iteration": 30, "v": 1}]
    # a run that logs every 0.4 s (the last line is its validation)
    script = (
        "import json, sys, time\n"
        f"for row in {rows!r}:\n"
        "    time.sleep(0.4)\n"
        f"    open({str(metrics)!r}, 'a').write(json.dumps(row) + '\\n')\n"
    )
    monkeypatch.setenv(INTERVAL_ENV, "0")
    with caplog.at_level(logging.INFO, logger="megatron_tempnet"):
        proc = subprocess.Popen([sys.executable, "-c", script])
        got = _demo().follow(proc, str(metrics), "--clip-loss clip", 30)
    assert got == [json.loads(json.dumps(r)) for r in rows]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1].startswith("--clip-loss clip: 100% 30/30 it in 0:00:0")
    shares = [int(line.split()[2].rstrip("%")) for line in lines[:-1]]
    assert shares == sorted(shares) and set(shares) <= {33, 67, 100} and len(shares) >= 2
    assert all(" it/s | elapsed 0:00:0" in line and "| ETA " in line for line in lines[:-1])
