"""``PREFIX.tokenizer.json``: which tokenizer wrote a dataset, so that no run reads it with another.

``tools/preprocess_data.py`` writes it beside ``PREFIX.bin``/``PREFIX.idx``;
``tools/merge_datasets.py`` carries it over when every input agrees (``merged_sidecar``). It
holds the tokenizer's ``TokenizerIdentity`` (type, vocabulary size, sha256 of its files) and, for
people, the paths the files were read from:

    {"format": "megatron_tempnet.tokenizer/2", "tokenizer_type": "GPT2BPETokenizer",
     "vocab_size": 50257, "sha256": "...", "files": ["/data/gpt2-vocab.json", ...]}

A run compares the identity of its own tokenizer with each dataset's (``check_tokenizer``); a
dataset without the file (an older version's, Megatron-LM's) cannot be checked this way and is
accepted: only its token ids are checked against the vocabulary (``data.token_range``).
"""

from __future__ import annotations

import json

from megatron_tempnet.data.indexed import TOKENIZER_SIDECAR, DatasetError
from megatron_tempnet.data.tokenizers import TokenizerIdentity
from megatron_tempnet.utils.files import write_atomic

FORMAT = "megatron_tempnet.tokenizer/2"
FORMAT_1 = "megatron_tempnet.tokenizer/1"
"""Before Megatron-LM's SentencePieceTokenizer was built, ``SentencePieceTokenizer`` in a record
of this format meant the SentencePiece model's own ids, GPTSentencePieceTokenizer's (read so)."""


def sidecar_path(prefix: str) -> str:
    return prefix + TOKENIZER_SIDECAR


def write_sidecar(prefix: str, identity: TokenizerIdentity, files: list[str]) -> None:
    """``prefix.tokenizer.json`` for the dataset at ``prefix`` (whole or not at all)."""
    record = {
        "format": FORMAT,
        "tokenizer_type": identity.tokenizer_type,
        "vocab_size": identity.vocab_size,
        "sha256": identity.sha256,
        "files": list(files),
    }
    write_atomic(sidecar_path(prefix), json.dumps(record, indent=2) + "\n", fsync=True)


def read_sidecar(prefix: str) -> tuple[TokenizerIdentity, list[str]] | None:
    """The identity and file paths recorded for ``prefix`` (None: the dataset has no sidecar)."""
    path = sidecar_path(prefix)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DatasetError(
            f"{path}: unreadable ({e}); delete it to accept the dataset unchecked"
        ) from None
    try:
        if record["format"] not in (FORMAT, FORMAT_1):
            raise ValueError(f"format {record['format']!r}, expected {FORMAT!r}")
        kind = str(record["tokenizer_type"])
        if record["format"] == FORMAT_1 and kind == "SentencePieceTokenizer":
            kind = "GPTSentencePieceTokenizer"
        identity = TokenizerIdentity(kind, int(record["vocab_size"]), str(record["sha256"]))
        return identity, [str(f) for f in record.get("files", [])]
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(
            f"{path}: not a tokenizer record ({e}); delete it to accept the dataset unchecked"
        ) from None


def check_tokenizer(prefixes: list[str], identity: TokenizerIdentity) -> list[str]:
    """Raise ``DatasetError`` when a dataset was tokenised with another tokenizer than
    ``identity``; returns the prefixes that have no sidecar (their tokenizer is unknown)."""
    unchecked = []
    for prefix in prefixes:
        recorded = read_sidecar(prefix)
        if recorded is None:
            unchecked.append(prefix)
        elif recorded[0] != identity:
            files = f" from {', '.join(recorded[1])}" if recorded[1] else ""
            raise DatasetError(
                f"dataset {prefix} was tokenised with {recorded[0].describe()}{files} "
                f"(per {sidecar_path(prefix)}), but this run's tokenizer is "
                f"{identity.describe()}: give the run the dataset's tokenizer, or re-run "
                "tools/preprocess_data.py with the run's"
            )
    return unchecked


def merged_sidecar(prefixes: list[str]) -> tuple[TokenizerIdentity, list[str]] | None:
    """The identity a concatenation of ``prefixes`` carries: theirs when all record the same
    one; None when any has none. Datasets of two tokenizers are refused (``DatasetError``)."""
    records = [read_sidecar(p) for p in prefixes]
    known = [(p, r) for p, r in zip(prefixes, records) if r is not None]
    if not known:
        return None
    first, (first_identity, _) = known[0]
    for prefix, (identity, _) in known[1:]:
        if identity != first_identity:
            raise DatasetError(
                f"{first} was tokenised with {first_identity.describe()} but {prefix} with "
                f"{identity.describe()}: datasets of different tokenizers cannot be merged"
            )
    return known[0][1] if len(known) == len(prefixes) else None
