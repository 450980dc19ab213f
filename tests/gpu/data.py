"""The acceptance checks' data, made in the test: a 32000-word tokenizer and Zipf-distributed
word documents for the language models (no download). CLIP's, scikit-learn's digits, comes from
``tests.helpers.corpus.digits_pairs``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.gpu.harness import sizes
from tests.gpu.programs import run


def build_tokenizer(directory: Path, vocab: int, seed: int = 0) -> tuple[Path, list[str]]:
    """A Hugging Face tokenizer directory (``--tokenizer-type HuggingFaceTokenizer``): a
    word-level vocabulary of ``vocab`` ids, ``<unk>``, ``<eos>`` and made-up lower-case words,
    split on whitespace. A realistic vocabulary size without downloading one. -> (directory,
    the words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words: set[str] = set()
    while len(words) < vocab - 2:
        words.add("".join(rng.choice(letters, rng.integers(3, 10))))
    ordered = sorted(words)
    ids = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(ordered)}}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    out = directory / "tokenizer"
    hf.save_pretrained(str(out))
    return out, ordered


def word_documents(words: list[str], n: int, length: int, seed: int) -> list[str]:
    """``n`` documents of ``length`` words drawn from a Zipf-Mandelbrot law (p ~ 1 / (rank +
    2.7)) over the words in a random order: a unigram entropy about 3 nats below the uniform
    one, so a language model's loss visibly falls within a few dozen steps."""
    rng = np.random.default_rng(seed)
    rank = np.random.default_rng(0).permutation(len(words))  # the same law for every seed
    p = 1.0 / (rank + 2.7)
    drawn = rng.choice(len(words), size=(n, length), p=p / p.sum())
    table = np.array(words)
    return [" ".join(table[row]) for row in drawn]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return path


def preprocess(corpus: Path, tokenizer: Path, log_dir: Path) -> str:
    """tools/preprocess_data.py on ``corpus``; -> the ``--data-path`` prefix."""
    prefix = corpus.parent / corpus.stem
    args = [
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        tokenizer,
        "--append-eod",
        "--workers",
        sizes().workers,
    ]
    run("preprocess", "tools/preprocess_data.py", args, log_dir)
    return f"{prefix}_text_document"
