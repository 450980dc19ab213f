"""pretrain_gpt.py with Megatron-LM's run flags, as the LLaMA-3 example script gives them:
--mock-data with NullTokenizer, --bf16 (float32 gradients: DeepSpeed's bf16 optimizer at ZeRO 1)
at DP 2 with an exact resume, --log-throughput, --manual-gc and a torch.profiler trace of the
chosen iterations on the chosen rank; --exit-on-missing-checkpoint on an empty --load."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.flops import flops_per_token
from tests.helpers.entry_points import cli_flags, run_entry_point

SEQ, VOCAB, TEMPNET = 32, 500, (16, 16)


def _args(tmp, **flags) -> list[str]:
    base = {
        "model": "tiny",
        "mock-data": True,
        "tokenizer-type": "NullTokenizer",
        "vocab-size": VOCAB,
        "split": "'99,1,0'",
        "seq-length": SEQ,
        "train-iters": 6,
        "micro-batch-size": 2,
        "global-batch-size": 8,
        "log-interval": 1,
        "eval-interval": 3,
        "eval-iters": 1,
        "tempnet-hidden-size": TEMPNET[0],
        "tempnet-proj-size": TEMPNET[1],
        "lr": 1e-3,
        "num-workers": 0,
        "bf16": True,
        "data-cache-path": tmp / "cache",
        "distributed-timeout-minutes": 60,
    }
    return cli_flags(base, **flags)


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def test_mock_data_bf16_throughput_profile_and_resume(tmp_path):
    flags = {
        "save": tmp_path / "ckpt",
        "save-interval": 3,
        "metrics-file": tmp_path / "m.jsonl",
        "log-throughput": True,
        "manual-gc": True,
        "manual-gc-interval": 2,
        "profile": True,
        "use-pytorch-profiler": True,
        "profile-step-start": 2,
        "profile-step-end": 4,
        "profile-ranks": 1,
        "tensorboard-dir": tmp_path / "tb",
    }
    r = run_entry_point("pretrain_gpt.py", 2, _args(tmp_path, **flags))
    assert "--bf16 at --zero-stage 0 runs at ZeRO 1" in r.stderr
    rows = _rows(tmp_path / "m.jsonl")
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4, 5, 6]
    # TFLOP/s per GPU and tokens/s over the same interval: their ratio is the FLOPs per token
    model = ModelConfig.from_preset(
        "tiny", seq_length=SEQ, max_position_embeddings=128, vocab_size=VOCAB + 1
    )
    per_token = flops_per_token(model, TEMPNET)
    for row in rows:
        per_gpu = row["tokens_per_sec"] / 2  # all tokens count (no loss mask): 2 GPUs
        assert row["tflops_per_gpu"] * 1e12 == pytest.approx(per_token * per_gpu, rel=1e-3)
    traces = glob.glob(str(tmp_path / "tb" / "*_rank1.*.pt.trace.json"))
    assert len(traces) == 1 and not glob.glob(str(tmp_path / "tb" / "*_rank0.*"))
    with open(traces[0]) as f:
        steps = {e["name"] for e in json.load(f)["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= steps and "ProfilerStep#1" not in steps

    # resume from iteration 3 at the same layout: DeepSpeed's bf16 optimizer state is exact
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ckpt", resumed)
    (resumed / "latest").write_text("iter_0000003")
    shutil.rmtree(resumed / "iter_0000006")
    flags = {"load": resumed, "save": resumed, "metrics-file": tmp_path / "r.jsonl"}
    run_entry_point("pretrain_gpt.py", 2, _args(tmp_path, **flags))
    again = _rows(tmp_path / "r.jsonl")
    assert [r["iteration"] for r in again] == [4, 5, 6]
    for key in ("loss", "grad_norm", "tau_mean"):
        assert [r[key] for r in again] == [r[key] for r in rows[3:]], key


def test_exit_on_missing_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    os.makedirs(empty)
    flags = {"load": empty, "exit-on-missing-checkpoint": True}
    r = run_entry_point("pretrain_gpt.py", 0, _args(tmp_path, **flags), check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert (
        f"--load {empty}: no checkpoint there (no 'latest'), and --exit-on-missing-checkpoint "
        "stops the run instead of starting from scratch"
    ) in r.stderr
    assert not (tmp_path / "cache").exists()  # before anything was built
