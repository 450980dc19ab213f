"""Checkpoints of the earlier format (DeepSpeed's files and ``portable/``, made by the code of
commit a74cade: ``tests/fixtures/make_checkpoint_v1.py``): refused with the command that
upgrades them; upgraded, a training checkpoint resumes exactly as the run that saved it went
on, and a conversion's weights are the ones it was made from."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megatron_tempnet.inference.checkpoint_io import CheckpointReader
from tests.helpers.checkpoints import global_tensors, train_state
from tests.helpers.corpus import blend_corpus
from tests.helpers.entry_points import run_entry_point, run_program

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "checkpoint_v1")
TIMING = ("tokens_per_sec", "memory_mb")


def _expected(name: str) -> dict:
    return torch.load(os.path.join(FIXTURES, name, "expected_tensors.pt"), weights_only=True)


def _flags(spec: dict, corpus: str, load, metrics) -> list[str]:
    values = {
        "{corpus}": corpus,
        "{save}": str(load),
        "{load}": str(load),
        "{metrics}": str(metrics),
    }
    flags = [values.get(a, a) for a in spec["flags"] + spec["resume_flags"]]
    return [next((a.replace(k, v) for k, v in values.items() if k in a), a) for a in flags]


def _upgrade(*args) -> str:
    r = run_program("tools/checkpoint/upgrade.py", [str(a) for a in args], 0)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture
def train(tmp_path):
    """A copy of the earlier format's training checkpoint (iteration 2 of 4, DP 2, ZeRO 1)."""
    shutil.copytree(os.path.join(FIXTURES, "train"), tmp_path / "train")
    return tmp_path / "train"


def test_an_upgraded_training_checkpoint_resumes_exactly(train, tmp_path):
    spec = json.load(open(train / "expected.json"))
    os.makedirs(tmp_path / "corpus")
    blend_corpus(str(tmp_path / "corpus"), vocab_size=512)
    corpus = str(tmp_path / "corpus")
    metrics = tmp_path / "m.jsonl"
    refused = run_entry_point(
        "pretrain_gpt.py", 2, _flags(spec, corpus, train, metrics), check=False
    )
    assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (
        f"is in the earlier checkpoint format (DeepSpeed's files and portable/): convert it once "
        f"with: python tools/checkpoint/upgrade.py {train}" in refused.stderr
    )
    assert "upgraded" in _upgrade(train)
    expected = _expected("train")
    got = global_tensors(train)
    keys = {"weight": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    want = [f"{v}/{n}" for n, t in expected["tensors"].items() for v, k in keys.items() if k in t]
    assert sorted(got) == sorted(want)
    for name, t in expected["tensors"].items():
        assert torch.equal(got[f"weight/{name}"], t["param"]), name
        assert all(
            torch.equal(got[f"{m}/{name}"], t[m]) for m in ("exp_avg", "exp_avg_sq") if m in t
        )
    state = train_state(train)
    assert (state["iteration"], state["step"], state["data"]) == (2, 2, expected["data"])
    # as the fixture's runs were made: without the device rule, whose mode runs torch.compile'd
    # functions as plain Python (the same numbers, up to float32 rounding)
    run_entry_point("pretrain_gpt.py", 2, _flags(spec, corpus, train, metrics), device_rule=False)
    rows = [json.loads(line) for line in open(metrics)]
    resumed = [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    straight = spec["straight_metrics"][2:]  # iterations 3 and 4
    assert [sorted(r) for r in resumed] == [sorted(r) for r in straight]
    exact = ("iteration", "tokens", "lr", "tempnet_lr", "consumed_samples", "global_batch_size")
    for got_row, want_row in zip(resumed, straight, strict=True):
        assert {k: got_row[k] for k in exact} == {k: want_row[k] for k in exact}
        # the losses, tau's statistics and the norm: the same up to float32 rounding, as the
        # fused stage now forms TempNet's first product through the output weight (the same
        # sums in another order than the fixture's code)
        assert got_row == pytest.approx(want_row, rel=1e-5, abs=1e-9)


def test_an_upgraded_conversion_holds_the_converted_weights(tmp_path):
    out = tmp_path / "upgraded"
    _upgrade(os.path.join(FIXTURES, "converted"), "--save", out)
    reader = CheckpointReader(str(out))
    expected = _expected("converted")
    expected = expected.get("tensors", expected)
    names = {n.removeprefix("lm.") for n in expected}
    assert set(reader.names()) == names
    for name, tensor in expected.items():
        assert torch.equal(reader.full(name.removeprefix("lm.")), tensor), name
