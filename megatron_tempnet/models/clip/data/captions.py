"""Caption noise for the robustness experiment (TempNet, Qiu et al., ICML 2024, Section 6.2).

A chosen caption loses one random word or has it replaced by the word ``random`` (even odds), so
the pair's text no longer fully describes its image. The choice and the edit are a pure function
of ``(seed, index)``: every data-parallel rank, DataLoader worker and resumed run sees the same
noisy caption for a sample, and evaluation (percent 0) sees the clean one.

Also the captions' token layout: ids, the end-of-text token, zero padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NOISE_WORD = "random"
_NOISE_STREAM = 7919  # keeps the noise draws apart from the augmentation's (seed, epoch, index)


def noisy_caption(caption: str, percent: float, seed: int, index: int) -> str:
    """``caption`` with one word edited, with probability ``percent / 100``; else unchanged.

    Words are the whitespace-split tokens. An edited caption of two or more words has one
    uniformly chosen word deleted or replaced by ``'random'`` with equal probability; a one-word
    caption has its word replaced (it never becomes empty). Edited captions are re-joined with
    single spaces; an untouched caption is returned as is. Deterministic in ``(seed, index)``.

    Args:
        caption: the raw caption.
        percent: ``--caption-noise``, in [0, 100].
        seed: ``--seed``.
        index: the sample's stable index in its dataset.
    """
    if not 0.0 <= percent <= 100.0:
        raise ValueError(f"--caption-noise ({percent}) is a percentage: give a value in [0, 100]")
    if percent == 0.0:
        return caption
    # % 2**64: numpy's SeedSequence takes non-negative words (identity for the usual seeds)
    rng = np.random.default_rng([int(v) % (1 << 64) for v in (seed, index, _NOISE_STREAM)])
    if rng.uniform(0.0, 100.0) >= percent:
        return caption
    words = caption.split()
    if not words:
        return caption
    position = int(rng.integers(0, len(words)))
    if len(words) > 1 and rng.uniform() < 0.5:
        del words[position]
    else:
        words[position] = NOISE_WORD
    return " ".join(words)


def tokenize_captions(tokenizer, texts: Sequence[str], context_length: int):
    """Captions -> ``tokens [n, context_length]`` int64 and ``lengths [n]`` int64.

    Row ``i``: the caption's ids cut to ``context_length - 1``, the end-of-text id
    (``tokenizer.eod``) at ``lengths[i] - 1``, then zero padding; CLIP's text tower pools at the
    end-of-text token. ``tokenizer`` needs ``tokenize(str) -> list[int]`` (its
    ``tokenize_batch`` is used when it has one) and ``eod``.
    """
    if tokenizer.eod is None:
        raise ValueError(no_eod_message(tokenizer))
    batch = getattr(tokenizer, "tokenize_batch", None)
    ids_per_text = batch(list(texts)) if batch else [tokenizer.tokenize(t) for t in texts]
    tokens = torch.zeros(len(texts), context_length, dtype=torch.int64)  # [n, L], 0 = padding
    lengths = torch.zeros(len(texts), dtype=torch.int64)  # [n]
    for row, ids in enumerate(ids_per_text):
        ids = list(ids[: context_length - 1]) + [tokenizer.eod]
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        lengths[row] = len(ids)
    return tokens, lengths


def no_eod_message(tokenizer) -> str:
    return (
        f"the tokenizer {tokenizer!r} has no end-of-text token (eod): CLIP's text tower pools "
        "there; use a vocabulary with one (e.g. GPT2BPETokenizer's <|endoftext|>)"
    )
