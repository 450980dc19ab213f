"""CPU quickstart: the whole pipeline on a small real-text corpus, and TempNet's temperatures.

    python examples/quickstart.py                  # what `make quickstart` runs
    python examples/quickstart.py --out /tmp/qs --lm-iters 100 --tempnet-iters 100

1. writes Python's own documentation topics (``pydoc_data``) as ``corpus.jsonl``, every 15th
   topic held out as ``heldout.jsonl``;
2. trains a SentencePiece tokenizer on the training text (BPE, 1024 ids, byte fallback);
3. runs ``tools/preprocess_data.py`` -> ``corpus_text_document.bin/.idx``;
4. trains the ``tiny`` GPT with cross-entropy (``pretrain_gpt.py``, tensor parallel over 2 CPU
   processes, gloo);
5. goes on from that checkpoint with TempNet under the KL-DRO loss (the paper's setting ii: the
   LM and TempNet trained together): TempNet starts from the trained LM's logits, so its
   temperatures spread from the start instead of collapsing with a random LM's;
6. scores the held-out text with ``tools/evaluate.py`` (perplexity at tau = 1 and T-LLM
   perplexity with TempNet's tau, every token's tau) and colours one held-out passage by tau
   with ``tools/visualize_tau.py`` (HTML and PNG).

The console shows the training curves and the results; every command's whole output is in
``OUT/logs/``. A failing command prints the end of its log and stops the quickstart (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELD_OUT_EVERY = 15  # every 15th documentation topic is held out
_ITERATION = re.compile(r"\biteration (\d+) \| (.*)$")
_ERROR = re.compile(r"Traceback|\bERROR\b|\w*Error\b|^error:|\bFAILED\b")


def write_corpus(directory: str) -> tuple[int, int]:
    """pydoc's help topics as ``corpus.jsonl`` (documents of at most 3000 characters) and every
    15th topic as ``heldout.jsonl`` (passages of at most 1000). -> (training, held-out) counts."""
    from pydoc_data.topics import topics

    counts = [0, 0]
    with (
        open(os.path.join(directory, "corpus.jsonl"), "w") as train,
        open(os.path.join(directory, "heldout.jsonl"), "w") as held,
    ):
        for i, name in enumerate(sorted(topics)):
            out, size = (held, 1000) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else (train, 3000)
            text = topics[name].strip()
            for start in range(0, len(text), size):
                out.write(json.dumps({"text": text[start : start + size], "meta": name}) + "\n")
                counts[out is held] += 1
    return counts[0], counts[1]


def train_tokenizer(corpus: str, prefix: str, vocab_size: int) -> str:
    import sentencepiece as spm

    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line in f]
    lossless = {"model_type": "bpe", "byte_fallback": True, "normalization_rule_name": "identity"}
    lossless.update(remove_extra_whitespaces=False, max_sentence_length=1 << 16, minloglevel=2)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size, **lossless
    )
    return prefix + ".model"


def training_line(line: str, total: int) -> str | None:
    """A console line for a training log's iteration line (None: not one)."""
    m = _ITERATION.search(line)
    if not m:
        return None
    fields = dict(part.strip().split(" ", 1) for part in m[2].split(" | ") if " " in part.strip())
    values = {k: float(v) for k, v in fields.items() if re.fullmatch(r"[-+.\deEnaif]+", v)}
    head = f"      iteration {int(m[1]):>4}/{total}"
    if "loss" not in values:
        return None
    if values.get("tau_std", 0) == 0 and values.get("tau_mean", 1) == 1:  # cross-entropy
        return f"{head} | cross-entropy {values['loss']:.3f} | lr {values['lr']:.2e}"
    return (
        f"{head} | DRO loss {values['loss']:.3f} | cross-entropy {values['ce_loss']:.3f} | "
        f"tau {values['tau_mean']:.2f} +- {values['tau_std']:.2f} "
        f"[{values['tau_min']:.2f}, {values['tau_max']:.2f}]"
    )


def shown_path(path: str) -> str:
    """``path`` relative to the current directory when it is under it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def run(cmd: list[str], log: str, show=lambda line: None, env: dict | None = None) -> None:
    """Run ``cmd`` with its whole output in ``log``; the console gets ``show(line)`` where it is
    not None, and every line that reports an error. A failure prints the log's end and exits."""
    with open(log, "w") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        )
        for line in proc.stdout:
            f.write(line)
            shown = show(line.rstrip("\n"))
            if shown is None and _ERROR.search(line):
                shown = "      " + line.rstrip("\n")
            if shown is not None:
                print(shown, flush=True)
        code = proc.wait()
    if code != 0:
        with open(log) as f:
            tail = f.readlines()[-40:]
        print(f"failed (exit {code}); the end of {shown_path(log)}:", flush=True)
        print("".join("  | " + line for line in tail), end="", flush=True)
        sys.exit(1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "runs", "quickstart"), help="work dir")
    p.add_argument("--lm-iters", type=int, default=300, help="step 4: cross-entropy iterations")
    p.add_argument("--tempnet-iters", type=int, default=200, help="step 5: TempNet iterations")
    p.add_argument("--nproc", type=int, default=2, help="CPU processes = tensor-parallel size")
    p.add_argument("--vocab-size", type=int, default=1024)
    args = p.parse_args()
    out = lambda *parts: os.path.abspath(os.path.join(args.out, *parts))  # noqa: E731
    show = lambda *parts: shown_path(out(*parts))  # noqa: E731
    os.makedirs(out("logs"), exist_ok=True)
    start = time.perf_counter()
    print(f"quickstart in {show()} (each command's whole output: {show('logs')}/)", flush=True)
    tokenizer = _corpus(args, out, show)
    launch, env = _train(args, out, tokenizer)
    _held_out(args, out, show, launch, env)
    latest = {run: open(out(run, "latest")).read().strip() for run in ("lm", "tempnet")}
    print(f"done in {time.perf_counter() - start:.0f} s")
    print(f"  metrics      {show('lm.metrics.jsonl')}, {show('tempnet.metrics.jsonl')}")
    print(f"  TensorBoard  tensorboard --logdir {show('tensorboard')}")
    print(f"  checkpoints  {show('lm', latest['lm'])} (LM)")
    print(f"               {show('tempnet', latest['tempnet'])} (LM + TempNet)")
    return 0


def _corpus(args, out, show) -> list[str]:
    """Steps 1-3: the corpus, its tokenizer and the indexed dataset; the tokenizer's flags."""
    train_docs, held_docs = write_corpus(out())
    print(f"[1/6] corpus: {train_docs} training documents, {held_docs} held-out passages (pydoc)")
    model = train_tokenizer(out("corpus.jsonl"), out("tokenizer"), args.vocab_size)
    print(f"[2/6] tokenizer: SentencePiece BPE, {args.vocab_size} ids -> {shown_path(model)}")
    tokenizer = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    python = [sys.executable]
    run(
        python
        + [os.path.join(REPO, "tools", "preprocess_data.py"), "--input", out("corpus.jsonl")]
        + ["--output-prefix", out("corpus"), "--append-eod", "--workers", "2", "--overwrite"]
        + tokenizer,
        out("logs", "preprocess.log"),
    )
    from megatron_tempnet.data.indexed import validate_indexed_dataset

    tokens = validate_indexed_dataset(out("corpus_text_document")).num_tokens
    print(f"[3/6] preprocessing: {tokens:,} tokens -> {show('corpus_text_document')}.bin/.idx")
    return tokenizer


def _train(args, out, tokenizer: list[str]) -> tuple[list[str], dict]:
    """Steps 4-5: the LM with cross-entropy, then TempNet + LM; the launcher and its env."""
    python = [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = python + ["-m", "torch.distributed.run", "--standalone"]
    launch += [f"--nproc-per-node={args.nproc}"]
    common = ["--model", "tiny", "--tensor-model-parallel-size", str(args.nproc)]
    common += ["--data-path", out("corpus_text_document"), "--split", "100,0,0", *tokenizer]
    common += ["--data-cache-path", out("cache"), "--micro-batch-size", "8"]
    common += ["--global-batch-size", "8", "--lr-warmup-iters", "10", "--eval-iters", "0"]
    common += ["--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95"]
    for stale in ("lm", "tempnet", "tensorboard"):  # a rerun starts fresh runs and curves
        shutil.rmtree(out(stale), ignore_errors=True)
        if os.path.exists(out(f"{stale}.metrics.jsonl")):
            os.remove(out(f"{stale}.metrics.jsonl"))

    print(f"[4/6] language model: tiny GPT, TP {args.nproc}, cross-entropy", flush=True)
    run(
        launch
        + [os.path.join(REPO, "pretrain_gpt.py"), *common, "--train-iters", str(args.lm_iters)]
        + ["--loss", "ce", "--tau-source", "fixed", "--lr", "3e-3", "--min-lr", "3e-4"]
        + ["--log-interval", str(max(args.lm_iters // 4, 1)), "--save", out("lm")]
        + ["--metrics-file", out("lm.metrics.jsonl"), "--tensorboard-dir", out("tensorboard/lm")],
        out("logs", "lm.log"),
        lambda line: training_line(line, args.lm_iters),
        env,
    )
    rho = 3.0
    print(f"[5/6] TempNet + LM: KL-DRO loss (rho {rho:g}) from the step-4 checkpoint", flush=True)
    run(
        launch
        + [os.path.join(REPO, "pretrain_gpt.py"), *common]
        + ["--train-iters", str(args.tempnet_iters), "--pretrained-checkpoint", out("lm")]
        + ["--loss", "dro", "--tau-source", "tempnet", "--tempnet-rho", str(rho)]
        + ["--tempnet-lr", "1e-2", "--lr", "1e-3", "--min-lr", "1e-4"]
        + ["--log-interval", str(max(args.tempnet_iters // 4, 1))]
        + ["--load", out("tempnet"), "--save", out("tempnet")]
        + ["--metrics-file", out("tempnet.metrics.jsonl")]
        + ["--tensorboard-dir", out("tensorboard/tempnet")],
        out("logs", "tempnet.log"),
        lambda line: training_line(line, args.tempnet_iters),
        env,
    )
    return launch, env


def _held_out(args, out, show, launch: list[str], env: dict) -> None:
    """Step 6: TempNet's tau on the held-out passages, and one passage drawn."""
    python = [sys.executable]
    run(
        launch
        + [os.path.join(REPO, "tools", "evaluate.py"), "--load", out("tempnet")]
        + ["--tensor-model-parallel-size", str(args.nproc), "--jsonl", out("heldout.jsonl")]
        + ["--documents", "separate", "--output", out("heldout_eval.json")]
        + ["--per-token-output", out("heldout_tau.jsonl")],
        out("logs", "evaluate.log"),
        env=env,
    )
    with open(out("heldout_eval.json")) as f:
        summary = json.load(f)
    with open(out("heldout_tau.jsonl")) as f:
        passages = [json.loads(line) for line in f]
    taus = [t for passage in passages for t in passage["tau"]]
    mean, std = statistics.fmean(taus), statistics.pstdev(taus)
    print(f"[6/6] held-out text: {len(passages)} passages, {len(taus):,} tokens, tools/evaluate.py")
    print(f"      perplexity       {summary['ppl']:.1f} at tau = 1 (cross-entropy)")
    print(f"      T-LLM perplexity {summary['tllm_ppl']:.1f} with TempNet's tau")
    print(
        f"      tau per token    mean {mean:.3f}, std {std:.3f} (std / mean {std / mean:.2f}), "
        f"range [{min(taus):.3f}, {max(taus):.3f}]"
    )
    # the visualised passage: the held-out passage whose length is nearest 200 tokens
    shown = min(range(len(passages)), key=lambda i: abs(len(passages[i]["tau"]) - 200))
    run(
        python
        + [os.path.join(REPO, "tools", "visualize_tau.py"), "--input", out("heldout_tau.jsonl")]
        + ["--index", str(shown), "--output-prefix", out("tau"), "--width-chars", "100"],
        out("logs", "visualize.log"),
    )
    print(f"      tau of every token of passage {shown}: {show('tau.html')}, {show('tau.png')}")


if __name__ == "__main__":
    sys.exit(main())
