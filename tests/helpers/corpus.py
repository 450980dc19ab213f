"""Real English text and tiny tokenizers built in-process, for the data-pipeline tests.

The text is Python's own ``pydoc_data`` topics (~0.7 MB of documentation prose and code); the
image-text pairs are scikit-learn's digits.
"""

from __future__ import annotations

import gzip
import json
import os

import zstandard


def pydoc_documents(n: int | None = None, max_chars: int = 4000) -> list[str]:
    """Documents cut from pydoc's help topics (deterministic order; non-ASCII included)."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        text = topics[name].strip()
        for start in range(0, len(text), max_chars):
            docs.append(text[start : start + max_chars])
    docs.append("Unicode survives: naïve café, 東京, emoji 🙂, tab\there, CRLF\r\nend.")
    return docs if n is None else [docs[i % len(docs)] for i in range(n)]


def write_jsonl(path: str, records: list, *, raw_lines: dict[int, bytes] | None = None) -> str:
    """Write JSON lines to ``path`` (.jsonl, .jsonl.zst or .jsonl.gz by suffix).

    ``records`` are dicts (serialised) or bytes (written as they are); ``raw_lines`` inserts
    extra raw lines before the given 0-based record positions.
    """
    lines = []
    for i, rec in enumerate(records):
        if raw_lines and i in raw_lines:
            lines.append(raw_lines[i])
        lines.append(rec if isinstance(rec, bytes) else json.dumps(rec).encode())
    data = b"\n".join(lines) + b"\n"
    if path.endswith(".zst"):
        data = zstandard.ZstdCompressor(level=3).compress(data)
    elif path.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    with open(path, "wb") as f:
        f.write(data)
    return path


def train_sentencepiece(directory: str, vocab_size: int = 400) -> str:
    """A tiny lossless SentencePiece BPE model (identity normalisation, byte fallback)."""
    import sentencepiece as spm

    prefix = os.path.join(directory, "tiny_sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(pydoc_documents()),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_by_whitespace=True,
        max_sentence_length=1 << 16,
        minloglevel=2,
    )
    return prefix + ".model"


def _train_byte_level_bpe(vocab_size: int, texts: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pydoc_documents() if texts is None else texts, trainer)
    return tok


def train_gpt2_bpe(
    directory: str, vocab_size: int = 600, texts: list[str] | None = None
) -> tuple[str, str]:
    """A GPT-2-format BPE trained on pydoc (or ``texts``): ``vocab.json`` + ``merges.txt``
    (with <|endoftext|>)."""
    tok = _train_byte_level_bpe(vocab_size, texts)
    vocab_file, merges_file = tok.model.save(directory, "gpt2_bpe")
    return vocab_file, merges_file


def save_hf_tokenizer(directory: str, vocab_size: int = 500) -> str:
    """A tiny ``transformers`` fast tokenizer directory (loads with AutoTokenizer)."""
    from transformers import PreTrainedTokenizerFast

    tok = _train_byte_level_bpe(vocab_size)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    out = os.path.join(directory, "tiny_hf")
    hf.save_pretrained(out)
    return out


def blend_corpus(directory: str, vocab_size: int = 600) -> dict:
    """Two GPT-2 BPE datasets with different text (A: pydoc topics; B: 60 of them upper-cased)."""
    from megatron_tempnet.data.preprocess import PreprocessConfig, run_preprocess
    from megatron_tempnet.data.tokenizers import build_tokenizer

    vocab, merges = train_gpt2_bpe(directory, vocab_size)
    spec = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}
    docs = {"A": pydoc_documents(), "B": [t.upper() for t in pydoc_documents(60)]}
    prefixes = {}
    for name, texts in docs.items():
        path = write_jsonl(os.path.join(directory, f"{name}.jsonl"), [{"text": t} for t in texts])
        config = PreprocessConfig([path], os.path.join(directory, name), spec, append_eod=True)
        prefixes[name] = run_preprocess(config)[0].prefix
    return {"spec": spec, "tokenizer": build_tokenizer(**spec), "prefix": prefixes}


def digits_pairs(directory: str, data: str = "digits") -> dict:
    """scikit-learn's digits as CSV manifests (``write_digits_dataset``, in ``directory/data``)
    and a word-level SentencePiece tokenizer trained on their captions (``"tokenizer"``:
    ``directory/sp.model``)."""
    import sentencepiece as spm

    from megatron_tempnet.models.clip.data.digits import write_digits_dataset

    paths = write_digits_dataset(os.path.join(directory, data))
    with open(paths["train"]) as f:
        captions = [line.rsplit(",", 1)[0].split(",", 1)[1] for line in f.readlines()[1:]]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(captions + ["random"]),
        model_prefix=os.path.join(directory, "sp"),
        vocab_size=64,
        model_type="word",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return {**paths, "tokenizer": os.path.join(directory, "sp.model")}


def tokenizer_flags(spec: dict) -> dict:
    """``spec`` (``build_tokenizer``'s keyword arguments) as the entry points' flags, in
    ``cli_flags``' form: ``{"tokenizer-type": ..., "vocab-file": ..., "merge-file": ...}``."""
    return {key.replace("_", "-"): value for key, value in spec.items()}


def data_flags(spec: dict, prefix: str, seq_length: int) -> dict:
    """The dataset ``prefix`` split 90/8/2 in sequences of ``seq_length``, tokenised by
    ``spec``: pretrain_gpt.py's data flags in ``cli_flags``' form."""
    return {
        "data-path": prefix,
        "split": "90,8,2",
        "seq-length": seq_length,
        **tokenizer_flags(spec),
    }


def blend_config(corpus: dict, cache: str, seq_length: int, **kw):
    """70/30 blend of the two datasets of ``blend_corpus``, split 90/8/2."""
    from megatron_tempnet.data.gpt_data import GPTDataConfig

    p = corpus["prefix"]
    return GPTDataConfig(
        data_path=["0.7", p["A"], "0.3", p["B"]],
        split="90,8,2",
        seq_length=seq_length,
        data_cache_path=cache,
        **kw,
    )


def write_tar(archive: str, directory: str, names: list[str]) -> str:
    """A tar archive (``.tar``, or gzip-compressed by a ``.tar.gz``/``.tgz`` suffix) of the files
    ``names`` (relative to ``directory``), stored in the given order, each folder's entry first.

    As in OpenWebText2's archive, member names are the relative paths without ``./``.
    """
    import tarfile

    mode = "w:gz" if archive.endswith((".tar.gz", ".tgz")) else "w"
    folders: set[str] = set()
    with tarfile.open(archive, mode) as tar:
        for name in names:
            folder = os.path.dirname(name)
            if folder and folder not in folders:
                folders.add(folder)
                tar.add(os.path.join(directory, folder), folder, recursive=False)
            tar.add(os.path.join(directory, name), name)
    return archive
