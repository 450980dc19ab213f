"""CPU quickstart: the whole pipeline on a small real-text corpus, in a few minutes.

    python examples/quickstart.py                  # what `make quickstart` runs
    python examples/quickstart.py --train-iters 50 --out /tmp/qs

1. writes a corpus of Python's own documentation topics (``pydoc_data``) as ``corpus.jsonl``;
2. trains a SentencePiece tokenizer on it (BPE, 1024 ids, byte fallback);
3. runs ``tools/preprocess_data.py`` (2 workers) -> ``corpus_text_document.bin/.idx``;
4. trains the ``tiny`` GPT jointly with TempNet under the KL-DRO loss with ``pretrain_gpt.py``,
   tensor parallel over 2 CPU processes (torchrun, gloo), with validation, TensorBoard logs, a
   metrics file and a checkpoint;
5. prints where everything is, the final losses and the range of TempNet's temperatures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path: str, max_chars: int = 3000) -> int:
    """pydoc's help topics cut into documents of at most ``max_chars`` characters."""
    from pydoc_data.topics import topics

    n = 0
    with open(path, "w") as f:
        for name in sorted(topics):
            text = topics[name].strip()
            for start in range(0, len(text), max_chars):
                f.write(json.dumps({"text": text[start : start + max_chars], "meta": name}) + "\n")
                n += 1
    return n


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


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "runs", "quickstart"), help="work dir")
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2, help="CPU processes = tensor-parallel size")
    p.add_argument("--vocab-size", type=int, default=1024)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = lambda *parts: os.path.join(args.out, *parts)  # noqa: E731
    start = time.perf_counter()

    docs = write_corpus(out("corpus.jsonl"))
    print(f"[1/4] corpus: {docs} documents -> {out('corpus.jsonl')}", flush=True)
    model = train_tokenizer(out("corpus.jsonl"), out("tokenizer"), args.vocab_size)
    print(f"[2/4] SentencePiece tokenizer ({args.vocab_size} ids) -> {model}", flush=True)
    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "preprocess_data.py"),
            "--input",
            out("corpus.jsonl"),
            "--output-prefix",
            out("corpus"),
            "--append-eod",
            "--workers",
            "2",
            "--overwrite",
            *tokenizer,
        ]
    )
    print(f"[3/4] indexed dataset -> {out('corpus_text_document')}.bin/.idx", flush=True)
    for stale in ("metrics.jsonl",):  # a rerun starts a fresh curve
        if os.path.exists(out(stale)):
            os.remove(out(stale))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            os.path.join(REPO, "pretrain_gpt.py"),
            "--model",
            "tiny",
            "--tensor-model-parallel-size",
            str(args.nproc),
            "--data-path",
            out("corpus_text_document"),
            "--split",
            "95,5,0",
            *tokenizer,
            "--data-cache-path",
            out("cache"),
            "--micro-batch-size",
            "8",
            "--global-batch-size",
            "8",
            "--train-iters",
            str(args.train_iters),
            "--lr",
            "3e-3",
            "--min-lr",
            "3e-4",
            "--lr-warmup-iters",
            "10",
            "--loss",
            "dro",
            "--tau-source",
            "tempnet",
            "--tempnet-rho",
            "4",
            "--tempnet-tau-min",
            "0.05",
            "--tempnet-tau-max",
            "2.0",
            "--tempnet-hidden-size",
            "64",
            "--tempnet-proj-size",
            "64",
            "--tempnet-lr",
            "1e-3",
            "--eval-interval",
            str(max(args.train_iters // 3, 1)),
            "--eval-iters",
            "4",
            "--log-interval",
            "25",
            "--save",
            out("checkpoints"),
            "--tensorboard-dir",
            out("tensorboard"),
            "--metrics-file",
            out("metrics.jsonl"),
        ],
        env=env,
    )
    rows = [json.loads(line) for line in open(out("metrics.jsonl"))]
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_ppl" in r]
    first, last = train[0], train[-1]
    print(f"[4/4] trained {last['iteration']} iterations in {time.perf_counter() - start:.0f} s")
    print(f"  cross-entropy  {first['ce_loss']:.3f} -> {last['ce_loss']:.3f}")
    print(f"  DRO loss       {first['loss']:.3f} -> {last['loss']:.3f}")
    print(
        f"  tau            mean {last['tau_mean']:.3f}, range [{last['tau_min']:.3f}, "
        f"{last['tau_max']:.3f}] (TempNet, last logged batch)"
    )
    if val:
        v = val[-1]
        print(
            f"  validation     perplexity {v['val_ppl']:.1f}, T-LLM perplexity "
            f"{v['val_tllm_ppl']:.1f}"
        )
    print(f"  metrics        {out('metrics.jsonl')}")
    print(f"  TensorBoard    tensorboard --logdir {out('tensorboard')}")
    print(f"  checkpoint     {out('checkpoints', open(out('checkpoints', 'latest')).read())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
