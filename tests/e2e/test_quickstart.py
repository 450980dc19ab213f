"""The README's CPU quickstart, run as a user runs it: TP = 2 under torchrun and one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30


def _run(tmp_path, launcher, name):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [
        *launcher,
        str(ROOT / "examples" / "quickstart.py"),
        "--steps",
        str(STEPS),
        "--log-interval",
        "5",
        "--metrics-file",
        str(metrics),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quickstart finished: 30 steps" in proc.stdout + proc.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quickstart")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    return {"tp2": _run(tmp, torchrun, "tp2"), "tp1": _run(tmp, [sys.executable], "tp1")}


def test_quickstart_learns(runs):
    curve = runs["tp2"]
    assert [m["step"] for m in curve] == [1, 5, 10, 15, 20, 25, 30]
    assert curve[-1]["ce_loss"] < curve[0]["ce_loss"] - 1.0  # from ~log(256) = 5.5
    assert curve[-1]["dro_loss"] < curve[0]["dro_loss"]
    for m in curve:
        assert 0.001 <= m["tau_min"] <= m["tau_mean"] <= m["tau_max"] <= 2.0


def test_tensor_parallel_run_matches_single_process(runs):
    for a, b in zip(runs["tp2"], runs["tp1"]):
        for key in ("dro_loss", "ce_loss", "tau_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-3), (a["step"], key)
