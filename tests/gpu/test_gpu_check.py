"""The GPU acceptance run (``make gpu-check``; marker ``gpu``, never part of the default run).

1. Attention: FusedCoreAttention's bf16 forward and backward run a flash or memory-efficient
   kernel (never the math fallback) for a GPT-2 shape and a LLaMA grouped-query shape, and
   match a float32 math-kernel reference.
2. A ~100M-parameter LLaMA (12 x 768, 4 key/value groups, SwiGLU, RMSNorm, RoPE, vocabulary
   32000) trains in bf16 with TempNet, the KL-DRO loss and the fused output stage through
   pretrain_gpt.py under torchrun: its cross-entropy falls, tau varies per token within its
   bounds, validation runs, and its peak memory is within 2x of the memory planner's.
3. Exact resume: a run saved half-way and resumed continues the uninterrupted run bit for bit
   (every metric, the final weights and AdamW moments), PyTorch's deterministic algorithms on.
4. CLIP with TempNet through pretrain_clip.py on scikit-learn's digits: the loss falls and the
   zero-shot and retrieval metrics of the final validation are reported.
5. tools/generate.py and tools/evaluate.py on check 2's checkpoint: greedy generation gives the
   requested tokens and a tau for each; the perplexity and the T-LLM perplexity agree with the
   run's own validation.
6. With 2+ GPUs: a float32 GPT at 1 GPU, TP 2, PP 2 and DP 2 with ZeRO 1/2/3 gives the same loss
   curve within 1e-5, and a TP 2 checkpoint resumed at DP 2 continues the TP 2 curve.

Each training run adds a row to the summary table (conftest.py) as soon as it has run, before
its check's assertions, so a failing check keeps its numbers; each check's and each program's
wall time is in the summary too. All programs of a run share one TorchInductor/Triton cache
(``work``). ``GPU_CHECK_ON_CPU=1`` runs all of it on CPU at small sizes (harness.py), skipping
only what needs CUDA.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics

import pytest
import torch

from tests.gpu import report
from tests.gpu.attention_probe import MATH_OP, probe
from tests.gpu.data import build_tokenizer, preprocess, word_documents, write_jsonl
from tests.gpu.harness import (
    compile_cache,
    copy_checkpoint,
    device_name,
    flags,
    gpu_count,
    metrics,
    on_cpu,
    sizes,
    train_rows,
)
from tests.gpu.programs import Job, run, run_jobs, start, wait_all
from tests.helpers.corpus import digits_pairs

pytestmark = pytest.mark.gpu

LLAMA = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "untie-embeddings-and-output-weights": True,
    "position-embedding-type": "rope",
    "disable-bias-linear": True,
}
NO_DROPOUT = {"hidden-dropout": 0.0, "attention-dropout": 0.0}  # Megatron-LM's default: 0.1
EXACT = ("loss", "ce_loss", "tau_mean", "tau_std", "grad_norm", "lr", "consumed_samples")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The checks' directory; its checkpoints (gigabytes each at GPU sizes) are deleted at the
    end, its logs, metrics and compile cache kept.

    Every program is a fresh process that compiles megatron-core's fusions (torch.compile); they
    all share one TorchInductor and Triton cache, so a program that compiles what an earlier one
    did (the fusion probe, check 2's graphs in check 3) loads it instead. By default it is
    ``compile-cache`` here: every gpu-check starts cold, as the estimate in docs/testing.md
    assumes; ``GPU_CHECK_COMPILE_CACHE`` names one kept between runs."""
    path = tmp_path_factory.mktemp("gpu-check")
    cache = compile_cache() or path / "compile-cache"
    with pytest.MonkeyPatch.context() as env:
        # (torch sets TORCHINDUCTOR_CACHE_DIR in this process as soon as inductor asks for it)
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        # one Triton cache for every GPU (inductor's default is one per device index)
        env.setenv("TRITON_CACHE_DIR", str(cache / "triton"))
        yield path
    for ckpt in sorted(path.rglob("ckpt")):
        shutil.rmtree(ckpt, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(work):
    """A word-level tokenizer (32000 words at GPU sizes), Zipf-distributed word documents
    preprocessed by tools/preprocess_data.py, and held-out documents of the same law."""
    s = sizes()
    tokenizer, words = build_tokenizer(work, s.vocab)
    train = word_documents(words, s.documents, s.words_per_document, seed=1)
    heldout = word_documents(words, max(8, s.documents // 50), s.words_per_document, seed=2)
    prefix = preprocess(write_jsonl(work / "corpus.jsonl", train), tokenizer, work / "logs")
    return {
        "tokenizer": tokenizer,
        "words": words,
        "prefix": prefix,
        "heldout": write_jsonl(work / "heldout.jsonl", heldout),
    }


def _data(corpus, batch: tuple[int, int]) -> dict:
    """The corpus, its tokenizer and the (micro, global) batch: what every GPT run reads."""
    return {
        "data-path": corpus["prefix"],
        "split": "98,2,0",
        "tokenizer-type": "HuggingFaceTokenizer",
        "tokenizer-model": corpus["tokenizer"],
        "micro-batch-size": batch[0],
        "global-batch-size": batch[1],
    }


def _llama_args(corpus, out, iters: int, **extra) -> list[str]:
    s = sizes()
    return flags(
        {
            **LLAMA,
            **NO_DROPOUT,
            **s.llama,
            **s.tempnet,
            **_data(corpus, s.llama_batch),
            "train-iters": iters,
            "bf16": True,
            "loss": "dro",
            "tau-source": "tempnet",
            "lr": 1e-3,
            "lr-warmup-iters": s.warmup,
            "log-interval": 1,
            "eval-interval": iters,
            "eval-iters": 2,
            "seed": 7,
            "data-cache-path": out / "cache",
            "save": out / "ckpt",
            "metrics-file": out / "metrics.jsonl",
            **extra,
        }
    )


def _config(save_dir) -> dict:
    return json.loads((save_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def trained(corpus, work):
    """Check 2's run: the LLaMA, timed, saved at the end."""
    out = work / "llama"
    run(
        "llama",
        "pretrain_gpt.py",
        _llama_args(corpus, out, sizes().iters),
        work / "logs",
        nproc=1,
        devices=[0],
    )
    return {"ckpt": out / "ckpt", "rows": metrics(out / "metrics.jsonl")}


def test_attention_runs_a_fused_kernel_in_bf16():
    device = "cpu" if on_cpu() else "cuda"
    for name, shape in sizes().attention.items():
        got = probe(*shape, device)
        report.ATTENTION.append(
            [
                name,
                "bf16",
                ", ".join(got.fused(False)) or "-",
                ", ".join(got.fused(True)) or "-",
                ", ".join(got.kernel_names()) or "-",
            ]
        )
        for part, error in got.errors.items():  # against float32 math: bf16 rounding only
            assert error < 5e-2, (name, part, got.errors)
        if device == "cuda":  # which kernel ran: CUDA only
            assert got.fused(False) and got.fused(True), (name, got.ops)
            assert MATH_OP not in got.ops, (name, got.ops)
            assert got.kernels, (name, "no flash / memory-efficient CUDA kernel was profiled")
    if device == "cuda":
        torch.cuda.empty_cache()


def test_llama_trains_in_bf16_with_tempnet_and_the_dro_loss(trained):
    s, rows = sizes(), trained["rows"]
    train = [r for r in rows if "loss" in r]
    config = _config(trained["ckpt"])
    row = report.gpt_run(
        "LLaMA + TempNet, DRO (check 2)", config, train, 1, s.warmup, device_name()
    )
    report.TRAINING.append(row)  # first: a failing assertion below keeps the numbers
    assert [r["iteration"] for r in train] == list(range(1, s.iters + 1))
    for r in train:
        for key in ("loss", "ce_loss", "tau_mean", "tau_std", "grad_norm", "tokens_per_sec"):
            assert report.finite(r[key]) and r["memory_mb"] > 0, (r["iteration"], key, r[key])
    # it learns the words' frequencies: the cross-entropy falls from about log(vocabulary)
    first, last = train[0]["ce_loss"], statistics.mean(r["ce_loss"] for r in train[-5:])
    assert first > math.log(s.vocab) - 0.5 and last < first - s.ce_drop, (first, last)
    # TempNet: a temperature per token within [tau_min, tau_max], learned
    assert min(r["tau_min"] for r in train) >= 0.001 and max(r["tau_max"] for r in train) <= 2
    assert max(r["tau_max"] - r["tau_min"] for r in train) > 0
    assert train[-1]["tau_mean"] != train[0]["tau_mean"]
    val = [r for r in rows if "val_ppl" in r]
    assert [r["iteration"] for r in val] == [s.iters] and report.finite(val[0]["val_tllm_ppl"])
    assert val[0]["val_ppl"] == pytest.approx(math.exp(val[0]["val_ce_loss"]), rel=1e-6)
    assert (config["loss"]["loss"], config["loss"]["tau_source"]) == ("dro", "tempnet")
    assert config["loss"]["fused_output_stage"] and config["model"]["attention_backend"] == "auto"
    if not on_cpu():  # on CPU memory_mb is the resident set, not tensor memory
        assert 0.5 < row.memory_mib / row.estimate_mib < 2, (row.memory_mib, row.estimate_mib)


def _record_resume_row(name: str, path) -> None:
    """Check 3's row for one of its runs; its first iteration (start-up, compilation) left out
    of the timing, the only warm-up a run of a few iterations can spare."""
    rows = train_rows(path / "metrics.jsonl")
    warmup = rows[0]["iteration"] if rows else 0
    config = _config(path / "ckpt")
    name = f"deterministic, {name} (check 3)"
    report.TRAINING.append(report.gpt_run(name, config, rows, 1, warmup, device_name()))


def test_a_resumed_run_continues_the_uninterrupted_one_exactly(corpus, work):
    from megatron_tempnet.checkpoint.checkpoint_format import tag_for
    from megatron_tempnet.checkpoint.shard_reading import load_full, saved_tensors
    from tests.helpers.checkpoints import checkpoint_path

    s = sizes()
    iters, half = s.resume_iters, s.resume_iters // 2
    straight, resumed = work / "straight", work / "resumed"
    logs = work / "logs"
    # the same data cache for both runs: a resumed run reads the same index
    common = {"data-cache-path": work / "resume-cache", "eval-interval": half}
    run(
        "straight",
        "pretrain_gpt.py",
        _llama_args(corpus, straight, iters, **common, **{"save-interval": half}),
        logs,
        nproc=1,
        devices=[0],
        wrapper="deterministic.py",
    )
    _record_resume_row("straight", straight)
    copy_checkpoint(straight / "ckpt", half, resumed / "ckpt")
    again = run(
        "resumed",
        "pretrain_gpt.py",
        _llama_args(corpus, resumed, iters, **common, load=resumed / "ckpt"),
        logs,
        nproc=1,
        devices=[0],
        wrapper="deterministic.py",
    )
    _record_resume_row("resumed", resumed)
    assert f"resumed from {resumed / 'ckpt' / tag_for(half)}" in again.output()
    want, got = metrics(straight / "metrics.jsonl"), metrics(resumed / "metrics.jsonl")
    assert [r["iteration"] for r in got if "loss" in r] == list(range(half + 1, iters + 1))
    after = [r for r in want if r["iteration"] > half]
    assert len(got) == len(after)  # the training rows and the final validation
    for a, b in zip(got, after):
        keys = EXACT if "loss" in b else [k for k in b if k.startswith("val_")]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["iteration"]
    # every global tensor (weights, float32 masters, AdamW's moments), one at a time: the
    # checkpoints are gigabytes at GPU sizes
    dirs = [checkpoint_path(path / "ckpt", tag_for(iters)) for path in (straight, resumed)]
    a, b = (saved_tensors(d) for d in dirs)
    assert sorted(a) == sorted(b)
    assert any(fqn.startswith("weight/tempnet.") for fqn in a)
    assert any(fqn.startswith("exp_avg_sq/") for fqn in a)
    for fqn in a:
        x, y = (load_full(d, fqn, saved[fqn]) for d, saved in zip(dirs, (a, b)))
        assert torch.equal(x, y), fqn


def test_generate_and_evaluate_on_the_trained_checkpoint(corpus, trained, work):
    s, logs = sizes(), work / "logs"
    prompts = [" ".join(corpus["words"][i::997][:n]) for i, n in ((3, 5), (11, 20), (29, 1))]
    (work / "prompts.txt").write_text("".join(p + "\n" for p in prompts))
    out, summary = work / "generated.jsonl", work / "evaluation.json"
    generate = {
        "load": trained["ckpt"],
        "prompts": work / "prompts.txt",
        "output": out,
        "bf16": True,
        "max-new-tokens": s.max_new_tokens,
        "ignore-eod": True,
    }
    evaluate = {
        "load": trained["ckpt"],
        "jsonl": corpus["heldout"],
        "output": summary,
        "bf16": True,
    }
    # side by side: each reads the checkpoint and nothing else, and neither is timed
    wait_all(
        [
            start("generate", "tools/generate.py", flags(generate), logs),
            start("evaluate", "tools/evaluate.py", flags(evaluate), logs),
        ],
        s.timeout,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == prompts
    for r in records:
        assert len(r["token_ids"]) == len(r["tau"]) == s.max_new_tokens, r
        assert all(0 <= t < s.vocab for t in r["token_ids"]) and r["response"].strip()
        assert all(0.001 <= t <= 2 for t in r["tau"]) and r["tau_source"] == "tempnet"
    got = json.loads(summary.read_text())
    val = [r for r in trained["rows"] if "val_ppl" in r][-1]
    assert got["tokens"] > 1000 and 1 < got["ppl"] < s.vocab and report.finite(got["tllm_ppl"])
    # the same model on text of the same law as its validation split
    assert math.log(got["ppl"]) == pytest.approx(math.log(val["val_ppl"]), abs=0.15)
    assert math.log(got["tllm_ppl"]) == pytest.approx(math.log(val["val_tllm_ppl"]), abs=0.15)


def test_clip_with_tempnet_trains_and_evaluates(work):
    s = sizes()
    data, out = digits_pairs(str(work / "clip")), work / "clip"
    args = flags(
        {
            "train-data": data["train"],
            "valid-data": data["test"],
            "label-key": "label",
            "tokenizer-type": "SentencePieceTokenizer",
            "tokenizer-model": data["tokenizer"],
            **s.clip,
            "clip-loss": "tempnet",
            "train-iters": s.clip_iters,
            "log-interval": 1,
            "eval-interval": 0,
            "lr": 2e-3,
            "tempnet-lr": 1e-3,
            "seed": 5,
            "bf16": True,
            "image-mean": 0.5,
            "image-std": 0.5,
            "zeroshot-templates": "a handwritten digit {}",
            "metrics-file": out / "metrics.jsonl",
            "save": out / "ckpt",
        }
    )
    run("clip", "pretrain_clip.py", args, work / "logs", nproc=1, devices=[0])
    rows = metrics(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    with open(data["train"]) as f:
        pairs = sum(1 for _ in f) - 1
    config = _config(out / "ckpt")
    name = "CLIP + TempNet (check 4)"
    row = report.clip_run(name, config, train, 1, s.warmup, device_name(), pairs)
    report.TRAINING.append(row)  # first: a failing assertion below keeps the numbers
    assert [r["iteration"] for r in train] == list(range(1, s.clip_iters + 1))
    assert all(report.finite(r["loss"]) and report.finite(r["tau_mean"]) for r in train)
    assert statistics.mean(r["loss"] for r in train[-3:]) < train[0]["loss"]  # it learns
    final = [r for r in rows if "val_ir@1" in r]
    assert len(final) == 1 and final[0]["iteration"] == s.clip_iters  # evaluated at the end
    for key in ("val_zeroshot_top1", "val_ir@1", "val_tr@1", "val_ir@5"):
        assert report.finite(final[0][key]) and 0 <= final[0][key] <= 100, (key, final[0])


# float32 means float32: no TF32 matrix products, whatever the machine's defaults (NGC's
# PyTorch containers turn them on for cuBLAS), or the layouts differ by 1e-3
FP32 = {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0"}
GPT_LAYOUTS = {  # name: (processes, flags)
    "tp2": (2, {"tensor-model-parallel-size": 2}),
    "pp2": (2, {"pipeline-model-parallel-size": 2}),
    "dp2-zero1": (2, {"zero-stage": 1}),
    "dp2-zero2": (2, {"zero-stage": 2}),
    "dp2-zero3": (2, {"zero-stage": 3}),
}


def _from_init(root) -> dict:
    """Check 6's runs start from the initial weights: ``--load INIT --finetune``."""
    return {"load": root / "init" / "ckpt", "finetune": True}


def _gpt_args(corpus, root, name: str, **extra) -> list[str]:
    """pretrain_gpt.py flags of check 6's float32 GPT run ``name`` (its files in root/name)."""
    s = sizes()
    return flags(
        {
            **s.gpt,
            **NO_DROPOUT,  # the layouts draw other dropout masks: the curves would differ
            **_data(corpus, s.gpt_batch),
            "train-iters": s.gpt_iters,
            "log-interval": 1,
            "eval-interval": 0,
            "lr": 1e-3,
            "lr-warmup-iters": 2,
            "seed": 3,
            "num-workers": 0,
            "data-cache-path": root / name / "cache",
            "metrics-file": root / name / "metrics.jsonl",
            **s.tempnet,
            **extra,
        }
    )


@pytest.fixture(scope="module")
def layout_runs(corpus, work):
    """Check 6's runs (-> their directory). All start from one set of weights, a 1-iteration
    run's at lr 0: a GPU initialises each TP shard from its own stream, so layouts trained
    from scratch would start apart. TP 2 saves half-way; DP 2 resumes from that checkpoint."""
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, {gpu_count()} here")
    root, logs, half = work / "layouts", work / "logs", sizes().gpt_iters // 2
    init = {"train-iters": 1, "lr": 0.0, "lr-warmup-iters": 0, "save": root / "init" / "ckpt"}
    run_jobs(
        [Job("init", "pretrain_gpt.py", _gpt_args(corpus, root, "init", **init), 1, FP32)], logs
    )
    from_init = _from_init(root)
    argv = _gpt_args(corpus, root, "1gpu", **from_init)
    jobs = [Job("gpt-1gpu", "pretrain_gpt.py", argv, 1, FP32)]
    for name, (nproc, layout) in GPT_LAYOUTS.items():
        save = {"save": root / name / "ckpt", "save-interval": half} if name == "tp2" else {}
        argv = _gpt_args(corpus, root, name, **from_init, **layout, **save)
        jobs.append(Job(f"gpt-{name}", "pretrain_gpt.py", argv, nproc, FP32))
    try:
        run_jobs(jobs, logs)
    finally:  # before any assertion: the rows of the runs that finished, even if one failed
        _record_layout_rows(corpus, root)
    resume = {"load": root / "resumed" / "ckpt", "zero-stage": 1}
    copy_checkpoint(root / "tp2" / "ckpt", half, root / "resumed" / "ckpt")
    argv = _gpt_args(corpus, root, "resumed", **resume)
    done = run_jobs([Job("gpt-resumed-dp2", "pretrain_gpt.py", argv, 2, FP32)], logs)
    assert "resharded from TP 2 x PP 1 x DP 1" in done["gpt-resumed-dp2"].output()
    return root


def test_parallel_layouts_give_the_same_float32_curve(corpus, layout_runs):
    root, half = layout_runs, sizes().gpt_iters // 2
    reference = train_rows(root / "1gpu" / "metrics.jsonl")
    assert [r["iteration"] for r in reference] == list(range(1, sizes().gpt_iters + 1))
    assert reference[-1]["loss"] < reference[0]["loss"]  # it learns
    curves = {name: train_rows(root / name / "metrics.jsonl") for name in GPT_LAYOUTS}
    # each layout against one GPU; the DP 2 resume against the TP 2 run it was saved from
    pairs = [(name, curve, reference) for name, curve in curves.items()]
    pairs.append(("resumed", train_rows(root / "resumed" / "metrics.jsonl"), curves["tp2"][half:]))
    for name, curve, ref in pairs:
        assert [r["iteration"] for r in curve] == [r["iteration"] for r in ref], name
        for got, want in zip(curve, ref):
            for key in ("loss", "ce_loss", "tau_mean", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (name, got["iteration"])
            assert got["consumed_samples"] == want["consumed_samples"]


def _record_layout_rows(corpus, root) -> None:
    """Check 6's rows, one per layout whose run logged every iteration."""
    for name, (nproc, layout) in {"1gpu": (1, {}), **GPT_LAYOUTS}.items():
        path = root / name / "metrics.jsonl"
        rows = train_rows(path) if path.exists() else []
        if len(rows) < sizes().gpt_iters:
            continue
        config = _resolved(_gpt_args(corpus, root, name, **_from_init(root), **layout))
        row = report.gpt_run(f"GPT fp32 {name} (check 6)", config, rows, nproc, 2, device_name())
        report.TRAINING.append(row)


def _resolved(argv: list[str]) -> dict:
    """The config pretrain_gpt.py resolves from ``argv`` (what it saves as config.json; the
    vocabulary comes from the tokenizer)."""
    from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args

    config = json.loads(config_from_args(build_parser().parse_args(argv)).to_json())
    config["model"]["vocab_size"] = sizes().vocab
    return config
