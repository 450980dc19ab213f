"""Resuming at another layout: a checkpoint of TP 2 x DP 2 (ZeRO 1) continues at TP 1, 4, PP 2,
DP 1, 4 and every ZeRO stage exactly as the uninterrupted run; frozen-LM (TempNet-only)
checkpoints and weights-only conversions too; bad checkpoints stop with what is wrong."""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron_tempnet.trainer.portable import PortableState
from tests.e2e.test_pretrain import _args, _curve, _pretrain
from tests.helpers.corpus import blend_corpus

SAVED = {"tensor-model-parallel-size": 2, "zero-stage": 1}  # on 4 processes: DP 2
NO_EVAL = {"eval-interval": 0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return blend_corpus(str(tmp_path_factory.mktemp("corpus")), vocab_size=512)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """10 iterations straight at TP 2 x DP 2 (ZeRO 1), and the first 5 of them saved."""
    tmp = tmp_path_factory.mktemp("elastic")
    straight, half = tmp / "straight", tmp / "half"
    for d, flags in ((straight, {}), (half, {"exit-interval": 5})):
        _pretrain(4, _args(corpus, tmp, **SAVED, **NO_EVAL, **flags, **{
            "save": d, "metrics-file": d / "m.jsonl"}))  # fmt: skip
    return {"straight": straight, "half": half, "tmp": tmp}


def _final_state(save_dir) -> PortableState:
    tag = (save_dir / "latest").read_text().strip()
    return PortableState(str(save_dir / tag))


def _assert_same_tensors(a: PortableState, b: PortableState, names=None):
    names = names or a.names()
    assert sorted(names) == sorted(n for n in b.names() if n in names)
    for name in names:  # relative error of the tensor (Frobenius): float32 sums in other orders
        x, y = a.full(name).double(), b.full(name).double()
        assert float((x - y).norm()) <= 1e-5 * float(y.norm()), name


def _assert_same_curve(resumed, straight, first: int):
    got = [r for r in resumed if r["iteration"] >= first]
    ref = [r for r in straight if r["iteration"] >= first]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in ref] and got
    for g, r in zip(got, ref):
        for key in ("loss", "tau_mean", "grad_norm"):
            assert g[key] == pytest.approx(r[key], rel=1e-5), (g["iteration"], key)
        assert g["consumed_samples"] == r["consumed_samples"]


RESUME_AT = {  # name: (processes, flags)
    "tp1-dp1": (1, {"zero-stage": 0}),
    "tp1-dp4-zero2": (4, {"zero-stage": 2}),
    "pp2-dp2-zero1": (4, {"pipeline-model-parallel-size": 2, "zero-stage": 1}),
    "tp2-pp2": (4, {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2}),
    "tp4-zero0": (4, {"tensor-model-parallel-size": 4, "zero-stage": 0}),
    "tp4-zero3": (4, {"tensor-model-parallel-size": 4, "zero-stage": 3}),
}


@pytest.mark.parametrize("layout", list(RESUME_AT))
def test_a_checkpoint_resumes_at_another_layout_exactly(runs, corpus, tmp_path, layout):
    nproc, flags = RESUME_AT[layout]
    run = tmp_path / "run"
    shutil.copytree(runs["half"], run)
    out = _pretrain(nproc, _args(corpus, runs["tmp"], **NO_EVAL, **flags, **{
        "load": run, "save": run, "metrics-file": tmp_path / "m.jsonl"}))  # fmt: skip
    assert "resharding from TP 2 x PP 1 x DP 2 (ZeRO 1) to" in out.stderr
    assert "RNG streams are not carried across a layout change" in out.stderr
    _assert_same_curve(_curve(tmp_path / "m.jsonl"), _curve(runs["straight"] / "m.jsonl"), 6)
    _assert_same_tensors(_final_state(run), _final_state(runs["straight"]))
