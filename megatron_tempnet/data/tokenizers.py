"""Tokenizers for preprocessing and training: SentencePiece, GPT-2 byte-level BPE, Hugging Face,
and Megatron-LM's NullTokenizer (the ids are the text).

Every tokenizer exposes the same small surface: ``tokenize``/``tokenize_batch`` (text -> ids),
``detokenize`` (ids -> text), ``vocab_size`` (number of ids, special tokens included) and ``eod``
(the end-of-document id, or None when the vocabulary has none). ``unique_identifiers`` lets
megatron-core's ``GPTDatasetConfig`` hash the tokenizer into its dataset-cache key; ``identity``
(type, vocabulary size, sha256 of its files) is what a dataset records of the tokenizer that
wrote it (``data.tokenizer_sidecar``).

The module imports no torch, so preprocessing workers start quickly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.flags import option

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)
GPT2_EOD_TOKEN = "<|endoftext|>"


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be built from the given files or flags."""


@dataclass
class TokenizerConfig:
    """Which tokenizer, from which files (Megatron-LM's flags)."""

    tokenizer_type: str = option(choices=TOKENIZER_TYPES)
    """The tokenizer's kind, as in Megatron-LM: a SentencePiece model (GPTSentencePieceTokenizer:
    its own ids, end of document = its EOS; Llama2Tokenizer: the same with a BOS before every
    text; SentencePieceTokenizer: <CLS> <SEP> <EOD> <MASK> and pad/BOS/EOS pieces added after
    the model's, end of document = <EOD>), GPT-2 byte-level BPE, a local Hugging Face tokenizer
    directory, or NullTokenizer (the text is the ids, separated by spaces; needs
    --vocab-size)."""
    tokenizer_model: str | None = None
    """SentencePiece .model file, or a Hugging Face tokenizer directory."""
    vocab_size: int | None = None
    """NullTokenizer's vocabulary: ids 0 ... N-1, and N is the end of document (N + 1 ids, as in
    Megatron-LM). With another tokenizer, if given, it must be that tokenizer's size."""
    vocab_file: str | None = None
    """GPT-2 vocab.json."""
    merge_file: str | None = None
    """GPT-2 merges.txt."""

    def build(self) -> _Tokenizer:
        return build_tokenizer(**dataclasses.asdict(self))


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a dataset's token ids mean: which tokenizer, how many ids, from which files."""

    tokenizer_type: str
    """The ``--tokenizer-type`` value (one of ``TOKENIZER_TYPES``)."""
    vocab_size: int
    """Number of ids, special tokens included (before any padding of the model's vocabulary)."""
    sha256: str
    """sha256 (hex) of the bytes of the files the tokenizer reads, one after the other: GPT-2's
    vocab.json then merges.txt, the SentencePiece model, or a Hugging Face directory's .json,
    .txt and .model files in name order. The path of a file does not count, its content does."""

    def describe(self) -> str:
        return f"{self.tokenizer_type}, {self.vocab_size} ids, sha256 {self.sha256[:12]}"


def _files_sha256(*paths: str) -> str:
    """sha256 of the files' bytes, concatenated in the order given."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if not path:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path!r}: no such file")
    return path


class _Tokenizer:
    """Shared surface; subclasses set ``vocab_size``, ``eod``, ``files`` and ``files_sha256``."""

    vocab_size: int
    eod: int | None
    files: list[str]
    """The files the tokenizer reads, in the order ``files_sha256`` hashes them."""
    files_sha256: str
    _digest_key: str  # the name unique_identifiers gives the files' digest

    def _read_files(self, *paths: str) -> None:
        self.files = list(paths)
        self.files_sha256 = _files_sha256(*paths)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def identity(self) -> TokenizerIdentity:
        return TokenizerIdentity(type(self).__name__, self.vocab_size, self.files_sha256)

    @property
    def unique_identifiers(self) -> dict:
        ids = {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}
        # the key megatron-core's sample-index caches were written under: keep it as it was
        return {**ids, self._digest_key: self.files_sha256[:16]}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class _SentencePieceModel(_Tokenizer):
    """A SentencePiece model's own ids, nothing added; end of document = the model's EOS piece."""

    _digest_key = "model_sha256"

    def __init__(self, model_file: str):
        import sentencepiece

        self.model_file = model_file
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(
                f"--tokenizer-model {model_file!r}: not a SentencePiece model ({e})"
            ) from None
        self.vocab_size = int(self._sp.vocab_size())
        eos = int(self._sp.eos_id())
        self.eod = eos if eos >= 0 else None
        self._read_files(model_file)

    @property
    def identity(self) -> TokenizerIdentity:  # the model's own ids, whichever class reads them
        return TokenizerIdentity("GPTSentencePieceTokenizer", self.vocab_size, self.files_sha256)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # one thread: preprocessing parallelises over worker processes instead
        return self._sp.encode(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class GPTSentencePieceTokenizer(_SentencePieceModel):
    """Megatron-LM's GPTSentencePieceTokenizer: the SentencePiece model's ids, nothing added;
    end of document = its EOS."""


class Llama2Tokenizer(_SentencePieceModel):
    """LLaMA-2's SentencePiece model as Megatron-LM reads it: every text starts with the BOS id
    (a document in preprocessing, a prompt in generation); end of document = EOS. The ids mean
    what ``GPTSentencePieceTokenizer``'s mean (same identity)."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.bos = int(self._sp.bos_id())
        if self.bos < 0:
            raise TokenizerError(
                f"--tokenizer-type Llama2Tokenizer: --tokenizer-model {model_file!r} has no BOS "
                "piece: use GPTSentencePieceTokenizer (no BOS)"
            )

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in super().tokenize_batch(texts)]


SENTENCEPIECE_SPECIALS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")
"""The tokens Megatron-LM's SentencePieceTokenizer adds first, in this order."""


class SentencePieceTokenizer(_SentencePieceModel):
    """Megatron-LM's SentencePieceTokenizer: the model's pieces, then the special tokens it adds
    after them when the model lacks them: <CLS>, <SEP>, <EOD>, <MASK>, then the model's pad, BOS
    and EOS pieces (<PAD>, <BOS>, <EOS> when it has none). End of document = <EOD>. A special
    token written in the text is that token (the earliest in the text first; at one position,
    the first in that order); detokenizing writes each special token between spaces."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        sp = self._sp
        pieces = {sp.id_to_piece(i): i for i in range(self.vocab_size)}

        def own(piece_id: int, fallback: str) -> str:
            return sp.id_to_piece(piece_id) if 0 <= piece_id < self.vocab_size else fallback

        named = [*SENTENCEPIECE_SPECIALS, own(sp.pad_id(), "<PAD>"), own(sp.bos_id(), "<BOS>"),
                 own(sp.eos_id(), "<EOS>")]  # fmt: skip
        self.special_ids: dict[str, int] = {}
        for token in named:
            if token not in pieces:
                pieces[token] = len(pieces)
            self.special_ids.setdefault(token, pieces[token])
        self.special_tokens = {i: t for t, i in self.special_ids.items()}
        self.vocab_size = len(pieces)
        self.eod = self.special_ids["<EOD>"]
        alternatives = "|".join(re.escape(t) for t in self.special_ids)
        self._specials = re.compile(f"({alternatives})")

    @property
    def identity(self) -> TokenizerIdentity:
        return TokenizerIdentity("SentencePieceTokenizer", self.vocab_size, self.files_sha256)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out = super().tokenize_batch(texts)  # right for every text without a special token
        for i, text in enumerate(texts):
            if self._specials.search(text):
                parts = self._specials.split(text)  # text, token, text, token, ..., text
                out[i] = [
                    token for j, part in enumerate(parts) for token in
                    ([self.special_ids[part]] if j % 2 else self._sp.encode(part))
                ]  # fmt: skip
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        text, run = "", []
        for i in (int(i) for i in ids):
            if i in self.special_tokens:
                text += self._sp.decode(run) + " " + self.special_tokens[i] + " "
                run = []
            else:
                run.append(i)
        return text + self._sp.decode(run)


class GPT2BPETokenizer(_Tokenizer):
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt``; end of document = <|endoftext|>.

    Encoding is lossless: every string round-trips through ``detokenize(tokenize(s))``.
    """

    _digest_key = "vocab_sha256"

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.vocab_file, self.merge_file = vocab_file, merge_file
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust loader raises a bare Exception
            raise TokenizerError(
                f"--vocab-file {vocab_file!r} / --merge-file {merge_file!r}: cannot load a GPT-2 "
                f"BPE vocabulary ({e})"
            ) from None
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self.vocab_size = int(tok.get_vocab_size())
        self.eod = tok.token_to_id(GPT2_EOD_TOKEN)
        self._read_files(vocab_file, merge_file)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(_Tokenizer):
    """Any tokenizer ``transformers.AutoTokenizer`` loads from a local directory.

    No special tokens are added when tokenizing (pretraining data gets only the EOD that
    ``--append-eod`` asks for); end of document = the tokenizer's EOS token.
    """

    _digest_key = "files_sha256"

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise TokenizerError(
                "--tokenizer-type HuggingFaceTokenizer needs the `transformers` package"
            ) from e
        self.path = path
        try:
            self._tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise TokenizerError(
                f"--tokenizer-model {path!r}: cannot load a tokenizer ({e})"
            ) from None
        self.vocab_size = len(self._tok)
        self.eod = self._tok.eos_token_id
        files = sorted(
            os.path.join(path, f)
            for f in os.listdir(path)
            if f.endswith((".json", ".txt", ".model")) and os.path.isfile(os.path.join(path, f))
        )
        self._read_files(*files)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


class NullTokenizer(_Tokenizer):
    """Megatron-LM's tokenizer of data that is already ids (``--mock-data``, benchmarks): a text
    is its ids separated by spaces. ``--vocab-size N``: ids 0 ... N-1, end of document N, so
    ``vocab_size`` is N + 1. It reads no file."""

    _digest_key = "files_sha256"

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise TokenizerError(f"--vocab-size ({vocab_size}) must be >= 1 for NullTokenizer")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)
        self._read_files()

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        out = []
        for text in texts:
            try:
                ids = [int(x) for x in text.split()]
            except ValueError:
                raise TokenizerError(
                    f"NullTokenizer reads ids separated by spaces, got {text[:40]!r}"
                ) from None
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise TokenizerError(
                    f"NullTokenizer: id {bad[0]} outside [0, {self.vocab_size}) (--vocab-size "
                    f"{self.eod})"
                )
            out.append(ids)
        return out

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


_SENTENCEPIECE = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
}


def build_tokenizer(
    tokenizer_type: str,
    *,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    vocab_size: int | None = None,
) -> _Tokenizer:
    """Build a tokenizer from Megatron-LM's flags (``--tokenizer-type`` and its files,
    ``--vocab-size``)."""
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    tokenizer = _build_from_files(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
        raise TokenizerError(
            f"--vocab-size {vocab_size}: --tokenizer-type {tokenizer_type} has "
            f"{tokenizer.vocab_size} ids; leave --vocab-size out (only NullTokenizer needs it)"
        )
    return tokenizer


def _build_from_files(
    tokenizer_type: str,
    tokenizer_model: str | None,
    vocab_file: str | None,
    merge_file: str | None,
) -> _Tokenizer:
    if tokenizer_type in _SENTENCEPIECE:
        model = _require_file(tokenizer_model, "--tokenizer-model", tokenizer_type)
        return _SENTENCEPIECE[tokenizer_type](model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _require_file(vocab_file, "--vocab-file", tokenizer_type),
            _require_file(merge_file, "--merge-file", tokenizer_type),
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model or not os.path.isdir(tokenizer_model):
            raise TokenizerError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model pointing at a "
                f"local tokenizer directory (got {tokenizer_model!r})"
            )
        return HuggingFaceTokenizer(tokenizer_model)
    raise TokenizerError(
        f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}"
    )
