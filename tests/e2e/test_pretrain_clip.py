"""pretrain_clip.py end to end under torchrun, on scikit-learn's digits with template captions:
DP = 2 equals DP = 1 for every --clip-loss, TP = 2 equals TP = 1, exact resume with the
per-sample state, clear errors for bad flags and bad data."""

from __future__ import annotations

import functools
import json
import os
import re
import sys

import pytest
import torch

from tests.helpers import device_rules
from tests.helpers.checkpoints import (
    checkpoint_path,
    global_tensors,
    rank_state,
    train_state,
    weights,
)
from tests.helpers.corpus import digits_pairs
from tests.helpers.entry_points import cli_flags, run_command, run_entry_point
from tests.helpers.hf_models import hf_clip_config
from tests.helpers.wandb_run import read_offline_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSSES = ("clip", "sogclr", "isogclr", "tempnet", "tau")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    paths = digits_pairs(str(tmp_path_factory.mktemp("digits")), "data")
    # 48 training pairs: 6 global batches of 8 per epoch, so the per-sample state is read back
    # (second epoch) within the tests' 10-20 iterations
    with open(paths["test"]) as f:
        lines = f.readlines()
    small = os.path.join(os.path.dirname(paths["test"]), "small.csv")
    with open(small, "w") as f:
        f.writelines(lines[:49])
    return {**paths, "small": small}


def _args(digits, tmp, **flags) -> list[str]:
    base = {
        "train-data": digits["small"],
        "valid-data": digits["test"],
        "label-key": "label",
        "tokenizer-type": "SentencePieceTokenizer",
        "tokenizer-model": digits["tokenizer"],
        "embed-dim": 32,
        "vision-hidden-size": 32,
        "text-hidden-size": 32,
        "train-iters": 10,
        "micro-batch-size": 8,
        "global-batch-size": 8,
        "log-interval": 1,
        "eval-interval": 0,
        "tempnet-proj-size": 16,
        "lr": 2e-3,
        "tau-init": 0.03,
        "tempnet-lr": 1e-3,
        "isogclr-tau-lr": 0.002,
        "seed": 5,
        "metrics-file": str(tmp / "metrics.jsonl"),
        "image-mean": 0.5,
        "image-std": 0.5,
        "zeroshot-templates": "a handwritten digit {}",
    }
    return cli_flags(base, **flags)


_pretrain = functools.partial(run_entry_point, "pretrain_clip.py")
"""pretrain_clip.py on ``nproc`` ranks, under the device rule (``run_entry_point``)."""


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _curve(path) -> list[dict]:
    return [row for row in _rows(path) if "loss" in row]


def _assert_same_curve(got: list[dict], expected: list[dict], rtol: float) -> None:
    assert len(got) == len(expected) == 10
    for a, b in zip(got, expected):
        for key in ("loss", "tau_mean", "tau_min", "tau_max", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=rtol, abs=1e-7), (a["iteration"], key)


@pytest.mark.parametrize("loss", LOSSES)
def test_dp2_equals_dp1_and_training_moves(digits, tmp_path, loss):
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    one.mkdir(), two.mkdir()
    ood = digits["test_5-9"] if loss in ("tau", "tempnet") else None
    # read in the training process at DP 1, by two loader workers per rank at DP 2
    _pretrain(1, _args(digits, one, **{"clip-loss": loss, "ood-data": ood, "num-workers": 0}))
    _pretrain(2, _args(digits, two, **{"clip-loss": loss, "micro-batch-size": 4, "ood-data": ood}))
    expected, got = _curve(one / "metrics.jsonl"), _curve(two / "metrics.jsonl")
    _assert_same_curve(got, expected, rtol=1e-4)
    assert expected[-1]["loss"] < expected[0]["loss"]
    if loss == "tempnet":  # TempNet's own learning rate (--tempnet-lr 1e-3, --lr 2e-3) is logged
        assert all(r["tempnet_lr"] == pytest.approx(r["lr"] / 2) for r in expected)
    final = [r for r in _rows(one / "metrics.jsonl") if "val_ir@1" in r]
    assert len(final) == 1 and final[0]["iteration"] == 10  # evaluated at the end
    final_dp2 = [r for r in _rows(two / "metrics.jsonl") if "val_ir@1" in r][0]
    for key in ("val_ir@1", "val_tr@5", "val_zeroshot_top1"):
        assert final_dp2[key] == pytest.approx(final[0][key], abs=0.6)  # <= 2 rank flips
    if ood:  # the temperature's OOD AUROC is reported in both layouts; after 10 steps the
        # predicted taus are nearly tied, so 1e-6 differences may swap a few pairs
        for key in ("val_ood_auroc_image", "val_ood_auroc_text"):
            assert 0 <= final[0][key] <= 1
            assert final_dp2[key] == pytest.approx(final[0][key], abs=0.05)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_stages_equal_dp1(digits, tmp_path, zero_stage):
    """ZeRO-2/3 at DP = 2 (TempNet in its own parameter group; with ZeRO-3 the towers'
    weights are partitioned, also for the evaluation's encoding) equal one process."""
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    one.mkdir(), two.mkdir()
    flags = {"clip-loss": "tempnet", "ood-data": digits["test_5-9"]}
    _pretrain(1, _args(digits, one, **flags))
    _pretrain(2, _args(digits, two, **{**flags, "micro-batch-size": 4, "zero-stage": zero_stage}))
    _assert_same_curve(_curve(two / "metrics.jsonl"), _curve(one / "metrics.jsonl"), rtol=1e-4)
    final = [[r for r in _rows(d / "metrics.jsonl") if "val_ir@1" in r] for d in (one, two)]
    assert len(final[0]) == len(final[1]) == 1
    for key in ("val_ir@1", "val_tr@5", "val_zeroshot_top1"):
        assert final[1][0][key] == pytest.approx(final[0][0][key], abs=0.6), key  # 2 flips
    for key in ("val_tau_image_mean", "val_tau_text_mean"):
        assert final[1][0][key] == pytest.approx(final[0][0][key], rel=1e-4), key
    for key in ("val_ood_auroc_image", "val_ood_auroc_text"):  # see the DP test above
        assert final[1][0][key] == pytest.approx(final[0][0][key], abs=0.05), key


@pytest.mark.parametrize("loss", ["tempnet", "isogclr"])
def test_tp2_equals_tp1(digits, tmp_path, loss):
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    one.mkdir(), two.mkdir()
    # the padded vocabulary is 128 in both layouts, so both start from the same weights
    _pretrain(1, _args(digits, one, **{"clip-loss": loss, "make-vocab-size-divisible-by": 128}))
    _pretrain(
        2,
        _args(
            digits,
            two,
            **{
                "clip-loss": loss,
                "tensor-model-parallel-size": 2,
                "make-vocab-size-divisible-by": 64,
            },
        ),
    )
    _assert_same_curve(_curve(two / "metrics.jsonl"), _curve(one / "metrics.jsonl"), rtol=1e-4)


# two accumulated micro-batches of 8 per iteration; augmented images
PP_FLAGS = {"global-batch-size": 16, "micro-batch-size": 8, "zero-stage": 1, "image-augment": True}


@pytest.fixture(scope="module")
def one_process_curves(digits, tmp_path_factory):
    """Every loss in one process, the images read in the training process (no loader workers;
    every other run has the default two per rank)."""

    def curve(loss: str) -> list[dict]:
        run = tmp_path_factory.mktemp(f"pp1-{loss}")
        _pretrain(1, _args(digits, run, **{**PP_FLAGS, "clip-loss": loss, "num-workers": 0}))
        return _rows(run / "metrics.jsonl")

    return {loss: curve(loss) for loss in LOSSES}


def _tensors(obj, prefix: str = "") -> dict:
    """Every tensor in a loaded checkpoint file, by its path in the nested dicts/lists."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = (
        obj.items()
        if isinstance(obj, dict)
        else enumerate(obj)
        if isinstance(obj, list | tuple)
        else ()
    )
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def _ranks(save_dir, tag: str) -> int:
    """How many ranks saved checkpoint ``tag`` (one RNG and task state file each)."""
    files = os.listdir(checkpoint_path(save_dir, tag))
    return sum(re.fullmatch(r"rng_rank\d+\.pt", f) is not None for f in files)


def _assert_same_checkpoint(a, b, tag: str) -> None:
    """Checkpoint ``tag`` of two save directories holds the same tensors, bit for bit: every
    global tensor (weights, masters, AdamW's moments) and every rank's RNG and task state."""
    x, y = global_tensors(a, tag), global_tensors(b, tag)
    assert x.keys() == y.keys() and x
    for key in x:
        assert torch.equal(x[key], y[key]), key
    ranks = _ranks(a, tag)
    assert ranks == _ranks(b, tag) and ranks
    compared = 0
    for rank in range(ranks):
        x, y = (_tensors(rank_state(d, rank, tag)) for d in (a, b))
        assert x.keys() == y.keys(), rank
        for key in x:
            assert torch.equal(x[key], y[key]), (rank, key)
        compared += len(x)
    assert compared > 0


@pytest.mark.parametrize("loss", LOSSES)
def test_pp2_equals_pp1(digits, tmp_path, one_process_curves, loss):
    """Two stages (each with one vision and one text layer) equal one process over 10
    iterations of two micro-batches, and so does the evaluation at the end; iSogCLR's run
    (per-sample state on the last stage) resumed at iteration 5 is bit-exact."""
    flags = {**PP_FLAGS, "clip-loss": loss, "pipeline-model-parallel-size": 2}
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    _pretrain(2, _args(digits, straight, **flags, save=straight / "ckpt"))
    rows, expected = _rows(straight / "metrics.jsonl"), one_process_curves[loss]
    _assert_same_curve(
        [r for r in rows if "loss" in r], [r for r in expected if "loss" in r], rtol=1e-4
    )
    final = [[r for r in x if "val_ir@1" in r][0] for x in (rows, expected)]
    for key in ("val_ir@1", "val_tr@5", "val_zeroshot_top1"):
        assert final[0][key] == pytest.approx(final[1][key], abs=0.6), key
    if loss != "isogclr":
        return
    resume = {**flags, "save": split / "ckpt", "load": split / "ckpt"}
    _pretrain(2, _args(digits, split, **resume, **{"exit-interval": 5}))
    _pretrain(2, _args(digits, split, **resume))
    a, b = _curve(straight / "metrics.jsonl"), _curve(split / "metrics.jsonl")
    assert [r["iteration"] for r in b] == list(range(1, 11))
    for x, y in zip(a, b):
        for key in ("loss", "tau_mean", "tau_min", "tau_max", "grad_norm"):
            assert x[key] == y[key], (x["iteration"], key)
    tag = "iter_0000010"
    _assert_same_checkpoint(straight / "ckpt", split / "ckpt", tag)
    last_stage = rank_state(straight / "ckpt", 1, tag)
    assert last_stage["rank_state"]["sample_state"]["seen"].sum() == 48  # every pair, stage 2


def test_loader_workers_give_the_same_run(digits, tmp_path, one_process_curves):
    """Augmented images decoded by two loader workers (the default) give the run of the
    training process reading them itself, evaluation included, to the last bit; Weights &
    Biases (offline) records the same numbers."""
    wandb = {"wandb-project": "clip", "wandb-save-dir": tmp_path / "wb"}
    _pretrain(
        1,
        _args(digits, tmp_path, **{**PP_FLAGS, "clip-loss": "tempnet", **wandb}),
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    expected, got = one_process_curves["tempnet"], _rows(tmp_path / "metrics.jsonl")
    run = read_offline_run(str(tmp_path / "wb"))
    assert run["project"] == "clip" and run["config"]["loss"]["clip_loss"] == "tempnet"
    logged = [r for r in run["history"] if "loss/loss" in r]
    assert [r["loss/loss"] for r in logged] == [r["loss"] for r in got if "loss" in r]
    assert [r["tau/mean"] for r in logged] == [r["tau_mean"] for r in got if "loss" in r]
    validated = [r for r in run["history"] if "validation/ir@1" in r]
    assert [r["validation/ir@1"] for r in validated] == [
        r["val_ir@1"] for r in got if "val_ir@1" in r
    ]
    keys = [k for k in expected[0] if k not in ("samples_per_sec", "memory_mb")]
    assert len(got) == len(expected) and any("val_ir@1" in r for r in got)
    for a, b in zip(got, expected):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
        assert {k for k in a if k.startswith("val_")} == {k for k in b if k.startswith("val_")}
        for k in (k for k in a if k.startswith("val_")):
            assert a[k] == b[k], k


def test_a_pp2_checkpoint_resumes_in_one_process(digits, tmp_path, one_process_curves):
    """iSogCLR: 5 iterations at PP 2, then 5 more in one process (the layout-free copy and the
    last stage's per-sample state): the one-process curve within 1e-4."""
    flags = {
        **PP_FLAGS,
        "clip-loss": "isogclr",
        "save": tmp_path / "ckpt",
        "load": tmp_path / "ckpt",
    }
    _pretrain(
        2,
        _args(digits, tmp_path, **flags, **{"pipeline-model-parallel-size": 2, "exit-interval": 5}),
    )
    r = _pretrain(1, _args(digits, tmp_path, **flags))
    assert "resharded from TP 1 x PP 2 x DP 1" in r.stdout + r.stderr
    got = _curve(tmp_path / "metrics.jsonl")
    assert [x["iteration"] for x in got] == list(range(1, 11))
    _assert_same_curve(got, [r for r in one_process_curves["isogclr"] if "loss" in r], rtol=1e-4)


@pytest.mark.parametrize("loss", LOSSES)
def test_tp2_pp2_equals_tp1(digits, tmp_path, one_process_curves, loss):
    """TP 2 x PP 2: the TP 1 curve (the same padded vocabulary of 128)."""
    _pretrain(
        4,
        _args(
            digits,
            tmp_path,
            **PP_FLAGS,
            **{
                "clip-loss": loss,
                "pipeline-model-parallel-size": 2,
                "tensor-model-parallel-size": 2,
                "make-vocab-size-divisible-by": 64,
            },
        ),
    )
    rows, expected = _rows(tmp_path / "metrics.jsonl"), one_process_curves[loss]
    _assert_same_curve(
        [r for r in rows if "loss" in r], [r for r in expected if "loss" in r], rtol=1e-4
    )
    final = [[r for r in x if "val_ir@1" in r][0] for x in (rows, expected)]
    assert final[0]["val_ir@1"] == pytest.approx(final[1]["val_ir@1"], abs=0.6)
    if "val_tau_image_mean" in final[1]:  # the losses that predict a tau
        assert final[0]["val_tau_image_mean"] == pytest.approx(
            final[1]["val_tau_image_mean"], rel=1e-4
        )


@pytest.mark.parametrize("loss", ["isogclr", "tempnet"])
def test_gradient_accumulation_at_dp1_equals_dp2(digits, tmp_path, one_process_curves, loss):
    """Global batch 16 as two contrastive batches of 8 (positions 0-7, then 8-15) whose
    gradients are accumulated: one process with micro-batches of 8 equals DP = 2 with 4 each
    (augmented images: decoded in the training process at DP 1, by loader workers at DP 2)."""
    _pretrain(
        2,
        _args(
            digits,
            tmp_path,
            **{**PP_FLAGS, "clip-loss": loss, "micro-batch-size": 4, "valid-data": None},
        ),
    )
    expected = [r for r in one_process_curves[loss] if "loss" in r]
    _assert_same_curve(_curve(tmp_path / "metrics.jsonl"), expected, rtol=1e-5)
    assert [r["consumed_samples"] for r in expected] == [16 * i for i in range(1, 11)]
    assert expected[-1]["loss"] < expected[0]["loss"]


@pytest.mark.parametrize(("loss", "zero_stage"), [("tempnet", 0), ("tau", 1)])
def test_bf16_tracks_float32(digits, tmp_path, loss, zero_stage):
    """--bf16 at DP = 2: the towers are bfloat16 and the temperature parts (TempNets, TaU's
    heads) float32 (so the checkpoint says), the loss and the per-sample state stay float32, and
    the curve stays near float32's."""
    curves = {}
    for name, extra in (("fp32", {}), ("bf16", {"bf16": True})):
        run = tmp_path / name
        run.mkdir()
        flags = {"clip-loss": loss, "micro-batch-size": 4, "zero-stage": zero_stage, **extra}
        _pretrain(2, _args(digits, run, save=run / "ckpt", **flags))
        curves[name] = _curve(run / "metrics.jsonl")
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert len(bf16) == len(fp32) == 10
    assert [r["loss"] for r in bf16] != [r["loss"] for r in fp32]  # it did run in bf16
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    for a, b in zip(bf16, fp32):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.1), a["iteration"]
        assert a["tau_mean"] == pytest.approx(b["tau_mean"], rel=0.05), a["iteration"]
    save, tag = tmp_path / "bf16" / "ckpt", "iter_0000010"
    module = global_tensors(save, tag, prefix="weight/")
    dtypes = {
        k.removeprefix("weight/"): v.dtype for k, v in module.items() if v.is_floating_point()
    }
    temperature = {k for k in dtypes if k.startswith(("tempnets.", "tau_heads."))}
    assert temperature and {dtypes[k] for k in temperature} == {torch.float32}, dtypes
    assert {v for k, v in dtypes.items() if k not in temperature} == {torch.bfloat16}, dtypes
    if loss == "tempnet":
        for rank in (0, 1):
            state = rank_state(save, rank, tag)["rank_state"]
            assert state["sample_state"]["values"].dtype == torch.float32


def _saved(save_dir, iteration: int) -> dict:
    """Per rank: the per-sample state shard; and the model's weights."""
    tag = f"iter_{iteration:07d}"
    out = {}
    for rank in (0, 1):
        out[f"state{rank}"] = rank_state(save_dir, rank, tag)["rank_state"]["sample_state"]
    out["module"] = weights(save_dir, tag)
    return out


@pytest.mark.parametrize("loss", ["isogclr", "tempnet"])
def test_resume_is_exact_with_the_per_sample_state(digits, tmp_path, loss):
    """20 iterations straight equal 10 + exit + resume 10 (DP = 2: the state is sharded)."""
    flags = {"clip-loss": loss, "train-iters": 20, "micro-batch-size": 4, "zero-stage": 1}
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    _pretrain(2, _args(digits, straight, save=straight / "ckpt", **flags))
    _pretrain(
        2,
        _args(
            digits,
            split,
            save=split / "ckpt",
            load=split / "ckpt",
            **{"exit-interval": 10},
            **flags,
        ),
    )
    _pretrain(2, _args(digits, split, save=split / "ckpt", load=split / "ckpt", **flags))
    a, b = _curve(straight / "metrics.jsonl"), _curve(split / "metrics.jsonl")
    assert [r["iteration"] for r in b] == list(range(1, 21))
    for x, y in zip(a, b):
        for key in ("loss", "tau_mean", "tau_min", "tau_max", "grad_norm"):
            assert x[key] == y[key], (x["iteration"], key)
    first, second = _saved(straight / "ckpt", 20), _saved(split / "ckpt", 20)
    for rank in (0, 1):
        s1, s2 = first[f"state{rank}"], second[f"state{rank}"]
        assert s1["seen"].sum() > 0 and torch.equal(s1["seen"], s2["seen"])
        assert torch.equal(s1["values"], s2["values"])
    assert first["module"].keys() == second["module"].keys()
    tensors = [k for k, v in first["module"].items() if torch.is_tensor(v)]
    assert any("tempnets" in k or "log_tau" in k for k in tensors) or loss == "isogclr"
    for key in tensors:
        assert torch.equal(first["module"][key], second["module"][key]), key


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"micro-batch-size": 1, "global-batch-size": 4}, "contrastive batch .* >= 2 pairs"),
        ({"pipeline-model-parallel-size": 8}, "must be at most the towers. layers"),
        ({"fp16": True}, "--fp16 needs a GPU"),
        ({"clip-loss": "isogclr", "tau-init": 0.2}, "--tau-init .0.2. must lie in"),
        ({"patch-size": 5}, "--image-size .16. must be divisible by --patch-size .5."),
        ({"tempnet-proj-size": 1000, "clip-loss": "tempnet"}, "lower --tempnet-proj-size"),
    ],
)
def test_flag_errors_are_one_line(digits, tmp_path, flags, message):
    r = _pretrain(0, _args(digits, tmp_path, **flags), check=False)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert re.search(message, r.stderr.strip().splitlines()[-1]), r.stderr[-2000:]


def test_bad_rows_stop_or_are_counted(digits, tmp_path):
    rows = open(digits["test"]).read().splitlines()
    rows[3] = "images/missing.png,a handwritten digit two,two"
    manifest = tmp_path / "bad.csv"
    manifest.write_text("\n".join(rows) + "\n")
    # the images live beside the original manifest: link them for the copy
    os.symlink(os.path.join(os.path.dirname(digits["test"]), "images"), tmp_path / "images")
    r = _pretrain(0, _args(digits, tmp_path, **{"train-data": manifest}), check=False)
    assert r.returncode == 1
    assert re.search(
        r"bad.csv:4: image .*missing.png does not exist; .*--skip-bad-samples", r.stderr
    ), r.stderr[-2000:]
    r = _pretrain(
        0,
        _args(
            digits, tmp_path, **{"train-data": manifest, "train-iters": 2, "skip-bad-samples": True}
        ),
    )
    assert re.search(r"skipped 1 of 359 pairs; the first: .*bad.csv:4", r.stderr)


def test_isogclr_reads_back_its_per_sample_tau(digits, tmp_path):
    """Second-epoch visits use the stored per-sample tau: iSogCLR's curve leaves SogCLR's
    (identical while every tau is still --tau-init) exactly when the epoch turns. Without the
    gradient clip: at rho 8 and 7 negatives every tau-gradient exceeds 5, and the clipped update
    would move every tau alike."""
    curves = {}
    for loss in ("sogclr", "isogclr"):
        (tmp_path / loss).mkdir()
        _pretrain(1, _args(digits, tmp_path / loss, **{"clip-loss": loss, "isogclr-grad-clip": 0}))
        curves[loss] = _curve(tmp_path / loss / "metrics.jsonl")
    for a, b in zip(curves["sogclr"][:6], curves["isogclr"][:6]):  # the first epoch
        assert a["loss"] == b["loss"] and b["tau_min"] == b["tau_max"] == pytest.approx(0.03)
    later = curves["isogclr"][6:]
    assert all(r["tau_min"] < r["tau_max"] for r in later)  # per-sample taus now differ
    assert later[0]["loss"] != curves["sogclr"][6]["loss"]


def _every_sample_state(save_dir, iteration: int) -> dict:
    """The per-sample state of every sample (values, seen), from any DP size's shards."""
    tag = f"iter_{iteration:07d}"
    shards = [
        rank_state(save_dir, rank, tag)["rank_state"]["sample_state"]
        for rank in range(_ranks(save_dir, tag))
    ]
    n, k = shards[0]["num_samples"], len(shards[0]["fields"])
    values, seen = torch.zeros(n, k), torch.zeros(n, dtype=torch.bool)
    for s in shards:  # sample i is row i // W of rank i % W
        values[s["rank"] :: s["world"]] = s["values"]
        seen[s["rank"] :: s["world"]] = s["seen"]
    return {"values": values, "seen": seen}


@pytest.mark.parametrize(
    "loss,saved_dp,resumed_dp",
    [("tempnet", 2, 1), ("isogclr", 1, 2)],
    ids=["dp2-to-dp1-tempnet", "dp1-to-dp2-isogclr"],
)  # each loss, each way: the re-keying does not depend on the loss (test_sample_state.py)
def test_resume_at_another_data_parallel_size_rekeys_the_state(
    digits, tmp_path, loss, saved_dp, resumed_dp
):
    """5 iterations at one DP size, 5 more at the other: the per-sample state re-keyed (sample i
    to rank i % DP') is read back in the second epoch (from iteration 7); curves and every
    sample's state equal the uninterrupted run's."""
    flags = {"clip-loss": loss, "zero-stage": 1}
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir(), split.mkdir()
    batch = {dp: {"micro-batch-size": 8 // dp} for dp in (1, 2)}  # the global batch stays 8
    _pretrain(saved_dp, _args(digits, straight, save=straight / "ckpt", **flags, **batch[saved_dp]))
    _pretrain(
        saved_dp,
        _args(
            digits, split, save=split / "ckpt", **{"exit-interval": 5}, **flags, **batch[saved_dp]
        ),
    )
    out = _pretrain(
        resumed_dp,
        _args(
            digits, split, save=split / "ckpt", load=split / "ckpt", **flags, **batch[resumed_dp]
        ),
    )
    assert f"x DP {saved_dp} (ZeRO 1) to TP 1 x PP 1 x DP {resumed_dp} (ZeRO 1)" in out.stderr
    a, b = _curve(straight / "metrics.jsonl"), _curve(split / "metrics.jsonl")
    assert [r["iteration"] for r in b] == list(range(1, 11))
    for x, y in zip(a[5:], b[5:]):
        for key in ("loss", "tau_mean", "tau_min", "tau_max", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (x["iteration"], key)
    first, second = (
        _every_sample_state(straight / "ckpt", 10),
        _every_sample_state(split / "ckpt", 10),
    )
    assert first["seen"].all() and torch.equal(first["seen"], second["seen"])
    # float32 noise: the uninterrupted runs at DP 1 and DP 2 differ by up to 3e-5 (s, |s| <= 10)
    # and 5e-6 (b) here; a sample's row in the wrong place would differ by O(1). The re-keying
    # itself is exact (tests/distributed/test_sample_state.py)
    torch.testing.assert_close(second["values"], first["values"], rtol=1e-4, atol=1e-5)


def test_pretrained_towers_from_a_hugging_face_clip_at_tp2(digits, tmp_path):
    """convert_clip_to_megatron.py --target-tp 2, then pretrain_clip.py --pretrained-checkpoint at
    TP 2 with the printed flags: the run starts from exactly the converted towers (lr 0), TempNet
    from its initialisation."""
    from transformers import CLIPModel

    from megatron_tempnet.data.tokenizers import TokenizerConfig

    # the tokenizer's vocabulary (the run's; checkpoints hold it unpadded, so they must agree)
    spec = TokenizerConfig(
        tokenizer_type="SentencePieceTokenizer", tokenizer_model=digits["tokenizer"]
    )
    config = hf_clip_config(32, 4, spec.build().vocab_size, context=16, eos=2, channels=1)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(tmp_path / "hf")
    converted = tmp_path / "converted"
    tool = os.path.join(REPO, "tools", "checkpoint", "convert_clip_to_megatron.py")
    r = run_command(
        [
            sys.executable,
            tool,
            "--hf-dir",
            str(tmp_path / "hf"),
            "--target-tp",
            "2",
            "--save",
            str(converted),
            "--make-vocab-size-divisible-by",
            "64",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    flags = (converted / "model_flags.txt").read_text().split()
    assert "--quick-gelu" in flags and flags[flags.index("--vision-heads") + 1] == "4"
    args = (
        _args(
            digits,
            tmp_path,
            **{
                "clip-loss": "tempnet",
                "tensor-model-parallel-size": 2,
                "make-vocab-size-divisible-by": 64,
                "pretrained-checkpoint": converted,
                "train-iters": 1,
                "lr": 0.0,
                "tempnet-lr": 0.0,
                "save": tmp_path / "run",
                "load": tmp_path / "run",
                "valid-data": None,
            },
        )
        + flags
    )
    r = _pretrain(2, args)
    assert "TempNet starts from its initialisation" in r.stdout + r.stderr
    assert train_state(tmp_path / "run")["layout"]["tensor_parallel"] == 2
    before = weights(converted, "iter_0000000")
    after = weights(tmp_path / "run", "iter_0000001")
    towers = [k for k in after if k.startswith("clip.")]
    assert len(towers) > 40 and all(k in before for k in towers)
    for key in towers:
        assert torch.equal(after[key], before[key]), key


@pytest.mark.parametrize("loss", ["tempnet", "isogclr"])
def test_a_steady_iteration_waits_for_the_device_at_most_once(digits, tmp_path, loss):
    """DP 2 with the per-sample state (and TempNet, or iSogCLR's per-sample tau), under the
    device rule: every iteration that neither logs nor validates, after the first, makes at most
    one host synchronisation per rank (the state's rows are chosen by ``where``, its indices
    checked on the host, the losses' scalars are Python numbers)."""
    report = tmp_path / "syncs"
    flags = {
        "clip-loss": loss,
        "micro-batch-size": 4,
        "train-iters": 8,
        "log-interval": 4,
        "eval-interval": 4,
    }
    _pretrain(2, _args(digits, tmp_path, **flags), device_rule=str(report))
    device_rules.assert_steady_syncs(str(report), [2, 3, 5, 6, 7], ranks=2)
