"""--rampup-batch-size and --train-samples in pretrain_gpt.py runs: each iteration takes the
ramp's global batch (Megatron-LM's formula), the loss of every iteration is that of runs that use
those batch sizes by hand, and a run stopped mid-ramp resumes exactly (the data position, the
batch, the learning rate of a warm-up + cosine schedule), on a pipeline too."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.corpus import data_flags
from tests.helpers.entry_points import cli_flags, run_entry_point


def _args(corpus, tmp, **flags) -> list[str]:
    base = {
        "model": "tiny",
        **data_flags(corpus["spec"], corpus["prefix"]["A"], 32),
        "max-position-embeddings": 32,
        "micro-batch-size": 2,
        "log-interval": 1,
        "eval-interval": 0,
        "loss": "ce",
        "tau-source": "fixed",
        "lr": 1e-3,
        "data-cache-path": str(tmp / "cache"),
        "seed": 5,
        "num-workers": 0,
        "metrics-file": str(tmp / f"{flags.pop('name')}.jsonl"),
    }
    ramp = flags.pop("rampup-batch-size", None)  # three values
    return cli_flags(base, **flags) + ([] if ramp is None else ["--rampup-batch-size", *ramp])


def _rows(tmp, name: str) -> list[dict]:
    with open(tmp / f"{name}.jsonl") as f:
        return [row for row in map(json.loads, f) if "loss" in row]


# 4 4 8 up to 8 on 2 data-parallel ranks of 2 samples: 8 samples per increment; the batches are
# 4, 4 (to 8 consumed), then 8: one micro-batch per rank, then two
RAMP = {"rampup-batch-size": ("4", "4", "8"), "global-batch-size": 8, "train-samples": 40}
BATCHES = [4, 4, 8, 8, 8, 8]  # 40 samples


def test_a_ramp_equals_its_batches_run_by_hand(corpus, tmp_path):
    constant = {"lr-decay-style": "constant"}
    saves = tmp_path / "ramp"
    run_entry_point(
        "pretrain_gpt.py",
        2,
        _args(corpus, tmp_path, name="ramp", **RAMP, **constant, save=str(saves)),
    )
    ramp = _rows(tmp_path, "ramp")
    assert [r["global_batch_size"] for r in ramp] == BATCHES
    assert [r["consumed_samples"] for r in ramp] == [4, 8, 16, 24, 32, 40]
    # Megatron-LM's rule: a checkpoint before the number of micro-batches changes, and at the end
    assert sorted(p.name for p in saves.glob("iter_*")) == ["iter_0000002", "iter_0000006"]
    # by hand: two iterations of 4 samples, saved; then four of 8 from there
    save = str(tmp_path / "by-hand")
    first = {"global-batch-size": 4, "train-iters": 2, "save": save, **constant}
    run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp_path, name="first", **first))
    # another --train-iters and batch: another decay length (moot at a constant lr), which
    # Megatron-LM's rule refuses on resume unless told whose schedule to keep
    then = {"global-batch-size": 8, "train-iters": 6, "load": save, **constant}
    then["override-opt-param-scheduler"] = True
    run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp_path, name="then", **then))
    by_hand = _rows(tmp_path, "first") + _rows(tmp_path, "then")
    assert [r["consumed_samples"] for r in by_hand] == [r["consumed_samples"] for r in ramp]
    for got, want in zip(ramp, by_hand, strict=True):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], got
        assert got["tokens"] == want["tokens"] and got["lr"] == want["lr"] == 1e-3


def test_a_run_stopped_mid_ramp_resumes_exactly_on_a_pipeline(corpus, tmp_path):
    """The whole run on 2 data-parallel ranks; the same run on 2 pipeline stages, stopped after
    iteration 2 (before the batch grows) and resumed: the same batches, data, losses and
    learning rates (warm-up over 12 samples, then cosine over the run's 40)."""
    schedule = {"lr-decay-style": "cosine", "lr-warmup-samples": 12, "min-lr": 1e-4}
    run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp_path, name="whole", **RAMP, **schedule))
    whole = _rows(tmp_path, "whole")
    assert [r["global_batch_size"] for r in whole] == BATCHES
    pp = {"pipeline-model-parallel-size": 2, "save": str(tmp_path / "pp"), **RAMP, **schedule}
    run_entry_point(
        "pretrain_gpt.py", 2, _args(corpus, tmp_path, name="part1", **pp, **{"exit-interval": 2})
    )
    run_entry_point(
        "pretrain_gpt.py", 2, _args(corpus, tmp_path, name="part2", **pp, load=str(tmp_path / "pp"))
    )
    resumed = _rows(tmp_path, "part1") + _rows(tmp_path, "part2")
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    peak, floor = 1e-3, 1e-4
    lrs = [peak * 0 / 12, peak * 4 / 12, peak * 8 / 12]  # the warm-up: 0, 4 and 8 samples
    for samples in (16, 24, 32):  # then the cosine from 12 to 40 samples
        lrs.append(floor + (peak - floor) * (1 + math.cos(math.pi * (samples - 12) / 28)) / 2)
    for got, want, lr in zip(resumed, whole, lrs, strict=True):
        for key in ("global_batch_size", "consumed_samples", "tokens"):
            assert got[key] == want[key], (key, got, want)
        assert got["lr"] == want["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-18)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
