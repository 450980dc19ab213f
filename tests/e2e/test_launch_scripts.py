"""Megatron-LM's, Megatron-DeepSpeed's and TempNet's launch scripts, run as their users run them.

``launch_scripts/`` holds shrunk copies: only the model (layers, hidden, heads, ffn, sequence),
the GPU count and the data and tokenizer paths differ from the originals. Each script runs in
bash with a ``torchrun`` stand-in that records its command line; the test then runs
``pretrain_gpt.py`` with exactly those flags on the script's process count (under the device
rule). A script either trains (3 iterations here) or stops at once, before any process group
starts, with one error naming every flag of a feature that is not built.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from tests.helpers.corpus import (
    pydoc_documents,
    train_gpt2_bpe,
    train_sentencepiece,
    write_jsonl,
)
from tests.helpers.entry_points import REPO, run_entry_point

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_scripts")
THREE_ITERATIONS = "--train-iters 3"


def recorded_launch(
    script: str, tmp, *positional: str, env: dict | None = None, edit: tuple[str, str] = ("", "")
):
    """Run ``script`` in bash with a ``torchrun`` that records its arguments: returns
    (``--nproc_per_node``, the flags after ``pretrain_gpt.py``). ``edit``: (a line of the
    script, what a user changes it to)."""
    path = os.path.join(SCRIPTS, script)
    if edit[0]:
        with open(path) as f:
            text = f.read()
        assert text.count(edit[0]) == 1, edit
        path = str(tmp / script)
        with open(path, "w") as f:
            f.write(text.replace(edit[0], edit[1]))
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "torchrun"
    shim.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$TORCHRUN_ARGV"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    work = tmp / "cwd"
    work.mkdir(exist_ok=True)
    if not (work / "pretrain_gpt.py").exists():
        (work / "pretrain_gpt.py").symlink_to(os.path.join(REPO, "pretrain_gpt.py"))
    argv_file = tmp / "argv"
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "TORCHRUN_ARGV": str(argv_file),
        **(env or {}),
    }
    subprocess.run(
        ["bash", path, *positional],
        env=full_env,
        cwd=work,
        check=True,
        capture_output=True,
    )
    words = argv_file.read_bytes().decode().split("\0")[:-1]
    nproc = int(words[words.index("--nproc_per_node") + 1])
    return nproc, words[words.index("pretrain_gpt.py") + 1 :]


def _preprocess(directory, spec: dict) -> str:
    """pydoc's text cut in ~1600 documents of 300 characters (the scripts' --split 949,50,1
    gives the test split one in a thousand), tokenized by ``spec``: the dataset's prefix."""
    from megatron_tempnet.data.preprocess import PreprocessConfig, run_preprocess

    docs = [t[i : i + 300] for t in pydoc_documents() for i in range(0, len(t), 300)]
    texts = write_jsonl(str(directory / "docs.jsonl"), [{"text": t} for t in docs])
    config = PreprocessConfig([texts], str(directory / "docs"), spec, append_eod=True)
    return run_preprocess(config)[0].prefix


@pytest.fixture(scope="module")
def gpt2_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2_corpus")
    vocab, merges = train_gpt2_bpe(str(d), 512)
    spec = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}
    return {"spec": spec, "prefix": _preprocess(d, spec)}


@pytest.fixture(scope="module")
def sentencepiece_corpus(tmp_path_factory):
    """A SentencePiece model (LLaMA-2's kind of tokenizer) and a dataset it tokenized."""
    d = tmp_path_factory.mktemp("sp_corpus")
    model = train_sentencepiece(str(d), vocab_size=400)
    spec = {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": model}
    return {"model": model, "prefix": _preprocess(d, spec)}


def _metrics(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_megatron_gpt3_175b_script_trains(gpt2_corpus, tmp_path):
    """TP 2 x PP 2, a batch-size ramp from 16 samples, cosine decay, GPT-2's tokenizer inferred
    from --vocab-file/--merge-file (the script names no tokenizer type)."""
    spec = gpt2_corpus["spec"]
    metrics = tmp_path / "metrics.jsonl"
    nproc, args = recorded_launch(
        "train_gpt3_175b_distributed.sh",
        tmp_path,
        str(tmp_path / "ckpt"),
        str(tmp_path / "tb"),
        spec["vocab_file"],
        spec["merge_file"],
        gpt2_corpus["prefix"],
        env={
            "PRECISION": "--bf16",
            "EXTRA_ARGS": f"{THREE_ITERATIONS} --log-interval 1 --metrics-file {metrics}",
        },
    )
    assert nproc == 4 and "--rampup-batch-size" in args
    out = run_entry_point("pretrain_gpt.py", nproc, args)
    rows = [r for r in _metrics(metrics) if "lm_loss" in r or "loss" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert "--tokenizer-type GPT2BPETokenizer" in out.stderr
    assert os.path.isdir(tmp_path / "ckpt")


def test_megatron_deepspeed_llama2_script_trains(sentencepiece_corpus, tmp_path):
    """--deepspeed --deepspeed_config=FILE, --num-key-value-heads, --normalization rmsnorm,
    GPTSentencePieceTokenizer, a weighted --data-path, TP 2 x PP 2; its activation
    checkpointing switched on as its comment says (--deepspeed-activation-checkpointing
    --recompute-granularity full --recompute-method uniform: one layer per chunk, Megatron-
    DeepSpeed's default)."""
    metrics = tmp_path / "metrics.jsonl"
    base = tmp_path / "base"
    base.mkdir()
    nproc, args = recorded_launch(
        "pretrain_llama2_distributed.sh",
        tmp_path,
        env={
            "BASE_PATH": str(base),
            "DATASET_1": sentencepiece_corpus["prefix"],
            "TOKENIZER_PATH": sentencepiece_corpus["model"],
            # the script's schedule (2000 warm-up iterations of 250000), for 3 iterations
            "EXTRA_ARGS": f"{THREE_ITERATIONS} --lr-decay-iters 250000 --metrics-file {metrics}",
        },
        edit=('activation_checkpoint="false"', 'activation_checkpoint="true"'),
    )
    assert nproc == 4 and any(a.startswith("--deepspeed_config=") for a in args)
    assert "--deepspeed-activation-checkpointing" in args
    out = run_entry_point("pretrain_gpt.py", nproc, args)
    assert [r["iteration"] for r in _metrics(metrics) if "tau_mean" in r or "loss" in r][:3] == [
        1,
        2,
        3,
    ]
    assert "--num-key-value-heads 2: --group-query-attention --num-query-groups" in out.stderr
    assert "--deepspeed-activation-checkpointing: megatron-core's checkpoint function" in out.stderr
    assert "activation recomputation: full, uniform: chunks of 1 layer\n" in out.stderr


MIXTRAL_REFUSED = [
    "--moe-router-topk",
    "--moe-router-load-balancing-type",
    "--moe-aux-loss-coeff",
    "--moe-grouped-gemm",
    "--moe-token-dispatcher-type",
    "--expert-model-parallel-size 8",
    "--num-experts 8",  # 1 (Megatron-DeepSpeed's dense runs) is accepted
]
LLAMA3_FP8_REFUSED = [
    "--fp8-format",
    "--fp8-amax-history-len",
    "--fp8-amax-compute-algo",
    "--fp8-param-gather",
]  # its --ckpt-format torch_dist is this project's format: accepted


@pytest.mark.parametrize("script", ["mixtral", "llama3-fp8"])
def test_scripts_of_unbuilt_features_stop_at_once_naming_each(
    script, sentencepiece_corpus, tmp_path
):
    """Mixture of experts, FP8: one error naming every such flag (and nothing else), before
    anything starts; every other flag of the script is accepted."""
    ckpt = str(tmp_path / "ckpt")
    sp = sentencepiece_corpus
    if script == "mixtral":
        name, positional, refused = (
            "train_mixtral_8x7b_distributed.sh",
            (ckpt, sp["model"], sp["prefix"]),
            MIXTRAL_REFUSED,
        )
    else:  # mock data and NullTokenizer, the script's default
        name, positional, refused = (
            "train_llama3_8b_h100_fp8.sh",
            (ckpt, str(tmp_path / "tb")),
            (LLAMA3_FP8_REFUSED),
        )
    nproc, args = recorded_launch(name, tmp_path, *positional)
    r = run_entry_point("pretrain_gpt.py", nproc, args, check=False)
    assert r.returncode == 1
    first = r.stderr.split("error: ", 1)[1].split("\nerror: ")[0]
    named = [line.split(":")[0].strip() for line in first.splitlines()[1:]]
    assert named == refused, first
    assert not os.path.exists(ckpt)


def _megatron_core_lrs(iterations: int, batch: int, groups: list[dict], **schedule) -> list:
    """Each iteration's learning rate per group, by megatron-core's own scheduler as
    Megatron-LM drives it with --train-samples (steps in samples, one step per iteration)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Optimizer:  # the scheduler reads and sets param_groups only
        param_groups = [dict(g) for g in groups]

    sched = OptimizerParamScheduler(Optimizer, start_wd=0.1, end_wd=0.1, wd_incr_steps=1,
                                    wd_incr_style="constant", **schedule)  # fmt: skip
    rows = []
    for _ in range(iterations):
        rows.append([g["lr"] for g in Optimizer.param_groups])
        sched.step(increment=batch)
    return rows


def test_megatron_llama3_script_trains_with_decoupled_lr_without_its_fp8_flags(tmp_path):
    """Megatron-LM's LLaMA-3 8B script without its four FP8 flags (what a user without FP8
    runs): --decoupled-lr 5e-4 / --decoupled-min-lr 4.5e-5 give the input embedding and the
    output layer their own learning rate, every iteration the one megatron-core's scheduler
    gives a group with that peak and floor (the rest: --lr 1.5e-4, --min-lr 1e-5); warm-up,
    cosine decay and floor within 6 iterations of 8 samples."""
    metrics = tmp_path / "metrics.jsonl"
    schedule = "--train-samples 48 --lr-warmup-samples 16 --lr-decay-samples 40"
    small = "--global-batch-size 8 --vocab-size 1024 --eval-iters 1"
    nproc, args = recorded_launch(
        "train_llama3_8b_h100_fp8.sh",
        tmp_path,
        str(tmp_path / "ckpt"),
        str(tmp_path / "tb"),
        env={"EXTRA_ARGS": f"{schedule} {small} --metrics-file {metrics}"},
    )
    fp8 = [i for i, a in enumerate(args) if a.startswith("--fp8-")]
    assert len(fp8) == 4
    args = [a for i, a in enumerate(args) if i not in fp8 and i - 1 not in fp8]
    assert args[args.index("--decoupled-lr") + 1] == "5.0e-4"
    run_entry_point("pretrain_gpt.py", nproc, args)
    rows = [r for r in _metrics(metrics) if "decoupled_lr" in r]
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    groups = [{"max_lr": 1.5e-4, "min_lr": 1e-5}, {"max_lr": 5e-4, "min_lr": 4.5e-5}]
    expected = _megatron_core_lrs(
        6, 8, groups, init_lr=0.0, max_lr=1.5e-4, min_lr=1e-5, lr_warmup_steps=16,
        lr_decay_steps=40, lr_decay_style="cosine",
    )  # fmt: skip
    for row, (lr, decoupled) in zip(rows, expected):
        assert row["lr"] == pytest.approx(lr, rel=1e-12, abs=1e-18), row["iteration"]
        assert row["decoupled_lr"] == pytest.approx(decoupled, rel=1e-12, abs=1e-18)
    assert rows[-1]["decoupled_lr"] == 4.5e-5 and rows[-1]["lr"] == 1e-5  # the floors


def test_tempnet_llama2_script_trains_tempnet_on_the_frozen_lm(sentencepiece_corpus, tmp_path):
    """TempNet's LLaMA-2 script: the architecture from the LM checkpoint in --load
    (--use-checkpoint-args, --exit-on-missing-checkpoint), --use-tempnet: TempNet starts fresh
    on the frozen LM; requeued, the same command resumes from TempNet's checkpoint."""
    sp, ckpt = sentencepiece_corpus, tmp_path / "ckpt"
    lm = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "64", "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp["model"],
        "--data-path", sp["prefix"], "--split", "949,50,1", "--loss", "ce",
        "--tau-source", "fixed", "--train-iters", "2", "--lr", "1e-3", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--save", str(ckpt), "--tensor-model-parallel-size", "2",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
    ]  # fmt: skip
    run_entry_point("pretrain_gpt.py", 2, lm)
    metrics = tmp_path / "metrics.jsonl"
    env = {
        "TP": "2",
        "PP": "1",
        "TOKENIZER_MODEL": sp["model"],
        "CHECKPOINT_PATH": str(ckpt),
        "DATA_PATH": sp["prefix"],
    }

    def launch(iterations: int):
        extra = f"--train-iters {iterations} --log-interval 1 --metrics-file {metrics}"
        nproc, args = recorded_launch(
            "pretrain_llama_distributed.sh", tmp_path, env={**env, "EXTRA_ARGS": extra}
        )
        return run_entry_point("pretrain_gpt.py", nproc, args)

    first = launch(3)
    assert "is an LM without TempNet: its weights are loaded and TempNet starts fresh" in (
        first.stderr
    )
    assert "--use-checkpoint-args: the architecture of" in first.stderr
    again = launch(4)  # requeued: resumes from iteration 3's TempNet checkpoint
    assert "is an LM without TempNet" not in again.stderr
    rows = [r for r in _metrics(metrics) if "tau_mean" in r and "iteration" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    # TempNet's temperatures, not one fixed tau; the LM is frozen: its cross-entropy on the
    # first batch is the LM checkpoint's
    assert all(r["tau_std"] > 0 for r in rows)
