"""Resuming at another layout: a checkpoint of TP 2 x DP 2 (ZeRO 1) continues at TP 1, 4, PP 2,
DP 1, 4 and every ZeRO stage exactly as the uninterrupted run; frozen-LM (TempNet-only)
checkpoints and weights-only conversions too; bad checkpoints stop with what is wrong."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.e2e.test_pretrain import _args as _pretrain_args
from tests.e2e.test_pretrain import _curve, _pretrain
from tests.helpers.checkpoints import global_tensors, weights
from tests.helpers.corpus import blend_corpus


def _args(corpus, tmp, **flags) -> list[str]:
    """pretrain_gpt.py's test flags with AdamW's epsilon at 1e-4: the key part of the qkv bias
    has no gradient (the softmax over keys ignores it), and with 1e-8 AdamW turns the float32
    noise of that zero, which depends on the summation order of the layout, into steps of +-lr;
    1e-4 keeps every tensor's difference between layouts at float32 rounding."""
    return _pretrain_args(corpus, tmp, **{"adam-eps": 1e-4, **flags})


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
        _pretrain(
            4,
            _args(
                corpus,
                tmp,
                **SAVED,
                **NO_EVAL,
                **flags,
                **{"save": d, "metrics-file": d / "m.jsonl"},
            ),
        )
    return {"straight": straight, "half": half, "tmp": tmp}


def _final_state(save_dir) -> dict[str, torch.Tensor]:
    """The newest checkpoint's full tensors: ``weight/{name}`` (the float32 master where one was
    saved) and AdamW's moments ``exp_avg/{name}``, ``exp_avg_sq/{name}``."""
    state = {f"weight/{name}": t for name, t in weights(save_dir).items()}
    for moment in ("exp_avg/", "exp_avg_sq/"):
        state.update(global_tensors(save_dir, prefix=moment))
    return state


def _assert_same_tensors(a: dict, b: dict, names=None):
    names = names or list(a)
    assert sorted(names) == sorted(n for n in b if n in names)
    for name in names:  # relative error of the tensor (Frobenius): float32 sums in other orders
        x, y = a[name].double(), b[name].double()
        assert x.shape == y.shape, name
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
    out = _pretrain(
        nproc,
        _args(
            corpus,
            runs["tmp"],
            **NO_EVAL,
            **flags,
            **{"load": run, "save": run, "metrics-file": tmp_path / "m.jsonl"},
        ),
    )
    assert "resharded from TP 2 x PP 1 x DP 2 (ZeRO 1) to" in out.stderr
    assert "RNG streams are not carried across a layout change" in out.stderr
    _assert_same_curve(_curve(tmp_path / "m.jsonl"), _curve(runs["straight"] / "m.jsonl"), 6)
    _assert_same_tensors(_final_state(run), _final_state(runs["straight"]))


def test_finetune_reads_a_checkpoint_of_another_layout(runs, corpus, tmp_path):
    """--finetune at TP 1 from the TP 2 x DP 2 checkpoint: the same run as at TP 2 x DP 2."""
    curves = []
    for nproc, flags in ((4, SAVED), (1, {"zero-stage": 0})):
        metrics = tmp_path / f"{nproc}.jsonl"
        out = _pretrain(
            nproc,
            _args(
                corpus,
                runs["tmp"],
                **NO_EVAL,
                **flags,
                **{
                    "load": runs["half"],
                    "finetune": True,
                    "train-iters": 2,
                    "metrics-file": metrics,
                },
            ),
        )
        # the weights are read (layout-free) at either layout: not two runs from scratch
        assert f"loaded weights from {runs['half'] / 'iter_0000005'} (--finetune --load)" in (
            out.stderr
        )
        curves.append(_curve(metrics))
    _assert_same_curve(curves[1], curves[0], 1)


@pytest.fixture(scope="module")
def frozen_runs(corpus, tmp_path_factory):
    """An LM (2 iterations, CE) converted to a weights-only checkpoint at TP 2; TempNet on it,
    frozen, 6 iterations straight at TP 2 (--freeze-lm --pretrained-checkpoint)."""
    from megatron_tempnet.inference.checkpoint_io import CheckpointReader, write_checkpoint

    tmp = tmp_path_factory.mktemp("frozen")
    trained = tmp / "trained"
    _pretrain(
        1,
        _args(
            corpus,
            tmp,
            **NO_EVAL,
            save=trained,
            loss="ce",
            **{"tau-source": "fixed", "train-iters": 2},
        ),
    )
    reader = CheckpointReader(str(trained))
    lm = tmp / "lm"
    write_checkpoint(str(lm), reader.model, reader.full, tensor_parallel=2)
    straight = tmp / "straight"
    _frozen(corpus, tmp, 2, straight, lm, {"tensor-model-parallel-size": 2})
    return {"tmp": tmp, "lm": lm, "straight": straight}


def _frozen(corpus, tmp, nproc, run, lm, flags):
    return _pretrain(
        nproc,
        _args(
            corpus,
            tmp,
            **NO_EVAL,
            **flags,
            **{
                "freeze-lm": True,
                "pretrained-checkpoint": lm,
                "load": run,
                "save": run,
                "train-iters": 6,
                "metrics-file": run / "m.jsonl",
            },
        ),
    )


@pytest.mark.parametrize(
    "saved,resumed",
    [({"pipeline-model-parallel-size": 2}, {}), ({"tensor-model-parallel-size": 2}, {})],
    ids=["pp2-to-pp1", "tp2-to-tp1"],
)
def test_a_frozen_lm_checkpoint_resumes_at_another_layout(frozen_runs, corpus, saved, resumed):
    """TempNet-only checkpoints (the LM re-read from a weights-only conversion at TP 2, itself
    resharded for PP 2 and TP 1) continue exactly at another layout."""
    tmp, lm = frozen_runs["tmp"], frozen_runs["lm"]
    run = tmp / "-".join(f"{k}{v}" for k, v in saved.items())
    _frozen(corpus, tmp, 2, run, lm, {**saved, "exit-interval": 3})
    assert (run / "iter_0000003" / "FROZEN_LM_EXCLUDED").exists()
    out = _frozen(corpus, tmp, 1, run, lm, resumed)
    tp, pp = (
        saved.get("tensor-model-parallel-size", 1),
        saved.get("pipeline-model-parallel-size", 1),
    )
    # the frozen LM is read again from the conversion (written for TP 2) at TP 1 x PP 1
    assert f"the frozen LM: loading --pretrained-checkpoint {lm}" in out.stderr
    assert f"loaded weights from {lm / 'iter_0000000'} (--pretrained-checkpoint)" in out.stderr
    assert f"--load {run}: resharded from TP {tp} x PP {pp} x DP 1" in out.stderr
    straight = frozen_runs["straight"]
    _assert_same_curve(_curve(run / "m.jsonl"), _curve(straight / "m.jsonl"), 4)
    a, b = _final_state(run), _final_state(straight)
    assert a and all(n.split("/", 1)[1].startswith("tempnet.") for n in a)  # no frozen LM
    _assert_same_tensors(a, b)


def test_a_zero3_checkpoint_exports_like_a_zero1_one(runs, corpus, tmp_path):
    """The same weights saved by ZeRO 3 (--finetune --lr 0 for one iteration: nothing moves)
    export to Hugging Face and to a TempNet file exactly as the ZeRO-1 checkpoint does."""
    from tests.e2e.test_hf_interop import tool
    from tests.helpers.hf_models import load_hf

    zero3 = tmp_path / "zero3"
    _pretrain(
        4,
        _args(
            corpus,
            runs["tmp"],
            **NO_EVAL,
            **{
                "tensor-model-parallel-size": 2,
                "zero-stage": 3,
                "load": runs["half"],
                "finetune": True,
                "train-iters": 1,
                "lr": 0.0,
                "min-lr": 0.0,
                "save": zero3,
            },
        ),
    )
    # ZeRO-3's partitions saved the same weights as ZeRO 1's fragments
    zero1_weights = global_tensors(runs["half"], prefix="weight/")
    _assert_same_tensors(global_tensors(zero3, prefix="weight/"), zero1_weights)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, tempnets = [], []
    for name, ckpt in (("zero1", runs["half"]), ("zero3", zero3)):
        hf = tmp_path / f"{name}-hf"
        tool("checkpoint/convert_megatron_to_hf.py", "--load", ckpt, "--save", hf)
        with torch.no_grad():
            logits.append(load_hf(str(hf))(tokens).logits)
        tool("export_tempnet.py", "--load", ckpt, "--output", tmp_path / f"{name}-tempnet")
        files = sorted((tmp_path / f"{name}-tempnet").iterdir())
        tempnets.append({f.name: f.read_bytes() for f in files if f.suffix != ".json"})
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
    assert tempnets[0] and tempnets[0] == tempnets[1]  # byte for byte


def _listing(directory) -> dict:
    return {str(p): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "case",
    ["tempnet-size", "model-shape", "global-batch", "truncated-file", "missing-shard-file"],
)
def test_bad_checkpoints_stop_with_what_is_wrong_and_save_nothing(runs, corpus, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(runs["half"], run)
    tag = run / "iter_0000005"
    nproc, flags, message = 1, {"zero-stage": 0}, None
    if case == "tempnet-size":  # at another layout
        flags["tempnet-hidden-size"] = 16
        message = "tensor tempnet.weight1 is (32, 512) in the checkpoint and (16, 512) in this"
    elif case == "model-shape":  # at the layout that saved it (DeepSpeed's load never starts)
        nproc, flags = 4, {**SAVED, "ffn-hidden-size": 96}
        message = (
            "lm.pieces.2.layer.mlp.linear_fc1.weight is (256, 64) in the checkpoint and (96, 64) in"
        )
    elif case == "global-batch":
        flags["global-batch-size"] = 16
        message = "saved with --global-batch-size 8, this run has 16"
    elif case == "truncated-file":
        data = (tag / "shards" / "rank00001.bin").read_bytes()
        (tag / "shards" / "rank00001.bin").write_bytes(data[: len(data) // 2])
        message = f"{tag / 'shards' / 'rank00001.bin'} is truncated or altered"
    else:
        (tag / "shards" / "rank00001.bin").unlink()
        message = f"{tag / 'shards' / 'rank00001.bin'} is missing (recorded in COMPLETE)"
    before = _listing(run)
    out = _pretrain(
        nproc,
        _args(corpus, runs["tmp"], **NO_EVAL, **flags, **{"load": run, "save": run}),
        check=False,
    )
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert _listing(run) == before  # --save (the same directory) untouched
