"""CPU demo of CLIP training: scikit-learn's handwritten digits with template captions.

    python examples/clip_digits_demo.py                      # all five losses, one table
    python examples/clip_digits_demo.py --caption-noise 15   # the paper's noisy-caption setting
    python examples/clip_digits_demo.py --ood                # train on 0-4; OOD AUROC on 5-9

1. writes the 1797 digit images (16 x 16 PNG) with captions such as "a handwritten digit
   seven", a stratified held-out split, and 0-4 / 5-9 subsets (``models.clip.data.digits``);
2. trains a word-level SentencePiece tokenizer on the training captions;
3. runs ``pretrain_clip.py`` once per ``--clip-loss`` (two CPU processes, data parallel);
4. prints and writes (``OUT/results.md``) the held-out zero-shot results of every loss:
   image and text retrieval at 1 (a hit = an item of the query's digit; chance about 10%),
   zero-shot classification top-1 with prompt templates, and the mean predicted temperature;
   with ``--ood``, the temperature's AUROC for digits 5-9 against 0-4 (TaU's experiment).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LOSSES = ("clip", "sogclr", "isogclr", "tempnet", "tau")
SETTINGS = {  # per loss: its temperature settings for this small problem
    "clip": ["--tau-init", "0.05"],
    "sogclr": ["--tau-init", "0.05"],
    "isogclr": ["--tau-init", "0.03", "--isogclr-tau-lr", "0.002", "--tempnet-rho", "1"],
    "tempnet": ["--tempnet-lr", "1e-3", "--tempnet-rho", "1"],
    "tau": ["--tau-init", "0.05"],
}


def train_tokenizer(manifest: str, prefix: str) -> str:
    """A word-level SentencePiece model over the captions (plus the prompt templates)."""
    import csv

    import sentencepiece as spm

    from megatron_tempnet.models.clip.data.digits import CLASSIFICATION_TEMPLATES, DIGIT_NAMES

    with open(manifest, newline="") as f:
        texts = [row["caption"] for row in csv.DictReader(f)]
    texts += [t.format(name) for t in CLASSIFICATION_TEMPLATES for name in DIGIT_NAMES]
    texts += ["random"]  # the caption-noise word
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=prefix,
        vocab_size=96,
        model_type="word",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return prefix + ".model"


def run_loss(loss: str, paths: dict, tokenizer: str, args, out: str) -> dict:
    """One pretrain_clip.py run; returns its final evaluation metrics."""
    from megatron_tempnet.models.clip.data.digits import CLASSIFICATION_TEMPLATES

    metrics = os.path.join(out, f"{loss}.metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    train, valid = (
        (paths["train_0-4"], paths["test_0-4"]) if args.ood else (paths["train"], paths["test"])
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        os.path.join(REPO, "pretrain_clip.py"),
        "--model",
        "clip-tiny",
        "--train-data",
        train,
        "--valid-data",
        valid,
        "--label-key",
        "label",
        "--image-mean",
        "0.5",
        "--image-std",
        "0.5",
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        tokenizer,
        "--clip-loss",
        loss,
        "--micro-batch-size",
        str(args.batch // args.nproc),
        "--train-iters",
        str(args.train_iters),
        "--lr",
        "2e-3",
        "--lr-warmup-iters",
        "20",
        "--weight-decay",
        "0.02",
        "--tempnet-proj-size",
        "64",
        "--eval-interval",
        "0",
        "--log-interval",
        "10",
        "--metrics-file",
        metrics,
        "--seed",
        str(args.seed),
        "--caption-noise",
        str(args.caption_noise),
        "--zeroshot-templates",
        *CLASSIFICATION_TEMPLATES,
        *SETTINGS[loss],
    ]
    if args.ood:
        cmd += ["--ood-data", paths["test_5-9"]]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    log_path = os.path.join(out, f"{loss}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        rows = follow(proc, metrics, f"--clip-loss {loss}", args.train_iters)
    if proc.returncode:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-30:])
        raise DemoError(
            f"{tail}\n--clip-loss {loss} failed (status {proc.returncode}); log: {log_path}"
        )
    final = [r for r in rows if "val_ir@1" in r][-1]
    trained = [r for r in rows if "loss" in r][-1]
    return {**final, "train_tau_mean": trained["tau_mean"]}


class DemoError(Exception):
    """A training run of the demo failed; the message holds the end of its log."""


def follow(proc: subprocess.Popen, metrics: str, desc: str, iterations: int) -> list[dict]:
    """Wait for a training process, showing its progress from the metrics file it appends to;
    returns the file's rows."""
    from megatron_tempnet.utils.progress import progress

    rows: list[dict] = []
    with progress(desc, iterations, unit="it") as bar:
        done = 0
        while True:
            finished = proc.poll() is not None
            rows = _rows(metrics)
            latest = max((r["iteration"] for r in rows if "loss" in r), default=0)
            bar.update(latest - done)
            done = latest
            if finished:
                return rows
            time.sleep(1.0)


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def table(results: dict, ood: bool) -> str:
    head = "| --clip-loss | IR@1 | TR@1 | zero-shot top-1 | mean tau (train) |"
    rule = "|---|---:|---:|---:|---:|"
    if ood:
        head += " OOD AUROC (images) | OOD AUROC (texts) |"
        rule += "---:|---:|"
    lines = [head, rule]
    for loss, m in results.items():
        row = (
            f"| {loss} | {m['val_ir@1']:.1f} | {m['val_tr@1']:.1f} | "
            f"{m['val_zeroshot_top1']:.1f} | {m['train_tau_mean']:.4f} |"
        )
        if ood:
            row += "".join(
                f" {m[k]:.3f} |" if k in m else " - |"
                for k in ("val_ood_auroc_image", "val_ood_auroc_text")
            )
        lines.append(row)
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="clip_digits_demo")
    p.add_argument("--losses", nargs="+", choices=LOSSES, default=list(LOSSES))
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="global batch (pairs)")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel CPU processes")
    p.add_argument("--caption-noise", type=float, default=0.0, metavar="P")
    p.add_argument("--ood", action="store_true", help="train on digits 0-4, OOD = 5-9")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.ood:
        args.losses = [loss for loss in args.losses if loss in ("tau", "tempnet")] or ["tau"]

    from megatron_tempnet.models.clip.data.digits import write_digits_dataset

    os.makedirs(args.out, exist_ok=True)
    paths = write_digits_dataset(os.path.join(args.out, "data"))
    tokenizer = train_tokenizer(paths["train"], os.path.join(args.out, "captions_sp"))
    results = {}
    for loss in args.losses:
        tic = time.time()
        try:
            results[loss] = run_loss(loss, paths, tokenizer, args, args.out)
        except DemoError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"{loss}: {time.time() - tic:.0f} s", flush=True)
    text = table(results, args.ood)
    setting = (
        f"caption noise {args.caption_noise:g}%, {args.train_iters} iterations, "
        f"global batch {args.batch}, {args.nproc} processes"
    )
    if args.ood:
        setting += ", trained on digits 0-4, evaluated on held-out 0-4, OOD = 5-9"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(f"{setting}\n\n{text}\n")
    print(f"\n{setting}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
