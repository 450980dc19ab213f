"""benchmarks/bench_check.py's comparison (the benchmarks themselves are timings: not in CI)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gate():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "bench_check", os.path.join(REPO, "benchmarks", "bench_check.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_ratio_is_a_regression_only_beyond_the_noise_band_the_way_its_limit_says(gate):
    R, verdict = gate.Ratio, gate.verdict
    time = gate.from_limit(1.00, "<= 1.15")  # up is worse
    assert time.worse == "up" and time.meets_limit()
    assert verdict(time, gate.from_limit(1.09, "<= 1.15")) == "same"  # +9 %: noise
    assert verdict(time, gate.from_limit(1.11, "<= 1.15")) == "REGRESSION"  # +11 %
    assert verdict(time, gate.from_limit(0.85, "<= 1.15")) == "better"
    numeric = gate.from_limit(1.25, 1.3)  # loss_bench writes its limits as numbers: <=
    assert numeric.worse == "up" and numeric.meets_limit()
    # a met limit that is no longer met is a regression even within the noise band
    assert verdict(numeric, gate.from_limit(1.31, 1.3)) == "REGRESSION"
    assert verdict(gate.from_limit(1.31, 1.3), gate.from_limit(1.33, 1.3)) == "same"
    speed = R(1.0, "down")  # ours / HF tokens per second: down is worse
    assert verdict(speed, R(0.85, "down")) == "REGRESSION"
    assert verdict(speed, R(1.2, "down")) == "better"
    planner = gate.from_limit(0.97, "0.9-1.1")  # a range: away from its middle is worse
    assert (planner.worse, planner.centre) == ("away", 1.0)
    assert verdict(planner, gate.from_limit(1.03, "0.9-1.1")) == "same"
    assert verdict(planner, gate.from_limit(0.85, "0.9-1.1")) == "REGRESSION"
    exact = gate.from_limit(0.0, "<= 1e-5")  # near 0: the absolute floor, and the limit
    assert verdict(exact, gate.from_limit(0.01, "<= 1e-5")) == "REGRESSION"
    assert verdict(None, time) == "new"


def test_the_table_marks_regressions_against_a_record_file(gate, tmp_path):
    path = tmp_path / "record.json"
    ratios = {"loss": {"(c)/(a) time": vars(gate.from_limit(1.2, 1.3))}}
    path.write_text(json.dumps({"machine": {"cpu": "x"}, "ratios": ratios}))
    record = gate.load_record(str(path))
    measured = {
        "loss": {"(c)/(a) time": gate.from_limit(1.4, 1.3)},
        "step": {"fused / unfused": gate.from_limit(0.6, "<= 0.9")},
    }
    lines, regressions = gate.table(record, measured)
    assert regressions == 1
    assert "| loss | (c)/(a) time | 1.200 | 1.400 | 1.3 | **REGRESSION** |" in lines
    assert "| step | fused / unfused | - | 0.600 | <= 0.9 | new |" in lines
    assert gate.load_record(str(tmp_path / "none.json")) == {"machine": None, "ratios": {}}
