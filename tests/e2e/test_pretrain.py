"""pretrain_gpt.py end to end under torchrun: parallel layouts, exact resume, --freeze-lm,
every --loss / --tau-source pair, and flag errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_tempnet.checkpoint.shard_reading import read_metadata
from tests.helpers import device_rules
from tests.helpers.checkpoints import (
    checkpoint_path,
    global_tensors,
    stored_bytes,
    train_state,
    weights,
)
from tests.helpers.corpus import blend_corpus, pydoc_documents
from tests.helpers.entry_points import cli_flags, run_command, run_entry_point, run_program
from tests.helpers.wandb_run import read_offline_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # 512 ids: the padded vocabulary (multiple of 128 x TP) is 512 at TP = 1, 2 and 4
    return blend_corpus(str(tmp_path_factory.mktemp("corpus")), vocab_size=512)


OUTPUT_CHUNK = 24  # tokens: a micro-batch's 64 in three chunks, the last one partial


def _args(corpus, tmp, **flags) -> list[str]:
    spec = corpus["spec"]
    base = {
        "model": "tiny",
        "data-path": corpus["prefix"]["A"],
        "split": "90,8,2",
        "seq-length": 32,
        "tokenizer-type": "GPT2BPETokenizer",
        "vocab-file": spec["vocab_file"],
        "merge-file": spec["merge_file"],
        "train-iters": 10,
        "micro-batch-size": 2,
        "global-batch-size": 8,
        "log-interval": 1,
        "eval-interval": 5,
        "eval-iters": 1,
        "tempnet-hidden-size": 32,
        "tempnet-proj-size": 32,
        "tempnet-rho": 4,
        "lr": 1e-3,
        "data-cache-path": str(tmp / "cache"),
        "seed": 5,
        # the paper's Table 5 schedule and AdamW (Megatron-LM's defaults are linear, 0.999, 0.01)
        "lr-decay-style": "cosine",
        "lr-warmup-fraction": 0.01,
        "adam-beta2": 0.95,
        "weight-decay": 0.1,
        "output-stage-chunk-size": OUTPUT_CHUNK,
        # read in the training process: two loader workers per rank (the default) triple these
        # tiny runs' wall time on 2 cores; test_loader_workers_give_the_same_run runs them
        "num-workers": 0,
    }
    return cli_flags(base, **flags)


def _pretrain(
    nproc: int,
    args: list[str],
    check: bool = True,
    env: dict | None = None,
    device_rule: str | bool = True,
) -> subprocess.CompletedProcess:
    """pretrain_gpt.py on ``nproc`` ranks, under the device rule (``run_program``)."""
    return run_entry_point("pretrain_gpt.py", nproc, args, check, env, device_rule)


def _curve(path) -> list[dict]:
    with open(path) as f:
        return [row for row in map(json.loads, f) if "loss" in row]


LAYOUTS = {  # name: (processes, flags)
    "tp2": (2, {"tensor-model-parallel-size": 2}),
    "tp4": (4, {"tensor-model-parallel-size": 4}),
    "dp2-zero0": (2, {"zero-stage": 0}),
    "dp2-zero1": (2, {"zero-stage": 1}),
    "dp2-zero2": (2, {"zero-stage": 2}),
    "tp2-dp2-zero0": (4, {"tensor-model-parallel-size": 2, "zero-stage": 0}),
    "tp2-dp2-zero1": (4, {"tensor-model-parallel-size": 2, "zero-stage": 1}),
    "tp2-dp2-zero2": (4, {"tensor-model-parallel-size": 2, "zero-stage": 2}),
    "dp2-zero3": (2, {"zero-stage": 3}),
    "tp2-dp2-zero3": (4, {"tensor-model-parallel-size": 2, "zero-stage": 3}),
    "pp2": (2, {"pipeline-model-parallel-size": 2}),
    "tp2-pp2": (4, {"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2}),
    "pp2-dp2-zero1": (4, {"pipeline-model-parallel-size": 2, "zero-stage": 1}),
    "tp2-dp2-zero2-sp": (
        4,
        {"tensor-model-parallel-size": 2, "zero-stage": 2, "sequence-parallel": True},
    ),
    "tp2-pp2-sp": (
        4,
        {
            "tensor-model-parallel-size": 2,
            "pipeline-model-parallel-size": 2,
            "sequence-parallel": True,
        },
    ),
}


# megatron-core's unfused attention without the bias fusions, the logits formed whole: every
# layout below runs the default fused paths (attention, bias fusions, the output stage in
# chunks of OUTPUT_CHUNK tokens) and must reproduce this curve
UNFUSED = {
    "attention-backend": "unfused",
    "no-bias-gelu-fusion": True,
    "no-bias-swiglu-fusion": True,
    "no-bias-dropout-fusion": True,
    "no-fused-output-stage": True,
}


@pytest.fixture(scope="module")
def reference_curve(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp1")
    flags = {**UNFUSED, "metrics-file": tmp / "m.jsonl"}
    _pretrain(1, _args(corpus, tmp, **flags))
    return _curve(tmp / "m.jsonl")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_give_the_same_loss_curve(corpus, reference_curve, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    _pretrain(nproc, _args(corpus, tmp_path, **flags, **{"metrics-file": tmp_path / "m.jsonl"}))
    curve = _curve(tmp_path / "m.jsonl")
    assert [r["iteration"] for r in curve] == list(range(1, 11))
    assert reference_curve[-1]["loss"] < reference_curve[0]["loss"]  # it learns
    for got, ref in zip(curve, reference_curve):
        for key in ("loss", "ce_loss", "tau_mean", "grad_norm"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (layout, got["iteration"], key)
        assert got["consumed_samples"] == ref["consumed_samples"]


def test_a_steady_iteration_waits_for_the_device_at_most_once(corpus, tmp_path):
    """At TP 2 x PP 2 under the device rule (NCCL's and CUDA's rules, as every run here), every
    iteration that neither logs, validates nor saves, after the first, makes at most one host
    synchronisation on every rank: the statistics, gradient norm and stop flags come back in one
    copy (``trainer.stats.read_step``)."""
    report = tmp_path / "syncs"
    flags = {
        "tensor-model-parallel-size": 2,
        "pipeline-model-parallel-size": 2,
        "train-iters": 8,
        "log-interval": 4,
        "eval-interval": 4,
        "save": tmp_path / "ckpt",
        "save-interval": 4,
    }
    _pretrain(4, _args(corpus, tmp_path, **flags), device_rule=str(report))
    device_rules.assert_steady_syncs(str(report), [2, 3, 5, 6, 7], ranks=4)


def test_loader_workers_wandb_and_a_yaml_cfg_give_the_same_run(corpus, reference_curve, tmp_path):
    """The reference read its samples in the training process; two loader workers (the
    default) give the same run, validation included, to the last bit. The run is also logged to
    Weights & Biases (offline) with what the metrics file gets, and the config.yaml it saves,
    given back as --yaml-cfg (with a shorter --train-iters: the command line wins), reproduces
    its first losses exactly."""
    flags = {
        **UNFUSED,
        "num-workers": None,  # the default
        "metrics-file": tmp_path / "m.jsonl",
        "save": tmp_path / "ckpt",
        "wandb-project": "qs",
        "wandb-exp-name": "workers",
        "wandb-save-dir": tmp_path / "wb",
    }
    _pretrain(1, _args(corpus, tmp_path, **flags), env={**os.environ, "WANDB_MODE": "offline"})
    got = _curve(tmp_path / "m.jsonl")
    timing = ("tokens_per_sec", "memory_mb")
    assert len(got) == len(reference_curve) == 10
    for a, b in zip(got, reference_curve):
        assert {k: v for k, v in a.items() if k not in timing} == {
            k: v for k, v in b.items() if k not in timing
        }
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    val = [r for r in rows if "val_ppl" in r]
    assert val

    run = read_offline_run(str(tmp_path / "wb"))
    assert (run["name"], run["project"]) == ("workers", "qs")
    assert run["config"]["training"]["train_iters"] == 10 and run["config"]["preset"] == "tiny"
    logged = [r for r in run["history"] if "loss/loss" in r]
    assert [r["_step"] for r in logged] == list(range(1, 11))
    for row, ref in zip(logged, got):
        assert row["loss/loss"] == ref["loss"] and row["tau/std"] == ref["tau_std"]
        assert row["train/lr"] == ref["lr"] and row["train/tempnet_lr"] == ref["tempnet_lr"]
        assert row["train/grad_norm"] == ref["grad_norm"] and row["train/memory_mb"] > 0
        assert row["train/tokens_per_sec"] > 0
    validated = [r for r in run["history"] if "validation/ppl" in r]
    assert [r["validation/ppl"] for r in validated] == [r["val_ppl"] for r in val]
    assert len(run["histograms"]["tau/histogram"]) == 10

    again = tmp_path / "again.jsonl"
    _pretrain(
        1,
        [
            "--yaml-cfg",
            str(tmp_path / "ckpt" / "config.yaml"),
            "--train-iters",
            "3",
            "--metrics-file",
            str(again),
            "--save",
            str(tmp_path / "again"),
            "--wandb-save-dir",
            str(tmp_path / "wb2"),
        ],
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert [r["loss"] for r in _curve(again)] == [r["loss"] for r in got[:3]]


def test_freeze_lm_trains_tempnet_only(corpus, tmp_path):
    flags = {
        "freeze-lm": True,
        "save": tmp_path / "ckpt",
        "train-iters": 6,
        "eval-interval": 0,
        "metrics-file": tmp_path / "m.jsonl",
        "zero-stage": 1,
    }
    _pretrain(2, _args(corpus, tmp_path, **flags))
    initial = tmp_path / "initial"
    _pretrain(
        2,
        _args(
            corpus,
            tmp_path,
            **{**flags, "train-iters": 1, "lr": 0.0, "save": initial, "metrics-file": None},
        ),
    )
    trained, start = weights(tmp_path / "ckpt"), weights(initial)
    lm_keys = [k for k in trained if k.startswith("lm.")]
    assert lm_keys and all(torch.equal(trained[k], start[k]) for k in lm_keys)
    tempnet_keys = [k for k in trained if k.startswith("tempnet.")]
    assert any(not torch.equal(trained[k], start[k]) for k in tempnet_keys)
    n_tempnet = sum(trained[k].numel() for k in tempnet_keys)
    # AdamW steps TempNet only: its moments are saved for TempNet's parameters, none for the LM
    moments = global_tensors(tmp_path / "ckpt", "iter_0000006", prefix="exp_avg/")
    assert sorted(moments) == sorted(f"exp_avg/{k}" for k in tempnet_keys)
    assert train_state(tmp_path / "ckpt")["layout"]["zero_stage"] == 1
    # ZeRO-1 over 2 ranks: rank 0's fragment (the moments it writes) is half of TempNet's
    saved = read_metadata(checkpoint_path(tmp_path / "ckpt", "iter_0000006"))
    own = sum(
        math.prod(c["sizes"])
        for fqn, t in saved.items()
        if fqn.startswith("exp_avg/")
        for c in t["chunks"]
        if c["file"] == "shards/rank00000.bin"
    )
    assert own * 2 >= n_tempnet > own


def test_frozen_lm_cache_gives_the_uncached_losses(corpus, tmp_path):
    """--frozen-lm-cache at TP 2 with sequence parallelism: a run that fills the store and one
    that reads every hidden state from it have the uncached run's losses exactly; the reading run
    does read them (a stored state changed changes its loss)."""
    flags = {
        "freeze-lm": True,
        "tensor-model-parallel-size": 2,
        "sequence-parallel": True,
        "train-iters": 4,
        "eval-interval": 0,
    }
    store = tmp_path / "hidden"

    def losses(name: str, **extra) -> list[float]:
        metrics = {"metrics-file": tmp_path / f"{name}.jsonl"}
        _pretrain(2, _args(corpus, tmp_path, **flags, **extra, **metrics))
        return [r["loss"] for r in _curve(tmp_path / f"{name}.jsonl")]

    plain = losses("plain")
    assert losses("fill", **{"frozen-lm-cache": store}) == plain
    folders = sorted(p.name for p in store.iterdir())
    assert folders == ["tp00-of-02", "tp01-of-02"]
    files = {f: sorted((store / f).glob("*/*.pt")) for f in folders}
    assert len(files["tp00-of-02"]) == len(files["tp01-of-02"]) > 8  # 32 samples, some repeated
    part = torch.load(files["tp01-of-02"][0], weights_only=True)
    assert part.shape == (16, 64) and part.dtype == torch.float32  # [s / tp, h]: this rank's
    assert losses("read", **{"frozen-lm-cache": store}) == plain
    assert len(list(store.glob("*/*/*.pt"))) == 2 * len(files["tp00-of-02"])  # nothing new
    for path in files["tp00-of-02"]:
        torch.save(torch.load(path, weights_only=True) * 1.5, path)
    changed = losses("changed", **{"frozen-lm-cache": store})
    assert all(a != b for a, b in zip(changed, plain))


COMBINATIONS = [
    ("dro", "tempnet", {}),
    ("dro", "fixed", {"fixed-tau": 0.8}),
    ("dro", "newton", {}),
    ("ts-ce", "tempnet", {}),
    ("ts-ce", "fixed", {}),
    ("ts-ce", "newton", {}),
    ("ce", "fixed", {}),
    ("ce", "newton", {}),
    ("dro", "tempnet", {"no-tempnet-stop-grad": True}),
]


@pytest.mark.parametrize("loss,source,extra", COMBINATIONS)
def test_every_loss_and_tau_source_trains(corpus, tmp_path, loss, source, extra):
    flags = {
        "loss": loss,
        "tau-source": source,
        "train-iters": 3,
        "eval-interval": 3,
        "metrics-file": tmp_path / "m.jsonl",
        **extra,
    }
    _pretrain(1, _args(corpus, tmp_path, **flags))
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    train = [r for r in rows if "loss" in r]
    assert len(train) == 3 and all(math.isfinite(r["loss"]) for r in train)
    if source == "fixed":
        assert train[0]["tau_mean"] == pytest.approx(float(extra.get("fixed-tau", 1.0)))
    if source == "newton":
        assert train[0]["tau_min"] >= 0.001 and train[0]["tau_std"] > 0
    val = [r for r in rows if "val_ppl" in r]
    assert len(val) == 1 and val[0]["val_ppl"] == pytest.approx(math.exp(val[0]["val_ce_loss"]))


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            {"zero-stage": 2, "pipeline-model-parallel-size": 2},
            "--zero-stage 2 cannot shard gradients across pipeline stages",
        ),
        ({"num-attention-heads": 3}, "--hidden-size (64) must be divisible by"),
        ({"global-batch-size": 7}, "--global-batch-size (7) must be a multiple"),
        ({"tempnet-tau-min": 0.5, "tempnet-tau-max": 0.3}, "--tempnet-tau-min (0.5)"),
        ({"freeze-lm": True, "tau-source": "fixed"}, "--freeze-lm trains TempNet only"),
        ({"frozen-lm-cache": "h"}, "--frozen-lm-cache h: it stores the frozen LM's hidden"),
        (
            {"frozen-lm-cache": "h", "freeze-lm": True, "hidden-dropout": 0.1},
            "--hidden-dropout 0.1, --attention-dropout 0) changes",
        ),
        ({"loss": "ce"}, "--loss ce does not use tau"),
        ({"pipeline-model-parallel-size": 4}, "--num-layers (2) must be divisible by"),
        ({"exit-duration-in-mins": 5}, "--exit-duration-in-mins saves a checkpoint"),
        ({"exit-duration-in-mins": -1, "save": "s"}, "--exit-duration-in-mins (-1) must be >= 0"),
        ({"pretrained-checkpoint": "p"}, "--pretrained-checkpoint p is used only while --load"),
        (
            {"pretrained-checkpoint": "p", "load": "r", "finetune": True},
            "--pretrained-checkpoint and --finetune both choose",
        ),
        ({"yaml-cfg": "missing.yaml"}, "--yaml-cfg missing.yaml: No such file or directory"),
    ],
)
def test_invalid_flags_fail_before_building_anything(corpus, tmp_path, flags, message):
    r = _pretrain(0, _args(corpus, tmp_path, **flags), check=False)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "cache").exists()  # failed before the data was even indexed


def test_recompute_bf16_and_a_deepspeed_json(corpus, reference_curve, tmp_path):
    def curve(name, **flags):
        _pretrain(1, _args(corpus, tmp_path, **flags, **{"metrics-file": tmp_path / name}))
        return [r["loss"] for r in _curve(tmp_path / name)]

    reference = [r["loss"] for r in reference_curve]
    assert curve("recompute.jsonl", **{"recompute-activations": True}) == pytest.approx(
        reference, rel=1e-5
    )
    bf16 = curve("bf16.jsonl", bf16=True)
    assert bf16 != reference and bf16 == pytest.approx(reference, rel=3e-2)
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e5}}))
    assert curve("ds.jsonl", **{"deepspeed-config": ds_json}) == pytest.approx(reference, rel=1e-5)
    r = _pretrain(
        0, _args(corpus, tmp_path, **{"deepspeed-config": tmp_path / "no.json"}), check=False
    )
    assert r.returncode == 1 and "--deepspeed-config" in r.stderr and "no.json" in r.stderr


@pytest.mark.parametrize("zero", [2, 3])
def test_bf16_with_zero_keeps_tempnet_float32(corpus, reference_curve, tmp_path, zero):
    """--bf16 at DP = 2: ZeRO-2 steps the 16-bit LM and the float32 TempNet in separate groups
    and checkpoints TempNet in float32; ZeRO-3 (one dtype) stores TempNet in 16 bits and still
    computes tau in float32. Both track the float32 curve."""
    flags = {
        "zero-stage": zero,
        "bf16": True,
        "save": tmp_path / "ckpt",
        "eval-interval": 0,
        "metrics-file": tmp_path / "m.jsonl",
    }
    _pretrain(2, _args(corpus, tmp_path, **flags))
    curve = _curve(tmp_path / "m.jsonl")
    assert [r["loss"] for r in curve] == pytest.approx(
        [r["loss"] for r in reference_curve], rel=3e-2
    )
    assert all(r["tau_std"] > 0 for r in curve)
    if zero == 2:
        module = _saved_weights(tmp_path / "ckpt")
        tempnet = {k: v.dtype for k, v in module.items() if k.startswith("tempnet.")}
        assert tempnet and set(tempnet.values()) == {torch.float32}
        lm = {v.dtype for k, v in module.items() if k.startswith("lm.") and v.is_floating_point()}
        assert lm == {torch.bfloat16}


def test_pipeline_with_recompute_and_bf16(corpus, reference_curve, tmp_path):
    def curve(name, **flags):
        flags = {"pipeline-model-parallel-size": 2, "metrics-file": tmp_path / name, **flags}
        _pretrain(2, _args(corpus, tmp_path, **flags))
        return _curve(tmp_path / name)

    reference = [r["loss"] for r in reference_curve]
    recompute = curve("recompute.jsonl", **{"recompute-activations": True})
    assert [r["loss"] for r in recompute] == pytest.approx(reference, rel=1e-5)
    bf16 = curve("bf16.jsonl", bf16=True)  # DeepSpeed's bf16 optimizer clips and reports
    assert [r["loss"] for r in bf16] == pytest.approx(reference, rel=3e-2)
    for got, ref in zip(bf16, reference_curve):
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=3e-2)


def test_a_nan_loss_stops_the_run_naming_iteration_and_rank(corpus, tmp_path):
    # no warm-up: Megatron-LM's starts at --lr-warmup-init (0), which would leave iteration 1's
    # weights as they were
    flags = {"clip-grad": 0, "zero-stage": 1, "lr-warmup-fraction": None}
    r = _pretrain(2, _args(corpus, tmp_path, lr=1e30, **flags), check=False)
    assert r.returncode != 0
    assert "error: iteration 2: the loss is nan (rank 0); stopping" in r.stderr


def test_keep_last_finetune_and_tensorboard(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save = tmp_path / "ckpt"
    flags = {
        "train-iters": 6,
        "save": save,
        "save-interval": 2,
        "keep-last": 2,
        "eval-interval": 3,
        "tensorboard-dir": tmp_path / "tb",
    }
    _pretrain(1, _args(corpus, tmp_path, **flags))
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000004",
        "iter_0000006",
    ]
    assert json.loads((save / "config.json").read_text())["training"]["train_iters"] == 6
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {
        "loss/loss",
        "loss/ce_loss",
        "tau/mean",
        "tau/std",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_sec",
        "validation/ppl",
        "validation/tllm_ppl",
    } <= scalars
    assert "tau/histogram" in events.Tags()["histograms"]
    # TempNet's learning rate follows its own schedule (--tempnet-lr defaults to --lr)
    lrs = {tag: [e.value for e in events.Scalars(tag)] for tag in ("train/lr", "train/tempnet_lr")}
    assert lrs["train/tempnet_lr"] == lrs["train/lr"] and len(set(lrs["train/lr"])) > 1
    assert [e.step for e in events.Scalars("loss/loss")] == list(range(1, 7))
    # --finetune: the weights of iteration 6, a fresh start for everything else
    tuned = tmp_path / "tuned.jsonl"
    finetune = {
        "train-iters": 2,
        "load": save,
        "finetune": True,
        "metrics-file": tuned,
        "eval-interval": 0,
    }
    _pretrain(1, _args(corpus, tmp_path, **finetune))
    scratch = tmp_path / "scratch.jsonl"
    _pretrain(
        1,
        _args(corpus, tmp_path, **{"train-iters": 2, "metrics-file": scratch, "eval-interval": 0}),
    )
    tuned_rows, scratch_rows = _curve(tuned), _curve(scratch)
    assert [r["iteration"] for r in tuned_rows] == [1, 2]
    assert tuned_rows[0]["consumed_samples"] == scratch_rows[0]["consumed_samples"] == 8
    assert tuned_rows[0]["ce_loss"] < scratch_rows[0]["ce_loss"] - 0.05  # trained weights


def test_a_prebuilt_data_cache_is_what_training_loads(corpus, tmp_path):
    cache = tmp_path / "cache"
    spec = corpus["spec"]
    data = [
        "--data-path",
        corpus["prefix"]["A"],
        "--split",
        "90,8,2",
        "--seq-length",
        "32",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        spec["vocab_file"],
        "--merge-file",
        spec["merge_file"],
        "--data-cache-path",
        str(cache),
    ]
    # a length in samples and a batch ramp (4, then 8 after 16 samples): 11 iterations
    ramp = ["--rampup-batch-size", "4", "4", "16"]
    batch = ["--train-samples", "72", "--global-batch-size", "8", "--eval-interval", "5", *ramp]
    tool = os.path.join(REPO, "tools", "build_data_cache.py")
    r = run_command([sys.executable, tool, *data, *batch])
    assert r.returncode == 0, r.stderr
    assert "train: " in r.stdout and "(needs 72)" in r.stdout
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    # the same flags (defaults included) in pretrain_gpt.py: its start-up only reads the cache
    same = {"eval-iters": None, "seed": None, "train-iters": None, "train-samples": 72}
    _pretrain(0, _args(corpus, tmp_path, **same) + ramp)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    r = run_command([sys.executable, tool, *data, *batch, "--train-iters", "11"])
    assert r.returncode == 1 and "give one of --train-iters and --train-samples" in r.stderr


def test_setting_iii_tempnet_on_an_lm_only_checkpoint_in_float32_and_bf16(corpus, tmp_path):
    """Train an LM with cross-entropy (no TempNet), then learn TempNet on it, frozen; under
    --bf16 TempNet stays a float32 island: its tau per token is the float32 run's within 1%, it
    varies from token to token, and its checkpointed parameters are float32."""
    lm_ckpt = tmp_path / "lm"
    lm_only = {
        "loss": "ce",
        "tau-source": "fixed",
        "save": lm_ckpt,
        "train-iters": 4,
        "eval-interval": 0,
    }
    _pretrain(1, _args(corpus, tmp_path, **lm_only))
    flags = {
        "freeze-lm": True,
        "load": lm_ckpt,
        "finetune": True,
        "train-iters": 3,
        "eval-interval": 0,
    }
    runs = {}
    for precision in ("fp32", "bf16"):
        runs[precision] = out = tmp_path / precision
        _pretrain(
            1,
            _args(
                corpus,
                tmp_path,
                **flags,
                save=out,
                bf16=precision == "bf16",
                **{"metrics-file": out / "m.jsonl"},
            ),
        )
    before, after = (
        _saved_weights(lm_ckpt, "iter_0000004"),
        _saved_weights(runs["fp32"], "iter_0000003"),
    )
    lm_keys = list(before)
    assert lm_keys and all(torch.equal(before[k], after[k]) for k in lm_keys)
    bf16 = _saved_weights(runs["bf16"], "iter_0000003")
    tempnet = [k for k in bf16 if k.startswith("tempnet.")]
    assert tempnet and all(bf16[k].dtype == torch.float32 for k in tempnet)
    assert all(bf16[k].dtype == torch.bfloat16 for k in lm_keys if before[k].is_floating_point())
    # the training metrics: TempNet's tau varies over the tokens under bf16 too
    curves = {p: _curve(runs[p] / "m.jsonl") for p in runs}
    for got, ref in zip(curves["bf16"], curves["fp32"]):
        assert got["tau_std"] > 0.01 * ref["tau_std"] > 0
        assert got["tau_mean"] == pytest.approx(ref["tau_mean"], rel=1e-2)
    # tau per token, the LM in bfloat16 against float32 (tools/evaluate.py)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t[:200]}) + "\n" for t in pydoc_documents(3)))
    tau = {}
    for p, out in runs.items():
        args = cli_flags(
            {"load": out, "jsonl": texts, "per-token-output": out / "t.jsonl", "bf16": p == "bf16"}
        )
        r = run_program("tools/evaluate.py", args)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "t.jsonl").read_text().splitlines()]
        tau[p] = torch.tensor([t for row in rows for t in row["tau"]], dtype=torch.float64)
    assert tau["bf16"].numel() > 50 and len(set(tau["bf16"].tolist())) > 0.9 * tau["bf16"].numel()
    torch.testing.assert_close(tau["bf16"], tau["fp32"], rtol=1e-2, atol=0)
    r = _pretrain(
        0, _args(corpus, tmp_path, **{**flags, "load": tmp_path / "nowhere"}), check=False
    )
    assert r.returncode == 1
    assert f"error: --finetune --load {tmp_path / 'nowhere'}: no such directory" in r.stderr


LLAMA = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "untie-embeddings-and-output-weights": True,
    "position-embedding-type": "rope",
    "disable-bias-linear": True,
    "num-layers": 4,
    "eval-interval": 0,
}


def _pipeline_tempnet(save_dir) -> dict:
    """TempNet's tensors from a pipeline checkpoint."""
    return {k: v for k, v in weights(save_dir).items() if k.startswith("tempnet.")}


def test_pipeline_llama_matches_one_process_and_resumes_exactly(corpus, tmp_path):
    one = tmp_path / "pp1.jsonl"
    _pretrain(1, _args(corpus, tmp_path, **LLAMA, **{"metrics-file": one}))
    pp = {**LLAMA, "pipeline-model-parallel-size": 2}
    straight = tmp_path / "straight"
    _pretrain(
        2, _args(corpus, tmp_path, **pp, save=straight, **{"metrics-file": straight / "m.jsonl"})
    )
    for got, ref in zip(_curve(straight / "m.jsonl"), _curve(one), strict=True):
        for key in ("loss", "ce_loss", "tau_mean", "grad_norm"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (got["iteration"], key)
    split = tmp_path / "split"
    _pretrain(
        2,
        _args(
            corpus,
            tmp_path,
            **pp,
            save=split,
            **{"exit-interval": 5, "metrics-file": split / "m.jsonl"},
        ),
    )
    _pretrain(
        2,
        _args(
            corpus, tmp_path, **pp, save=split, load=split, **{"metrics-file": split / "m.jsonl"}
        ),
    )
    resumed, reference = _curve(split / "m.jsonl"), _curve(straight / "m.jsonl")
    assert [r["iteration"] for r in resumed] == list(range(1, 11))
    for got, ref in zip(resumed, reference):
        assert got["loss"] == ref["loss"] and got["tau_mean"] == ref["tau_mean"], got["iteration"]
    a, b = _pipeline_tempnet(split), _pipeline_tempnet(straight)
    assert "tempnet.weight1" in a and all(torch.equal(a[k], b[k]) for k in a)


def test_pipeline_finetune_starts_tempnet_on_an_lm_only_checkpoint(corpus, tmp_path):
    pp = {"pipeline-model-parallel-size": 2, "eval-interval": 0}
    lm_ckpt = tmp_path / "lm"
    _pretrain(
        2,
        _args(
            corpus,
            tmp_path,
            **pp,
            loss="ce",
            **{"tau-source": "fixed"},
            save=lm_ckpt,
            **{"train-iters": 6},
        ),
    )
    tuned, scratch = tmp_path / "tuned.jsonl", tmp_path / "scratch.jsonl"
    r = _pretrain(
        2,
        _args(
            corpus,
            tmp_path,
            **pp,
            load=lm_ckpt,
            finetune=True,
            **{"train-iters": 2, "metrics-file": tuned},
        ),
    )
    assert "TempNet starts from its initialisation" in r.stdout + r.stderr
    _pretrain(2, _args(corpus, tmp_path, **pp, **{"train-iters": 2, "metrics-file": scratch}))
    assert _curve(tuned)[0]["ce_loss"] < _curve(scratch)[0]["ce_loss"] - 0.05  # trained LM
    one = tmp_path / "one.jsonl"  # the PP 2 checkpoint at PP 1: resharded, the same run
    other = _pretrain(
        1,
        _args(
            corpus,
            tmp_path,
            load=lm_ckpt,
            finetune=True,
            **{"eval-interval": 0, "train-iters": 2, "metrics-file": one},
        ),
    )
    assert train_state(lm_ckpt)["layout"]["pipeline_parallel"] == 2
    assert f"loaded weights from {lm_ckpt / 'iter_0000006'} (--finetune --load)" in other.stderr
    assert "TempNet starts from its initialisation" in other.stderr
    assert _curve(one)[0]["loss"] == pytest.approx(_curve(tuned)[0]["loss"], rel=1e-5)


def test_pipeline_freeze_lm_trains_tempnet_only(corpus, tmp_path):
    """--freeze-lm at PP 2 gives PP 1's run, in float32 and under --bf16 (where the first stage,
    with nothing to train, steps DeepSpeed's bf16 optimizer on a zero gradient); the LM's layer
    files stay bit-identical."""
    flags = {"freeze-lm": True, "train-iters": 6, "eval-interval": 0}
    one = tmp_path / "pp1.jsonl"
    _pretrain(1, _args(corpus, tmp_path, **flags, **{"metrics-file": one}))
    pp = {**flags, "pipeline-model-parallel-size": 2}
    trained, initial = tmp_path / "trained", tmp_path / "initial"
    _pretrain(
        2, _args(corpus, tmp_path, **pp, save=trained, **{"metrics-file": trained / "m.jsonl"})
    )
    for got, ref in zip(_curve(trained / "m.jsonl"), _curve(one), strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), got["iteration"]
    _pretrain(2, _args(corpus, tmp_path, **{**pp, "train-iters": 1, "lr": 0.0}, save=initial))
    after, before = weights(trained), weights(initial)
    # embeddings, positions, 2 layers, final norm and TempNet (the tied output layer is the
    # embedding, saved once)
    assert sorted(after) == sorted(before)
    assert {k.split(".")[2] for k in after if k.startswith("lm.")} == {"0", "1", "2", "3", "4"}
    lm = [k for k in after if not k.startswith("tempnet.")]
    assert lm and all(torch.equal(after[k], before[k]) for k in lm)  # the LM: bit-identical
    tempnet = [k for k in after if k.startswith("tempnet.")]
    assert any(not torch.equal(after[k], before[k]) for k in tempnet)  # TempNet learned
    one_bf16, bf16 = tmp_path / "pp1-bf16.jsonl", tmp_path / "bf16"
    _pretrain(1, _args(corpus, tmp_path, **flags, bf16=True, **{"metrics-file": one_bf16}))
    _pretrain(
        2,
        _args(corpus, tmp_path, **pp, bf16=True, save=bf16, **{"metrics-file": bf16 / "m.jsonl"}),
    )
    curves = zip(_curve(bf16 / "m.jsonl"), _curve(one_bf16), _curve(one), strict=True)
    for got, ref, ref32 in curves:
        # the same bfloat16 LM forward at PP 1 and 2; the float32 TempNet's gradients reach its
        # optimizer through another engine, which moves these by under 1e-5 here (bf16 against
        # float32: about 1e-3)
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), got["iteration"]
        assert got["tau_mean"] == pytest.approx(ref["tau_mean"], rel=1e-4), got["iteration"]
        # every stage reduces the norm of TempNet's float32 gradient (the bfloat16 LM's
        # activations move it by about 1e-5); a stage left out would log 0 or hang
        assert got["grad_norm"] == pytest.approx(ref32["grad_norm"], rel=1e-3), got["iteration"]
    after = weights(bf16, master=False)
    assert all(torch.equal(after[k], before[k].to(after[k].dtype)) for k in lm)
    assert {after[k].dtype for k in lm} == {torch.bfloat16}
    assert {after[k].dtype for k in tempnet} == {torch.float32}
    assert any(not torch.equal(after[k], before[k]) for k in tempnet)


def test_time_budget_stops_at_a_checkpoint_and_pretrained_weights_seed_the_run(corpus, tmp_path):
    """--exit-duration-in-mins: checkpoint, exit status 75; the same command again resumes.
    --pretrained-checkpoint seeds only a run whose --load holds nothing yet."""
    pretrained, run = tmp_path / "pretrained", tmp_path / "run"
    _pretrain(
        0,
        _args(
            corpus,
            tmp_path,
            save=pretrained,
            loss="ce",
            **{"tau-source": "fixed", "train-iters": 2},
        ),
    )
    flags = {
        "pretrained-checkpoint": pretrained,
        "load": run,
        "save": run,
        "train-iters": 4,
        "metrics-file": run / "m.jsonl",
    }
    first = _pretrain(
        0, _args(corpus, tmp_path, **flags, **{"exit-duration-in-mins": 1e-6}), check=False
    )
    assert first.returncode == 75, first.stderr[-3000:]
    assert (
        f"no checkpoint in --load yet: loading --pretrained-checkpoint {pretrained}" in first.stderr
    )
    assert "--exit-duration-in-mins 1e-06 reached: stopped after iteration 1" in first.stderr
    assert open(run / "latest").read() == "iter_0000001"
    lm = {k: v for k, v in weights(pretrained).items() if not k.startswith("tempnet.")}
    second = _pretrain(0, _args(corpus, tmp_path, **flags))
    assert f"resumed from {run / 'iter_0000001'}" in second.stderr
    assert "--pretrained-checkpoint" not in second.stderr
    assert [r["iteration"] for r in _curve(run / "m.jsonl")] == [1, 2, 3, 4]
    # the first iteration ran on the pretrained LM: its weights are the pretrained ones until
    # the first update, so a fresh run's first loss differs
    fresh = tmp_path / "fresh.jsonl"
    _pretrain(0, _args(corpus, tmp_path, **{"train-iters": 1, "metrics-file": fresh}))
    assert _curve(run / "m.jsonl")[0]["ce_loss"] != _curve(fresh)[0]["ce_loss"]
    trained = weights(run)
    assert lm and not all(torch.equal(lm[k], trained[k]) for k in lm)  # then it trained


def _saved_weights(save_dir, tag: str | None = None) -> dict:
    """``{parameter name: full weight}`` in the dtype the run kept it in (not the master)."""
    return {
        k.removeprefix("weight/"): v
        for k, v in global_tensors(save_dir, tag, prefix="weight/").items()
    }


@pytest.mark.parametrize("nproc,pp", [(1, 1), (2, 2)], ids=["pp1", "pp2"])
def test_frozen_lm_checkpoints_hold_tempnet_only_and_resume_exactly(corpus, tmp_path, nproc, pp):
    """--freeze-lm --pretrained-checkpoint: checkpoints leave out the LM (re-read from the
    pretrained checkpoint on resume); 3 + exit + resume 3 equals 6 straight, bit for bit."""
    layout = {"pipeline-model-parallel-size": pp, "eval-interval": 0}
    lm = tmp_path / "lm"
    _pretrain(
        nproc,
        _args(
            corpus,
            tmp_path,
            **layout,
            save=lm,
            loss="ce",
            **{"tau-source": "fixed", "train-iters": 2},
        ),
    )

    def run(name: str, **flags) -> subprocess.CompletedProcess:
        d = tmp_path / name
        return _pretrain(
            nproc,
            _args(
                corpus,
                tmp_path,
                **layout,
                **{
                    "freeze-lm": True,
                    "pretrained-checkpoint": lm,
                    "load": d,
                    "save": d,
                    "train-iters": 6,
                    "metrics-file": d / "m.jsonl",
                    **flags,
                },
            ),
        )

    run("straight")
    run("split", **{"exit-interval": 3})
    tag = tmp_path / "split" / "iter_0000003"
    assert (tag / "FROZEN_LM_EXCLUDED").exists()
    names = list(global_tensors(tmp_path / "split", "iter_0000003"))
    assert names and all(n.split("/", 1)[1].startswith("tempnet.") for n in names)  # no LM
    saved = stored_bytes(tmp_path / "split", "iter_0000003")
    whole = stored_bytes(lm, "iter_0000002")
    assert saved < whole / 2  # the tiny LM dominates; TempNet (32 x 32) and its Adam state do not
    resumed = run("split")
    assert "the frozen LM: loading --pretrained-checkpoint" in resumed.stderr
    a, b = _curve(tmp_path / "split" / "m.jsonl"), _curve(tmp_path / "straight" / "m.jsonl")
    assert [r["iteration"] for r in a] == list(range(1, 7))
    assert all(x["loss"] == y["loss"] and x["tau_mean"] == y["tau_mean"] for x, y in zip(a, b))
    without = _pretrain(
        nproc,
        _args(
            corpus,
            tmp_path,
            **layout,
            **{"freeze-lm": True, "load": tmp_path / "split", "train-iters": 8},
        ),
        check=False,
    )
    assert without.returncode != 0
    assert "holds TempNet without the frozen LM: resume it with --freeze-lm" in without.stderr
