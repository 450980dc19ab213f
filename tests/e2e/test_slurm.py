"""The sbatch scripts of examples/ on a real single-node SLURM, with the tiny CPU overrides:
the 70B recipe runs over 2 tasks, a preempted job checkpoints, requeues and resumes to exactly the
loss curve of an uninterrupted job, and every other script runs (the ablations as a job array)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.checkpoints import global_tensors, weights
from tests.helpers.corpus import blend_corpus, pydoc_documents, save_hf_tokenizer, write_jsonl
from tests.helpers.entry_points import run_command
from tests.helpers.hf_models import add_tokenizer, save_hf_gpt2
from tests.helpers.slurm import start_slurm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
TINY = {
    "REPO": REPO,
    "PYTHON": sys.executable,
    "MODEL": "tiny",
    "DEVICE": "cpu",
    "SEQ_LENGTH": "64",
    "GLOBAL_BATCH": "4",
    "MICRO_BATCH": "2",
    "LOG_INTERVAL": "1",
    "SPLIT": "98,2,0",
}
REFERENCE_ITERS = 100


@pytest.fixture(scope="module")
def cluster():
    c = start_slurm()
    yield c
    c.stop()


# a transformers GPT-2 that converts to the `tiny` preset's architecture exactly
TINY_GPT2 = dict(
    n_positions=128,
    n_inner=256,
    activation_function="gelu",
    resid_pdrop=0.0,
    attn_pdrop=0.0,
    embd_pdrop=0.0,
    layer_norm_epsilon=1e-5,
)


@pytest.fixture(scope="module")
def llama_lm(tmp_path_factory):
    """The frozen LM as the recipes take it: a (tiny, random) Hugging Face model with its
    tokenizer, converted at TP = 2 by tools/checkpoint/convert_hf_to_megatron.py, and data
    tokenized with the checkpoint's tokenizer/. TOKENIZER_MODEL is left unset: the scripts'
    default, $LM_CHECKPOINT/tokenizer."""
    from megatron_tempnet.data.preprocess import PreprocessConfig, run_preprocess

    d = tmp_path_factory.mktemp("llama_lm")
    tokenizer = save_hf_tokenizer(str(d), vocab_size=500)
    hf = add_tokenizer(save_hf_gpt2(str(d), 500, name="hf-lm", **TINY_GPT2), tokenizer)
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "checkpoint", "convert_hf_to_megatron.py"),
        "--hf-dir",
        hf,
        "--save",
        str(d / "lm"),
        "--target-tp",
        "2",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    r = run_command(cmd, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    docs = write_jsonl(str(d / "owt.jsonl"), [{"text": t} for t in pydoc_documents()])
    spec = {
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_model": str(d / "lm" / "tokenizer"),
    }
    prefix = run_preprocess(PreprocessConfig([docs], str(d / "owt"), spec, append_eod=True))[0]
    return {
        **TINY,
        "LM_CHECKPOINT": str(d / "lm"),
        "DATA_PATH": prefix.prefix,
        "NPROC_PER_NODE": "2",
        "TP": "2",
    }


def _clip_data(directory) -> dict:
    """The digits pairs and a word-level SentencePiece tokenizer for run_clip_tempnet.sh."""
    import sentencepiece as spm

    from megatron_tempnet.models.clip.data.digits import (
        CAPTION_TEMPLATES,
        DIGIT_NAMES,
        write_digits_dataset,
    )

    paths = write_digits_dataset(str(directory / "digits"))
    captions = [
        t.format(name=n, digit=i) for t in CAPTION_TEMPLATES for i, n in enumerate(DIGIT_NAMES)
    ]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(captions),
        model_prefix=str(directory / "digits_sp"),
        vocab_size=64,
        model_type="word",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return {
        "TRAIN_DATA": paths["test"],
        "VALID_DATA": paths["test"],
        "LABEL_KEY": "label",
        "TOKENIZER_TYPE": "SentencePieceTokenizer",
        "TOKENIZER": str(directory / "digits_sp.model"),
    }


def _submit(cluster, script: str, env: dict, out: str, tasks: int = 2, *extra: str) -> str:
    args = [
        f"--ntasks-per-node={tasks}",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=10",
        f"--output={out}",
        *extra,
        os.path.join(EXAMPLES, script),
    ]
    return cluster.sbatch(args, env=dict(os.environ, **env))


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [row for row in map(json.loads, f) if "loss" in row]


def _latest(save_dir) -> str:
    with open(os.path.join(save_dir, "latest")) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def reference(cluster, llama_lm, tmp_path_factory):
    """run_llama70b_tempnet.sh, uninterrupted, REFERENCE_ITERS iterations over 2 tasks."""
    d = tmp_path_factory.mktemp("reference")
    env = {**llama_lm, "RUN_DIR": str(d / "run"), "TRAIN_ITERS": str(REFERENCE_ITERS)}
    job = _submit(cluster, "run_llama70b_tempnet.sh", env, str(d / "job.out"))
    state = cluster.wait(job, timeout=600)
    return {"job": job, "state": state, "dir": d, "exit": cluster.job_field(job, "ExitCode")}


def test_llama70b_recipe_runs_under_slurm(reference, llama_lm):
    log = (reference["dir"] / "job.out").read_text()
    assert reference["state"] == "COMPLETED" and reference["exit"] == "0:0", log[-3000:]
    assert "1 node(s) x 2 tasks x 1 CPUs on cpu" in log
    run = reference["dir"] / "run"
    rows = _rows(run / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(range(1, REFERENCE_ITERS + 1))
    assert [r["consumed_samples"] for r in rows] == [4 * i for i in range(1, len(rows) + 1)]
    assert all(r["tokens"] == 4 * 64 for r in rows)
    assert rows[-1]["lr"] < rows[len(rows) // 2]["lr"] < rows[1]["lr"]  # the cosine decay
    # the recipe: the LM frozen and left out of the checkpoints (re-read from LM_CHECKPOINT on
    # a resume), TempNet learned
    tag = _latest(run / "checkpoints")
    assert tag == f"iter_{REFERENCE_ITERS:07d}"
    assert (run / "checkpoints" / tag / "FROZEN_LM_EXCLUDED").exists()
    saved = global_tensors(run / "checkpoints")  # every value, whichever rank wrote it
    assert saved and all(k.split("/", 1)[1].startswith("tempnet.") for k in saved)
    assert rows[-1]["tau_mean"] != rows[0]["tau_mean"]
    config = json.loads((run / "checkpoints" / "config.json").read_text())
    assert config["training"]["freeze_lm"] and config["training"]["bf16"]
    assert config["loss"]["rho"] == 10 and config["loss"]["tempnet"]["tau_min"] == 0.001
    assert config["parallel"]["tensor_model_parallel_size"] == 2
    # no TOKENIZER_MODEL given: the converted checkpoint's own tokenizer
    lm_tokenizer = os.path.join(llama_lm["LM_CHECKPOINT"], "tokenizer")
    assert "TOKENIZER_MODEL" not in llama_lm and "TOKENIZER_MODEL" not in os.environ
    assert config["tokenizer"]["tokenizer_type"] == "HuggingFaceTokenizer"
    assert config["tokenizer"]["tokenizer_model"] == lm_tokenizer
    first, last = rows[:10], rows[-10:]
    assert sum(r["loss"] for r in last) < sum(
        r["loss"] for r in first
    )  # TempNet lowers the DRO loss


def _wait_for_idle_node(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
        if r.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    pytest.fail(f"the SLURM node did not become idle in {timeout:.0f} s")


def _wait_for_iteration(metrics, iteration: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(metrics) and any(r["iteration"] >= iteration for r in _rows(metrics)):
            return
        time.sleep(0.2)
    pytest.fail(f"{metrics} did not reach iteration {iteration} in {timeout:.0f} s")


@pytest.mark.parametrize("how", ["scancel --signal=USR1", "scontrol requeue"])
def test_preempted_job_resumes_to_the_same_loss_curve(cluster, llama_lm, reference, tmp_path, how):
    env = {
        **llama_lm,
        "RUN_DIR": str(tmp_path / "run"),
        "TRAIN_ITERS": str(REFERENCE_ITERS),
        "SAVE_INTERVAL": "1000",
    }
    out = tmp_path / "job.out"
    job = _submit(cluster, "run_llama70b_tempnet.sh", env, str(out), 2, "--signal=USR1@60")
    metrics = tmp_path / "run" / "metrics.jsonl"
    _wait_for_iteration(metrics, 10, timeout=300)
    subprocess.run([*how.split(), job], check=True, capture_output=True)
    # requeued: SLURM holds a requeued job back for a while before it may start again
    cluster.wait(job, timeout=120, until=lambda s: s == "PENDING")
    # starting it again before slurmd has cleaned up the first run makes SLURM kill it ("Job
    # credential revoked"): SLURM's own hold avoids that; this shortcut waits for an idle node
    _wait_for_idle_node(timeout=60)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
    state = cluster.wait(job, timeout=600)
    log = out.read_text()
    assert state == "COMPLETED" and cluster.job_field(job, "Restarts") == "1", log[-3000:]
    signal = "SIGUSR1" if "USR1" in how else "SIGTERM"
    stopped = [line for line in log.splitlines() if f"received {signal}: stopped after" in line]
    assert len(stopped) == 1, log[-3000:]
    k = int(stopped[0].split("stopped after iteration ")[1].split()[0])
    assert 10 <= k < REFERENCE_ITERS
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / f'iter_{k:07d}'}" in log
    assert f"at iteration {k}" in log
    rows, ref = _rows(metrics), _rows(reference["dir"] / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == list(
        range(1, REFERENCE_ITERS + 1)
    )  # no gap, no repeat
    for got, want in zip(rows, ref):
        for key in ("loss", "ce_loss", "tau_mean", "grad_norm", "consumed_samples"):
            assert got[key] == want[key], (got["iteration"], key)
    a = weights(tmp_path / "run" / "checkpoints")
    b = weights(reference["dir"] / "run" / "checkpoints")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory):
    corpus = blend_corpus(str(tmp_path_factory.mktemp("gpt2_data")), vocab_size=512)
    spec = corpus["spec"]
    return {
        **TINY,
        "VOCAB_FILE": spec["vocab_file"],
        "MERGE_FILE": spec["merge_file"],
        "DATA_PATH": corpus["prefix"]["A"],
        "NPROC_PER_NODE": "1",
    }


CLIP_RUN = {
    "TRAIN_ITERS": "3",
    "WARMUP_ITERS": "1",
    "MODEL": "clip-tiny",
    "EMBED_DIM": "32",
    "GLOBAL_BATCH": "8",
    "NPROC_PER_NODE": "1",
    "DEVICE": "cpu",
    "REPO": REPO,
    "PYTHON": sys.executable,
    "LOG_INTERVAL": "1",
}
"""run_clip_tempnet.sh's settings for a 3-iteration CPU job (its data and RUN_DIR apart)."""


def _submit_ablations(gpt2_data: dict, tmp_path) -> str:
    """run_ablations.sh submits its job array itself; returns the array's job id."""
    ablations = {**gpt2_data, "TRAIN_ITERS": "2", "ABLATION_DIR": str(tmp_path / "abl")}
    submit = ["bash", os.path.join(EXAMPLES, "run_ablations.sh"), "--ntasks-per-node=1",
              "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
              f"--output={tmp_path}/abl-%a.out"]  # fmt: skip
    r = subprocess.run(submit, env=dict(os.environ, **ablations), capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Submitted batch job"), r.stderr
    return r.stdout.split()[-1]


def test_every_other_script_runs_under_slurm(cluster, gpt2_data, llama_lm, tmp_path):
    """One task per job, so that two jobs share the node; finetuning waits for its pretrained LM
    (a SLURM dependency), the ablations go in as a job array submitted by the script itself."""
    iters = {"TRAIN_ITERS": "3"}
    scratch = {**gpt2_data, **iters, "RUN_DIR": str(tmp_path / "gpt2")}
    gpt2 = _submit(cluster, "run_gpt2_tempnet.sh", scratch, str(tmp_path / "gpt2.out"), 1)
    finetune = {
        **gpt2_data,
        **iters,
        "RUN_DIR": str(tmp_path / "finetune"),
        "PRETRAINED": str(tmp_path / "gpt2" / "checkpoints"),
    }
    ft = _submit(
        cluster,
        "run_gpt2_finetune_tempnet.sh",
        finetune,
        str(tmp_path / "ft.out"),
        1,
        f"--dependency=afterok:{gpt2}",
    )
    llama7b = {**llama_lm, **iters, "RUN_DIR": str(tmp_path / "llama7b"), "NPROC_PER_NODE": "2"}
    l7 = _submit(cluster, "run_llama7b_tempnet.sh", llama7b, str(tmp_path / "l7.out"), 2)
    clip = {**_clip_data(tmp_path), **CLIP_RUN, "RUN_DIR": str(tmp_path / "clip")}
    clip_job = _submit(cluster, "run_clip_tempnet.sh", clip, str(tmp_path / "clip.out"), 1)
    array = _submit_ablations(gpt2_data, tmp_path)
    for job, name in [(gpt2, "gpt2"), (ft, "ft"), (l7, "l7"), (clip_job, "clip")]:
        state = cluster.wait(job, timeout=600)
        assert state == "COMPLETED", (name, (tmp_path / f"{name}.out").read_text()[-3000:])
    for task in range(6):
        state = cluster.wait(f"{array}_{task}", timeout=600)
        assert state == "COMPLETED", (tmp_path / f"abl-{task}.out").read_text()[-3000:]

    for run in ("gpt2", "finetune", "llama7b", "clip"):
        assert [r["iteration"] for r in _rows(tmp_path / run / "metrics.jsonl")] == [1, 2, 3]
    clip_config = json.loads((tmp_path / "clip" / "checkpoints" / "config.json").read_text())
    assert clip_config["loss"]["clip_loss"] == "tempnet"
    assert (clip_config["optimizer"]["lr"], clip_config["optimizer"]["adam_beta2"]) == (2e-4, 0.999)
    assert (
        "no checkpoint in --load yet: loading --pretrained-checkpoint"
        in (tmp_path / "ft.out").read_text()
    )
    # finetuning started from the pretrained weights: its first loss is the pretrained model's
    # loss after 3 steps, not a fresh initialisation's
    fresh, tuned = (
        _rows(tmp_path / "gpt2" / "metrics.jsonl"),
        _rows(tmp_path / "finetune" / "metrics.jsonl"),
    )
    assert tuned[0]["ce_loss"] < fresh[0]["ce_loss"]
    expected = {  # name: (loss, tau source, stop-gradient)
        "ce-fixed-tau": ("ce", "fixed", True),
        "dro-newton": ("dro", "newton", True),
        "tsce-tempnet": ("ts-ce", "tempnet", True),
        "tsce-tempnet-nosg": ("ts-ce", "tempnet", False),
        "dro-tempnet-nosg": ("dro", "tempnet", False),
        "dro-tempnet": ("dro", "tempnet", True),
    }
    for name, (loss, source, stop_grad) in expected.items():
        config = json.loads((tmp_path / "abl" / name / "checkpoints" / "config.json").read_text())
        assert (config["loss"]["loss"], config["loss"]["tau_source"]) == (loss, source), name
        assert config["loss"]["tempnet"]["stop_grad"] == stop_grad, name
        assert len(_rows(tmp_path / "abl" / name / "metrics.jsonl")) == 2, name
