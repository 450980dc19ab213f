"""TempNet export, TempNetLogitsProcessor in plain HF generate, tools/generate.py at TP 1 and 2,
tools/evaluate.py's T-LLM perplexity and the lm-eval adapter, against references written here.

A TempNet is trained with pretrain_gpt.py on a frozen LLaMA converted from a tiny random
transformers model, so the HF model and our checkpoints hold the same LM."""

from __future__ import annotations

import glob
import json
import math
import os
import sys

import pytest
import torch

from tests.e2e.test_hf_interop import ENV, REPO, convert, corpus_run_args, model_args, tool
from tests.helpers.corpus import blend_corpus, pydoc_documents, tokenizer_flags
from tests.helpers.distributed import run_distributed
from tests.helpers.entry_points import cli_flags, run_command, run_entry_point
from tests.helpers.hf_models import load_hf, save_hf_gpt2, save_hf_llama
from tests.helpers.reference import dro_dtau_reference


def _train(setup, ckpt, out, nproc: int, iters: int, extra: list[str] = ()) -> None:
    args = [
        *model_args(ckpt),
        *corpus_run_args(setup, iters, 32),
        "--lr",
        "3e-3",
        "--freeze-lm",
        "--pretrained-checkpoint",
        ckpt,
        "--load",
        str(out),
        "--save",
        str(out),
        "--tensor-model-parallel-size",
        str(nproc),
        # HF GPT-2's dropout (0.1, in model_flags.txt) would draw other masks at each TP size
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        *extra,
    ]
    run_entry_point("pretrain_gpt.py", nproc, args, env=ENV)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("inference")
    corpus = blend_corpus(str(d), vocab_size=500)
    s = {
        "dir": d,
        "corpus": corpus,
        "tokenizer": corpus["tokenizer"],
        "vocab": 500,
        "llama": save_hf_llama(str(d), 500),
    }
    s["ckpt"] = convert(s["llama"], d / "llama-tp2", tp=2)
    _train(s, s["ckpt"], d / "run", nproc=2, iters=20)
    s["run"] = str(d / "run")
    tool("export_tempnet.py", "--load", s["run"], "--output", d / "tempnet")
    s["tempnet"] = str(d / "tempnet")
    return s


def reference_tau(logits: torch.Tensor, tempnet_dir: str, tau_max: float | None = None):
    """docs/design.md §2 in float64 from the exported file: logits [n, >= V] -> tau [n]."""
    from safetensors.torch import load_file

    w = {
        k: v.double()
        for k, v in load_file(os.path.join(tempnet_dir, "tempnet.safetensors")).items()
    }
    with open(os.path.join(tempnet_dir, "tempnet_config.json")) as f:
        c = json.load(f)
    L = logits[:, : c["vocab_size"]].double()
    v = torch.sigmoid(L / L.norm(dim=1, keepdim=True) @ w["weight1"].t() + w["bias1"])
    u = v @ w["weight2"].t()
    attention = torch.softmax(u / w["pooling.log_phi"].exp(), dim=1) - 1.0 / u.shape[1]
    s = (attention * w["pooling.w3"] * u).sum(1) - w["pooling.bias"]
    upper = tau_max if tau_max is not None else c["tau_max"]
    return (upper - c["tau0"]) * torch.sigmoid(s) + c["tau0"]


def test_exported_tempnet_is_the_same_network_at_tp1_and_tp4(setup, tmp_path):
    gpt2 = save_hf_gpt2(str(tmp_path), setup["vocab"])  # 4 heads: TP 4 possible
    exports = {}
    for tp in (1, 4):
        ckpt = convert(gpt2, tmp_path / f"gpt2-tp{tp}", tp=tp)
        _train(setup, ckpt, tmp_path / f"run{tp}", nproc=tp, iters=4)
        tool("export_tempnet.py", "--load", tmp_path / f"run{tp}", "--output", tmp_path / f"t{tp}")
        exports[tp] = tmp_path / f"t{tp}"
    from safetensors.torch import load_file

    one, four = (load_file(str(exports[tp] / "tempnet.safetensors")) for tp in (1, 4))
    assert (
        sorted(one)
        == sorted(four)
        == sorted(["weight1", "bias1", "weight2", "pooling.w3", "pooling.bias", "pooling.log_phi"])
    )
    assert one["weight1"].shape == (32, 500)  # full network over the true vocabulary
    initial = load_file(str(exports[1] / "tempnet.safetensors"))["weight1"]
    for name in one:
        torch.testing.assert_close(four[name], one[name], rtol=1e-5, atol=1e-6)
    configs = [json.load(open(exports[tp] / "tempnet_config.json")) for tp in (1, 4)]
    for c in configs:
        c["trained_with"].pop("checkpoint")
    assert configs[0] == configs[1]
    assert {
        k: configs[0][k]
        for k in ("vocab_size", "d1", "d2", "tau0", "tau_max", "input_normalization")
    } == {
        "vocab_size": 500,
        "d1": 32,
        "d2": 32,
        "tau0": 0.001,
        "tau_max": 2.0,
        "input_normalization": "l2",
    }
    assert initial.abs().sum() > 0


def _our_tau(run: str, tokens: torch.Tensor):
    from megatron_tempnet.inference.model import init_inference, load_inference_model

    init_inference(1)
    model = load_inference_model(run)
    logits = model.logits(tokens)
    return logits, model.tempnet(logits)


def _hf_generate(hf, prompt, new_tokens: int, processor=None, **kw):
    """transformers' ``generate``: ``new_tokens`` after ``prompt`` (pad id 0), greedy unless
    ``kw`` says otherwise, through the logits ``processor`` when one is given."""
    from transformers import LogitsProcessorList

    processors = None if processor is None else LogitsProcessorList([processor])
    kw = {"do_sample": False, **kw}
    return hf.generate(
        prompt, max_new_tokens=new_tokens, pad_token_id=0, logits_processor=processors, **kw
    )


def test_logits_processor_gives_our_tau_and_drives_hf_generate(setup, tmp_path):
    from megatron_tempnet.inference.hf import TempNetLogitsProcessor

    tokens = torch.randint(0, 500, (1, 20), generator=torch.Generator().manual_seed(1))
    ours_logits, ours = run_distributed(_our_tau, world_size=1, args=(setup["run"], tokens))[0]
    hf = load_hf(setup["llama"])
    with torch.no_grad():
        hf_logits = hf(tokens).logits[0]  # [s, V]
    processor = TempNetLogitsProcessor(setup["tempnet"])
    for t in range(tokens.shape[1]):
        processor(tokens[:, : t + 1], hf_logits[t : t + 1].clone())
    got = processor.taus[0]  # [s]
    want = reference_tau(hf_logits, setup["tempnet"])
    torch.testing.assert_close(got.double(), ours[0].double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    assert float(want.std()) > 0  # TempNet gives different tokens different temperatures
    scaled = processor(tokens, hf_logits[:1].clone())
    torch.testing.assert_close(scaled, hf_logits[:1] / processor.taus[0, -1], rtol=1e-6, atol=0)

    prompt = torch.tensor([setup["tokenizer"].tokenize("The module")])
    processor.reset()
    plain = _hf_generate(hf, prompt, 6)
    with_tau = _hf_generate(hf, prompt, 6, processor)
    assert torch.equal(plain, with_tau)  # dividing by tau > 0 keeps the argmax
    assert processor.taus.shape == (1, 6)
    # transformers' own processors run first: min_new_tokens sets the end token's score to -inf,
    # which must not make TempNet's input (and every score) NaN
    floor = TempNetLogitsProcessor(setup["tempnet"])
    at_least = _hf_generate(hf, prompt, 6, floor, min_new_tokens=6)
    assert torch.equal(at_least, with_tau) and bool(floor.taus.isfinite().all())
    # tools/generate.py on our checkpoint: the same greedy tokens and the same taus
    (tmp_path / "p.txt").write_text("The module\n")
    tool(
        "generate.py",
        "--load",
        setup["run"],
        "--prompts",
        tmp_path / "p.txt",
        "--output",
        tmp_path / "g.jsonl",
        "--max-new-tokens",
        6,
        "--ignore-eod",
    )
    record = json.loads((tmp_path / "g.jsonl").read_text())
    assert record["token_ids"] == with_tau[0, prompt.shape[1] :].tolist()
    torch.testing.assert_close(torch.tensor(record["tau"]), processor.taus[0], rtol=0, atol=1e-5)
    processor.reset()
    sampled = _hf_generate(hf, prompt, 6, processor, do_sample=True, top_p=0.9, temperature=1.0)
    assert sampled.shape == (1, prompt.shape[1] + 6) and processor.taus.shape == (1, 6)


def _generate(setup, tmp_path, name: str, nproc: int, *flags) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    cmd = [
        sys.executable,
        *(
            ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            if nproc > 1
            else []
        ),
        os.path.join(REPO, "tools", "generate.py"),
        "--load",
        setup["run"],
        "--tensor-model-parallel-size",
        str(nproc),
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--output",
        str(out),
        "--max-new-tokens",
        "12",
        "--ignore-eod",
        *map(str, flags),
    ]
    r = run_command(cmd, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # progress on rank 0 (plain lines: no terminal), through the 12-token budget of each prompt
    budget = 12 * len(records)
    assert r.stderr.count(f"generating: 100% {budget}/{budget} tok in ") == 1, r.stderr[-3000:]
    return records


def test_generate_tool_is_the_same_at_tp1_and_tp2(setup, tmp_path):
    """TP 1 generates the prompts (of different lengths) in one cached batch, TP 2 two at a time;
    greedy tokens also equal the recompute path's (each prompt alone) and HF generate's."""
    prompts = ["The module", "import os", "Return the value of the first argument", "x"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    hf = load_hf(setup["llama"])
    for mode in (
        ["--seed", 1],
        ["--sample", "--seed", 5],
        ["--sample", "--top-k", 20, "--top-p", 0.8, "--seed", 5],
    ):
        one = _generate(setup, tmp_path, "one", 1, *mode)
        two = _generate(setup, tmp_path, "two", 2, *mode, "--micro-batch-size", 2)
        if mode == ["--seed", 1]:
            alone = _generate(setup, tmp_path, "alone", 1, "--micro-batch-size", 1, "--no-kv-cache")
            assert [r["token_ids"] for r in alone] == [r["token_ids"] for r in one]
            for p, record in zip(prompts, one):
                ids = torch.tensor([setup["tokenizer"].tokenize(p)])
                want = _hf_generate(hf, ids, 12)[0, ids.shape[1] :].tolist()
                # (HF stops at its end token, 0; ours ran on with --ignore-eod)
                assert record["token_ids"][: len(want)] == want and len(want) >= 4, p
        assert [r["prompt"] for r in one] == prompts
        for a, b in zip(one, two):
            assert a["token_ids"] == b["token_ids"], mode
            assert len(a["tau"]) == len(a["token_ids"]) == 12
            torch.testing.assert_close(
                torch.tensor(a["tau"]), torch.tensor(b["tau"]), rtol=0, atol=1e-6
            )
            assert a["response"] == setup["tokenizer"].detokenize(a["token_ids"])
            # a character split over byte-level pieces is the text of the piece completing it
            assert "".join(a["tokens"]) == a["response"]
    sampled = _generate(setup, tmp_path, "s", 1, "--sample", "--seed", 5)
    assert (
        sampled[0]["token_ids"]
        != _generate(setup, tmp_path, "s2", 1, "--sample", "--seed", 6)[0]["token_ids"]
    )
    capped = _generate(setup, tmp_path, "cap", 1, "--tau-max-eval", 0.5)
    assert max(t for r in capped for t in r["tau"]) <= 0.5
    fixed = _generate(setup, tmp_path, "fixed", 1, "--fixed-tau", 0.7)
    assert all(t == pytest.approx(0.7) for r in fixed for t in r["tau"])
    assert fixed[0]["tau_source"] == "fixed"


def _target_upper_bound(taus: torch.Tensor, target: float, tau0=0.001, tau_max=2.0) -> float:
    """The paper's inference-time scaling, from its definition: the upper bound U with
    mean(tau0 + (U - tau0) sigmoid(s)) = target, where taus = tau0 + (tau_max - tau0) sigmoid(s)."""
    sigmoid_mean = ((taus.double() - tau0) / (tau_max - tau0)).mean().item()
    return tau0 + (target - tau0) / sigmoid_mean


def test_tau_target_mean_scales_tempnets_upper_bound(setup, tmp_path):
    """--tau-target-mean in generate (the prompts as the sample at TP 2, --tau-target-sample at
    TP 1) and TempNetLogitsProcessor.fit_mean choose the upper bound that makes the reference
    TempNet's mean tau over the prompts' tokens the target; every generated token's tau is the
    reference TempNet's at that bound on HF's logits."""
    prompts = ["The module", "import os", "Return the value of the first argument"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (tmp_path / "sample.txt").write_text("".join(p + "\n" for p in prompts))
    ids = [setup["tokenizer"].tokenize(p) for p in prompts]
    hf = load_hf(setup["llama"])
    with torch.no_grad():
        logits = [hf(torch.tensor([i])).logits[0].double() for i in ids]
    sample_taus = reference_tau(torch.cat(logits), setup["tempnet"])
    upper = _target_upper_bound(sample_taus, 0.5)
    assert upper < 1.5  # this TempNet's taus are near 1: the bound comes down
    runs = {
        "tp2": _generate(setup, tmp_path, "t2", 2, "--tau-target-mean", 0.5),
        "tp1": _generate(
            setup,
            tmp_path,
            "t1",
            1,
            "--tau-target-mean",
            0.5,
            "--tau-target-sample",
            tmp_path / "sample.txt",
        ),  # fmt: skip
    }
    for name, records in runs.items():
        for record, prompt in zip(records, ids):
            assert record["sampling"]["tau_max_eval"] == pytest.approx(upper, rel=2e-6), name
            with torch.no_grad():
                full = hf(torch.tensor([prompt + record["token_ids"][:-1]])).logits[0].double()
            want = reference_tau(full[len(prompt) - 1 :], setup["tempnet"], tau_max=upper)
            torch.testing.assert_close(
                torch.tensor(record["tau"], dtype=torch.float64), want, rtol=0, atol=2e-5
            )
    from megatron_tempnet.inference.hf import TempNetLogitsProcessor

    processor = TempNetLogitsProcessor(setup["tempnet"])
    assert processor.fit_mean(torch.cat(logits).float(), 0.5) == pytest.approx(upper, rel=2e-6)
    assert processor.tempnet(torch.cat(logits).float()).mean().item() == pytest.approx(0.5, 1e-5)


def test_generate_tool_errors(setup, tmp_path):
    def run(*args, expect: str):
        out = tmp_path / "out.jsonl"
        r = tool("generate.py", *args, "--output", out, check=False)
        assert r.returncode == 1 and expect in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not out.exists()

    (tmp_path / "ok.txt").write_text("hello\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "long.txt").write_text("word " * 80 + "\n")
    run(
        "--load",
        tmp_path / "missing",
        "--prompts",
        tmp_path / "ok.txt",
        expect="--load " + str(tmp_path / "missing"),
    )
    run("--load", setup["run"], "--prompts", tmp_path / "nope.txt", expect="nope.txt: no such")
    run("--load", setup["run"], "--prompts", tmp_path / "bad.jsonl", expect="bad.jsonl:2")
    run("--load", setup["run"], "--prompts", tmp_path / "empty.txt", expect="no prompts")
    for flags, expect in (
        (["--tau-target-mean", 0.0005], "--tau-target-mean 0.0005: the target mean tau"),
        (["--tau-target-mean", 0.7, "--fixed-tau", 1], "not with --fixed-tau"),
        (["--tau-target-sample", tmp_path / "ok.txt"], "give both"),
    ):
        run("--load", setup["run"], "--prompts", tmp_path / "ok.txt", *flags, expect=expect)
    run("--load", setup["run"], "--prompts", tmp_path / "long.txt", expect="positions")
    run("--load", setup["run"], "--prompts", tmp_path / "ok.txt", "--top-p", 0, expect="--top-p")
    run("--load", setup["ckpt"], "--prompts", tmp_path / "ok.txt", expect="no tokenizer saved")
    tokenizer = cli_flags(tokenizer_flags(setup["corpus"]["spec"]))
    run(
        "--load",
        setup["ckpt"],
        "--prompts",
        tmp_path / "ok.txt",
        *tokenizer,
        expect="no TempNet in it: give --tempnet or --fixed-tau",
    )


def _hf_scores(setup, documents: list[list[int]]):
    """Per-token CE and T-LLM CE (softmax(L / tau), tau from reference_tau) with the HF model."""
    hf = load_hf(setup["llama"])
    ce, tllm = [], []
    for doc in documents:
        with torch.no_grad():
            logits = hf(torch.tensor([doc[:-1]])).logits[0].double()  # [s, V]
        tau = reference_tau(logits, setup["tempnet"])
        target = torch.tensor(doc[1:])
        ce.append(-logits.log_softmax(-1).gather(1, target[:, None])[:, 0])
        tllm.append(-(logits / tau[:, None]).log_softmax(-1).gather(1, target[:, None])[:, 0])
    return torch.cat(ce), torch.cat(tllm), tllm


def _numpy_calibration(logits: torch.Tensor, tau: torch.Tensor, target: torch.Tensor) -> dict:
    """ECE (15 equal-width bins, numpy's digitize), Brier (the whole probability vectors) and
    NLL of softmax(logits / tau) in numpy float64."""
    import numpy as np

    z = (logits / tau[:, None]).numpy()
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = target.numpy()
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    top, correct = p.max(1), p.argmax(1) == y
    which = np.clip(np.digitize(top, np.linspace(0, 1, 16), right=True) - 1, 0, 14)
    ece = sum(
        (which == b).mean() * abs(correct[which == b].mean() - top[which == b].mean())
        for b in range(15)
        if (which == b).any()
    )
    return {
        "ece": float(ece),
        "brier": float(((p - onehot) ** 2).sum(1).mean()),
        "nll": float(-np.log(p[np.arange(len(y)), y]).mean()),
    }


def _evaluate_command(run: str, jsonl, tp: int) -> list[str]:
    """tools/evaluate.py on ``jsonl``'s documents, each scored on its own, at TP ``tp``."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return [sys.executable, *(launcher if tp == 2 else []),
            os.path.join(REPO, "tools", "evaluate.py"), "--load", run,
            "--tensor-model-parallel-size", str(tp), "--jsonl", str(jsonl),
            "--documents", "separate"]  # fmt: skip


def test_evaluate_tllm_perplexity_matches_a_reference(setup, tmp_path):
    """tools/evaluate.py at TP 1 (whole logits) and TP 2 (fused, chunks of 7): per-token T-LLM
    log-probabilities, perplexities and tau statistics equal HF's with the reference TempNet;
    --calibration's ECE, Brier and NLL at each tau (1, TempNet's; beside Newton, TempNet's and
    the grid's best) equal numpy's on HF's logits."""
    texts = [t[:110] for t in pydoc_documents(6)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    documents = [setup["tokenizer"].tokenize(t) for t in texts]
    assert max(len(d) for d in documents) <= 64  # one window each (the model has 64 positions)
    ce, tllm, per_doc = _hf_scores(setup, documents)
    results = {}
    for tp in (1, 2):
        # TP 1 forms the whole logits; TP 2 scores from the hidden states in chunks of 7 tokens
        stage = ["--no-fused-output-stage"] if tp == 1 else ["--output-stage-chunk-size", "7"]
        cmd = _evaluate_command(setup["run"], tmp_path / "docs.jsonl", tp) + stage
        cmd += ["--output", str(tmp_path / f"e{tp}.json"), "--calibration"]
        cmd += ["--per-token-output", str(tmp_path / f"t{tp}.jsonl")]
        r = run_command(cmd, env=ENV, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        n = sum(len(d) - 1 for d in documents)  # progress on rank 0, through every target
        assert r.stderr.count(f"scoring: 100% {n}/{n} tok in ") == 1, r.stderr[-3000:]
        results[tp] = json.loads((tmp_path / f"e{tp}.json").read_text())
        rows = [json.loads(x) for x in (tmp_path / f"t{tp}.jsonl").read_text().splitlines()]
        for row, want in zip(rows, per_doc):
            torch.testing.assert_close(
                torch.tensor(row["tllm_logprob"], dtype=torch.float64), -want, rtol=0, atol=2e-5
            )
        taus = torch.tensor([t for row in rows for t in row["tau"]], dtype=torch.float64)
        want_std = taus.std(correction=0).item()
        assert results[tp]["tau_std"] == pytest.approx(want_std, rel=1e-6, abs=1e-9)
    for tp in (1, 2):
        got = results[tp]
        assert got["tokens"] == sum(len(d) - 1 for d in documents) == ce.numel()
        assert got["tllm_ppl"] == pytest.approx(math.exp(tllm.mean().item()), rel=1e-5)
        assert got["ppl"] == pytest.approx(math.exp(ce.mean().item()), rel=1e-5)
    assert results[1]["tllm_ppl"] != pytest.approx(results[1]["ppl"], rel=1e-6)
    # calibration at tau = 1 and at TempNet's tau, against numpy on HF's logits
    hf = load_hf(setup["llama"])
    with torch.no_grad():
        logits = torch.cat([hf(torch.tensor([d[:-1]])).logits[0].double() for d in documents])
    target = torch.cat([torch.tensor(d[1:]) for d in documents])
    tau = reference_tau(logits, setup["tempnet"])
    want = {
        "tau_1": _numpy_calibration(logits, torch.ones_like(tau), target),
        "scored": _numpy_calibration(logits, tau, target),
    }
    for tp in (1, 2):
        got = results[tp]["calibration"]
        assert set(got) == set(want)
        for source, values in want.items():
            for key, value in values.items():
                assert got[source][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (tp, source)
            assert sum(b["count"] for b in got[source]["bins"]) == target.numel()
    # beside --tau-source newton: TempNet's tau, scaled to a mean of 0.6 over the scored tokens
    # (--tau-target-mean), and the grid's best fixed tau too
    cmd = [sys.executable, os.path.join(REPO, "tools", "evaluate.py"), "--load", setup["run"],
           "--jsonl", str(tmp_path / "docs.jsonl"), "--documents", "separate", "--tau-source",
           "newton", "--tau-grid", "0.5", "2.0", "--calibration", "--tau-target-mean", "0.6",
           "--output", str(tmp_path / "newton.json")]  # fmt: skip
    r = run_command(cmd, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "newton.json").read_text())
    upper = _target_upper_bound(tau, 0.6)
    assert got["tau_target"]["tau_max_eval"] == pytest.approx(upper, rel=1e-5)
    assert got["tau_max_eval"] == got["tau_target"]["tau_max_eval"]
    assert got["tau_target"]["tau_mean_trained"] == pytest.approx(tau.mean().item(), rel=1e-5)
    assert got["tempnet_tau_mean"] == pytest.approx(0.6, rel=1e-6)
    scaled = reference_tau(logits, setup["tempnet"], tau_max=upper)
    best = got["best_fixed_tau"]
    assert set(got["calibration"]) == {"tau_1", "scored", "tempnet", "best_fixed"}
    for source, at in (("tempnet", scaled), ("best_fixed", torch.full_like(tau, best))):
        for key, value in _numpy_calibration(logits, at, target).items():
            assert got["calibration"][source][key] == pytest.approx(value, rel=1e-6, abs=1e-9)


def _reference_optimum(logits: torch.Tensor, rho: float, low: float, high: float) -> torch.Tensor:
    """Each row's minimiser of eq. (2) over [low, high]: the root of eq. (10)'s df/dtau, found by
    scipy's brentq on the float64 reference (projected onto a bound when df/dtau keeps a sign)."""
    from scipy.optimize import brentq

    def slope(row, tau):
        return dro_dtau_reference(row, torch.tensor(tau), rho).item()

    taus = []
    for row in logits.double():
        if slope(row, low) >= 0:
            taus.append(low)
        elif slope(row, high) <= 0:
            taus.append(high)
        else:
            taus.append(brentq(lambda t, row=row: slope(row, t), low, high, xtol=1e-12))
    return torch.tensor(taus, dtype=torch.float64)


def test_evaluate_scores_with_each_tokens_dro_optimum_beside_tempnet(setup, tmp_path):
    """--tau-source newton at TP 2 (fused, chunks of 5): every token's tau is the exact
    minimiser of eq. (2) (a brentq reference), its T-LLM score follows it, and TempNet's own
    tau, T-LLM perplexity and correlation with the optimum are reported; --tau-grid's
    perplexities come from the same pass."""
    texts = [t[:80] for t in pydoc_documents(3)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    documents = [setup["tokenizer"].tokenize(t) for t in texts]
    cmd = _evaluate_command(setup["run"], tmp_path / "docs.jsonl", 2)
    cmd += ["--tau-source", "newton", "--rho", "3", "--tempnet-tau-max", "1.5"]
    cmd += ["--output-stage-chunk-size", "5", "--tau-grid", "0.7", "1.3"]
    cmd += ["--output", str(tmp_path / "e.json"), "--per-token-output", str(tmp_path / "t.jsonl")]
    r = run_command(cmd, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "e.json").read_text())
    rows = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    settings = (summary["tau_source"], summary["rho"], summary["tau_min"], summary["tau_max"])
    assert settings == ("newton", 3.0, 0.001, 1.5)
    hf = load_hf(setup["llama"])
    optimum, tempnet, tllm, beside, grid = [], [], [], [], {0.7: [], 1.3: []}
    for doc, row in zip(documents, rows):
        with torch.no_grad():
            logits = hf(torch.tensor([doc[:-1]])).logits[0].double()  # [s, V]
        tau = _reference_optimum(logits, 3.0, 0.001, 1.5)
        target = torch.tensor(doc[1:])
        scaled = (logits / tau[:, None]).log_softmax(-1).gather(1, target[:, None])[:, 0]
        optimum.append(tau)
        tempnet.append(reference_tau(logits, setup["tempnet"]))
        tllm.append(-scaled)
        for t, values in [(tempnet[-1][:, None], beside), *((t, grid[t]) for t in grid)]:
            values.append(-(logits / t).log_softmax(-1).gather(1, target[:, None])[:, 0])
        torch.testing.assert_close(
            torch.tensor(row["tau"], dtype=torch.float64), tau, rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(
            torch.tensor(row["tempnet_tau"], dtype=torch.float64), tempnet[-1], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            torch.tensor(row["tllm_logprob"], dtype=torch.float64), scaled, rtol=0, atol=2e-5
        )
    optimum, tempnet = torch.cat(optimum), torch.cat(tempnet)
    assert 0.001 < optimum.min() < optimum.max() < 1.5  # interior optima, not just the bounds
    assert summary["tllm_ppl"] == pytest.approx(math.exp(torch.cat(tllm).mean().item()), rel=1e-5)
    assert summary["tempnet_tau_mean"] == pytest.approx(tempnet.mean().item(), rel=1e-5)
    ppl = {t: math.exp(torch.cat(v).mean().item()) for t, v in grid.items()}
    assert summary["tau_grid"] == pytest.approx({f"{t:g}": v for t, v in ppl.items()}, rel=1e-5)
    assert summary["best_fixed_tau"] == min(ppl, key=ppl.get)
    assert summary["tempnet_tllm_ppl"] == pytest.approx(
        math.exp(torch.cat(beside).mean().item()), rel=1e-5
    )
    correlation = torch.corrcoef(torch.stack([optimum, tempnet]))[0, 1].item()
    assert summary["tau_correlation"] == pytest.approx(correlation, abs=1e-4)


def _lm_eval(setup, tmp_path, name: str, nproc: int, *extra) -> tuple[dict, dict]:
    """lm-eval's results and its logged samples by (task, doc id) for the three local tasks."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [
        sys.executable,
        *(launcher if nproc > 1 else []),
        "-m",
        "megatron_tempnet.inference.lm_eval_adapter",
        "run",
        "--model",
        "megatron_tempnet",
        "--model_args",
        f"load={setup['run']}",
        "--tasks",
        "tiny_mc,tiny_roll,tiny_gen",
        "--include_path",
        str(tmp_path),
        "--output_path",
        str(tmp_path / name),
        "--log_samples",
        *extra,
    ]
    env = dict(
        ENV,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "hf-cache"),
    )
    r = run_command(cmd, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = tmp_path / name / "**"
    results = json.loads(open(glob.glob(str(out / "results_*.json"), recursive=True)[0]).read())
    samples = {}
    for f in glob.glob(str(out / "samples_*.jsonl"), recursive=True):
        task = os.path.basename(f).split("_", 1)[1].rsplit("_", 1)[0]
        for line in open(f):
            sample = json.loads(line)
            samples[task, sample["doc_id"]] = sample
    return results, samples


def _write_lm_eval_tasks(tmp_path, items: list[dict]) -> None:
    """lm-eval task files in ``tmp_path``: multiple choice over ``items``, rolling
    log-likelihood of three passages, and generation from ``items``' questions."""
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    texts = [t[:150] for t in pydoc_documents(3)]
    (tmp_path / "roll.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + head.format(tmp_path / "mc.jsonl") + "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    )
    (tmp_path / "tiny_roll.yaml").write_text(
        "task: tiny_roll\n"
        + head.format(tmp_path / "roll.jsonl")
        + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )
    (tmp_path / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + head.format(tmp_path / "mc.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: " x"\ngeneration_kwargs:\n'
        '  until: ["\\n\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )


def test_lm_eval_adapter_scores_local_tasks_the_same_at_tp1_and_tp2(setup, tmp_path):
    """A multiple-choice task whose correct choice is the model's greedy next token (accuracy
    must be 1; every log-likelihood equals tools/evaluate.py's on the text context + choice), a
    rolling log-likelihood task and a generation task; TP 2 with batches of 3 gives TP 1's
    log-likelihoods (1e-5) and texts."""
    tok = setup["tokenizer"]
    contexts = ["The module", "import os", "Return the value", "class Foo"]
    hf = load_hf(setup["llama"])
    items = []
    for i, context in enumerate(contexts):
        with torch.no_grad():
            logits = hf(torch.tensor([tok.tokenize(context)])).logits[0, -1]
        ranked = [
            t
            for t in logits.argsort(descending=True).tolist()
            if tok.detokenize([t]).startswith(" ") and tok.detokenize([t]).strip()
        ]
        choices = [tok.detokenize([t]) for t in (ranked[0], ranked[5], ranked[20])]
        items.append({"question": context, "choices": choices, "answer": 0, "id": i})
    _write_lm_eval_tasks(tmp_path, items)
    results, samples = _lm_eval(setup, tmp_path, "tp1", 1)
    assert results["results"]["tiny_mc"]["acc,none"] == 1.0
    _, samples_tp2 = _lm_eval(setup, tmp_path, "tp2", 2, "--batch_size", 3)
    assert samples.keys() == samples_tp2.keys() and len(samples) == 4 + 3 + 4
    for key, sample in samples.items():
        other = samples_tp2[key]
        if key[0] == "tiny_gen":
            assert other["resps"] == sample["resps"] and sample["resps"][0][0]
            continue
        for a, b in zip(sample["resps"], other["resps"]):
            value = a[0][0] if key[0] == "tiny_mc" else a[0]
            other_value = b[0][0] if key[0] == "tiny_mc" else b[0]
            assert float(other_value) == pytest.approx(float(value), abs=1e-5), key
    pairs = [it["question"] + c for it in items for c in it["choices"]]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in pairs))
    tool(
        "evaluate.py",
        "--load",
        setup["run"],
        "--jsonl",
        tmp_path / "pairs.jsonl",
        "--documents",
        "separate",
        "--per-token-output",
        tmp_path / "pt.jsonl",
    )
    rows = [json.loads(x) for x in (tmp_path / "pt.jsonl").read_text().splitlines()]
    for row, text in zip(rows, pairs, strict=True):  # texts for tools/visualize_tau.py
        assert len(row["tokens"]) == len(row["targets"]) == len(row["tau"])
        assert row["prompt"] + "".join(row["tokens"]) == tok.detokenize(tok.tokenize(text))
    for (task, _doc), sample in samples.items():
        if task != "tiny_mc":
            continue
        item = items[sample["doc"]["id"]]
        context_len = len(tok.tokenize(item["question"]))
        for c, (logprob, _) in enumerate(r[0] for r in sample["resps"]):
            row = rows[sample["doc"]["id"] * 3 + c]
            want = sum(row["tllm_logprob"][context_len - 1 :])
            assert float(logprob) == pytest.approx(want, abs=1e-5), (item, c)
    # a misspelt model argument stops the run by name (it was dropped silently)
    cmd = [sys.executable, "-m", "megatron_tempnet.inference.lm_eval_adapter", "run", "--model",
           "megatron_tempnet", "--model_args", f"load={setup['run']},fixd_tau=0.7", "--tasks",
           "tiny_mc", "--include_path", str(tmp_path)]  # fmt: skip
    r = run_command(cmd, env=dict(ENV, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"), timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "--model_args: unknown argument(s) fixd_tau for megatron_tempnet" in r.stderr


def _http(port: int, method: str, path: str = "/api", body=None, raw: bytes | None = None):
    """(status, JSON answer) of one request to the server on localhost."""
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _start_server(run: str, tmp_path, sample: list[str]):
    """tools/serve.py at TP 2 on a free port, its upper bound fitted on ``sample``; returns the
    process, the port and its log file (open)."""
    import subprocess

    from tests.helpers.entry_points import _free_port

    (tmp_path / "sample.txt").write_text("".join(t + "\n" for t in sample))
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed by the caller)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            os.path.join(REPO, "tools", "serve.py"),
            "--load",
            run,
            "--tensor-model-parallel-size",
            "2",
            "--port",
            str(port),
            "--max-prompts",
            "4",
            "--tau-target-mean",
            "0.8",
            "--tau-target-sample",
            str(tmp_path / "sample.txt"),
        ],
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return server, port, log


def _server_info(server, port: int, log_path) -> dict:
    """``GET /api`` once the server answers (it fails the test if the server stops first)."""
    import time

    for _ in range(240):
        try:
            status, info = _http(port, "GET")
            assert status == 200, info
            return info
        except OSError:
            assert server.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.5)
    raise AssertionError("the server did not answer in 120 s")


def _bad_requests_get_400(port: int) -> None:
    long_prompt = "word " * 80
    for kwargs, expect in [
        (dict(raw=b'{"prompts": ["a"'), "not valid JSON"),
        (dict(body=["a"]), "JSON object"),
        (dict(body={"tokens_to_generate": 3}), "missing field 'prompts'"),
        (dict(body={"prompts": ["a"], "temprature": 1}), "unknown field 'temprature'"),
        (dict(body={"prompts": "a"}), "prompts: expected a list"),
        (dict(body={"prompts": [""]}), "prompts[0]: expected a non-empty string"),
        (dict(body={"prompts": ["a"] * 5}), "give 1 to 4 prompts"),
        (dict(body={"prompts": ["a"], "tokens_to_generate": 0}), "tokens_to_generate (0)"),
        (dict(body={"prompts": ["a"], "top_p": 0}), "top_p (0) must be in (0, 1]"),
        (dict(body={"prompts": ["a"], "tokens_to_generate": True}), "tokens_to_generate"),
        (dict(body={"prompts": ["a"], "fixed_tau": -1}), "fixed_tau (-1) must be > 0"),
        (dict(body={"prompts": ["ok", long_prompt], "tokens_to_generate": 8}), "prompts[1]: "),
    ]:
        status, answer = _http(port, "PUT", **kwargs)
        assert status == 400 and expect in answer["error"], (kwargs, answer)
    assert "positions" in _http(port, "PUT", body={"prompts": [long_prompt]})[1]["error"]
    assert _http(port, "GET", "/nowhere")[0] == 404


def test_server_answers_requests_at_tp2_and_rejects_bad_ones(setup, tmp_path):
    """tools/serve.py at TP 2 (rank 0 serves, rank 1 follows): generations equal HF generate's
    greedy tokens and TempNet's taus; bad requests get a 400 and the server keeps serving."""
    import signal

    from megatron_tempnet.inference.hf import TempNetLogitsProcessor

    sample = ["The module", "import os"]  # --tau-target-mean's sample
    server, port, log = _start_server(setup["run"], tmp_path, sample)
    try:
        info = _server_info(server, port, tmp_path / "serve.log")
        assert info["tensor_model_parallel_size"] == 2 and info["tempnet"]
        tok, hf = setup["tokenizer"], load_hf(setup["llama"])
        with torch.no_grad():  # the server's upper bound makes TempNet's mean tau 0.8 on these
            logits = torch.cat([hf(torch.tensor([tok.tokenize(t)])).logits[0] for t in sample])
        upper = TempNetLogitsProcessor(setup["tempnet"]).fit_mean(logits, 0.8)
        assert info["tau_max_eval"] == pytest.approx(upper, rel=2e-6)
        prompts = ["The module", "Return the value of the"]
        status, out = _http(
            port, "PUT", body={"prompts": prompts, "tokens_to_generate": 5, "stop_at_eod": False}
        )
        assert status == 200, out
        for i, p in enumerate(prompts):
            ids = torch.tensor([tok.tokenize(p)])
            processor = TempNetLogitsProcessor(setup["tempnet"], tau_max_eval=upper)
            want = _hf_generate(hf, ids, 5, processor)
            n = want.shape[1] - ids.shape[1]  # HF stops at its end token (0); the server did not
            assert out["token_ids"][i][:n] == want[0, ids.shape[1] :].tolist() and n >= 3
            torch.testing.assert_close(
                torch.tensor(out["tau"][i][:n]), processor.taus[0], rtol=0, atol=1e-5
            )
            assert out["text"][i] == p + out["generated"][i]
            assert out["generated"][i] == tok.detokenize(out["token_ids"][i])
        status, capped = _http(
            port,
            "POST",
            body={
                "prompts": prompts[:1],
                "sample": True,
                "top_p": 0.9,
                "random_seed": 3,
                "tau_max_eval": 0.5,
                "tokens_to_generate": 8,
            },
        )
        assert status == 200 and max(capped["tau"][0]) <= 0.5 and capped["token_ids"][0]
        _bad_requests_get_400(port)
        status, again = _http(
            port, "PUT", body={"prompts": prompts, "tokens_to_generate": 5, "stop_at_eod": False}
        )
        assert status == 200 and again["token_ids"] == out["token_ids"]  # still serving
    finally:  # as Ctrl-C in a terminal: every process of the job gets the signal
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=60)  # every rank stopped
        log.close()
