"""GPT training data: megatron-core ``GPTDataset`` blends of indexed token datasets.

Datasets come from megatron-core's ``BlendedMegatronDatasetBuilder`` (``--data-path [w1] p1
[w2] p2 ...``, ``--split``); their document/sample/shuffle indices are cached under
``--data-cache-path`` by megatron-core and reused by every later run with the same settings
(``tools/build_data_cache.py`` builds them ahead of training on one process). The training loop
reads them through ``loader.ResumableLoader``.

Before any of that, every dataset is checked against the run's tokenizer (``check_datasets``):
the tokenizer recorded beside it (``tokenizer_sidecar``) must be the run's, and its token ids
must lie inside the run's vocabulary (``token_range``; scanned once, cached with the indices).

``--mock-data`` replaces the datasets by megatron-core's ``MockGPTDataset`` (Megatron-LM's
meaning): 100000 synthetic documents of seeded random lengths below 4096 tokens, document ``d``
being the ids ``1, 2, ..., len(d) - 1`` (modulo the vocabulary) then the end-of-document id. Its
samples, split, shuffling and cache are megatron-core's, and the run reads them through the same
loader and data position as real data.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

from megatron_tempnet.data.indexed import DatasetError, document_count, validate_indexed_dataset
from megatron_tempnet.data.loader import DataConfigError
from megatron_tempnet.data.token_range import check_token_ids
from megatron_tempnet.data.tokenizer_sidecar import check_tokenizer, sidecar_path
from megatron_tempnet.data.tokenizers import TokenizerIdentity
from megatron_tempnet.utils.flags import derived, option
from megatron_tempnet.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class GPTDataConfig:
    """Where the training tokens come from and how samples are cut."""

    data_path: list[str] | None = option(None, metavar="[WEIGHT] PREFIX")
    """Indexed dataset prefixes (tools/preprocess_data.py's output), each optionally preceded by
    its blending weight: [w1] p1 [w2] p2 ... (or --mock-data)."""
    mock_data: bool = False
    """Train and validate on megatron-core's synthetic token data instead of --data-path (usually
    with --tokenizer-type NullTokenizer --vocab-size N); its documents are split evenly into
    train, validation and test whatever --split says, as in Megatron-LM."""
    split: str = "969,30,1"
    """Train,valid,test proportions of every dataset's documents."""
    seq_length: int = 1024
    """Tokens per sample (each sample reads seq_length + 1 tokens)."""
    seed: int = 1234
    """Shuffles the documents and samples."""
    data_cache_path: str | None = None
    """Directory for the cached sample indices (default: beside each dataset)."""
    reset_position_ids: bool = False
    """Restart the position ids after every end-of-document token."""
    reset_attention_mask: bool = False
    """No attention across end-of-document tokens."""
    eod_mask_loss: bool = False
    """No loss on end-of-document targets."""
    create_attention_mask: bool = derived(False)
    """Return an explicit [1, s, s] causal mask per sample (only needed by some kernels)."""


def check_data_source(config: GPTDataConfig) -> None:
    """Exactly one of --data-path and --mock-data."""
    if config.mock_data and config.data_path:
        raise DataConfigError(
            "--mock-data and --data-path are exclusive: synthetic data or datasets, not both"
        )
    if not config.mock_data and not config.data_path:
        raise DataConfigError(
            "no training data: give --data-path [WEIGHT] PREFIX ... (tools/preprocess_data.py's "
            "output) or --mock-data"
        )


def parse_blend(data_path: list[str] | None) -> tuple[list[str], list[float] | None]:
    """Split ``--data-path`` into prefixes and weights, checking every dataset on disk."""
    if not data_path:
        raise DataConfigError("--data-path is empty; give at least one dataset prefix")
    weighted = len(data_path) % 2 == 0 and _is_number(data_path[0])
    if weighted:
        raw_weights, prefixes = data_path[0::2], list(data_path[1::2])
        weights = []
        for w, prefix in zip(raw_weights, prefixes):
            if not _is_number(w) or float(w) <= 0 or not math.isfinite(float(w)):
                raise DataConfigError(
                    f"--data-path: weight {w!r} before {prefix!r} must be a positive number "
                    "(give weights for all datasets or for none)"
                )
            weights.append(float(w))
    else:
        prefixes, weights = list(data_path), None
        numbers = [p for p in prefixes if _is_number(p)]
        if numbers:
            raise DataConfigError(
                f"--data-path: {numbers[0]!r} looks like a weight but the list does not alternate "
                "weight, prefix (give weights for all datasets or for none)"
            )
    for prefix in prefixes:
        if prefix.endswith((".bin", ".idx")):
            raise DataConfigError(
                f"--data-path {prefix!r}: give the prefix without .bin/.idx (here {prefix[:-4]!r})"
            )
        validate_indexed_dataset(prefix)
    return prefixes, weights


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` -> three non-negative proportions (missing ones are zero)."""
    try:
        # quotes kept by a launch script's word splitting ("--split '99,1,0'") are not part of
        # the numbers, as in Megatron-LM
        parts = [float(x) for x in split.strip("'\"").replace("/", ",").split(",")]
    except ValueError:
        raise DataConfigError(f"--split {split!r}: expected numbers such as 949,50,1") from None
    if len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataConfigError(
            f"--split {split!r}: expected up to three non-negative numbers with a positive sum"
        )
    return parts + [0.0] * (3 - len(parts))


def num_samples(
    train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int
) -> list[int]:
    """Samples each split must provide: [train, valid, test] (Megatron-LM's convention)."""
    evaluations = train_iters // eval_interval + 1 if eval_interval > 0 else 0
    return [
        train_iters * global_batch_size,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    ]


def split_samples(training) -> list[int]:
    """[train, valid, test] samples a run with these training flags (a ``TrainingConfig`` with
    its global batch filled) reads: ``num_samples`` of its iterations, the training split's from
    --train-samples and the batch ramp (``train_samples_needed``)."""
    t = training
    sizes = num_samples(t.iterations, t.global_batch_size, t.eval_interval, t.eval_iters)
    sizes[0] = t.train_samples_needed()
    return sizes


def build_gpt_datasets(
    config: GPTDataConfig,
    tokenizer,
    sizes: list[int],
    vocab_size: int | None = None,
    group=None,
) -> list:
    """[train, valid, test] megatron-core datasets (None where a split is empty).

    ``tokenizer`` needs ``vocab_size``, ``eod``, ``identity`` and ``unique_identifiers`` (see
    ``tokenizers``); every token id must be below ``vocab_size`` (default: the tokenizer's).
    Every dataset is checked first (``check_datasets``: on every rank, before any collective;
    ``group``: where the other ranks wait for rank 0's check);
    with --mock-data the datasets are megatron-core's ``MockGPTDataset``. Under
    torch.distributed, rank 0 builds (or loads) the cached indices first and the other ranks then
    load them (megatron-core's protocol).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    check_data_source(config)
    split = ",".join(f"{p:g}" for p in parse_split(config.split))
    if config.seq_length < 1:
        raise DataConfigError(f"--seq-length ({config.seq_length}) must be >= 1")
    if config.data_cache_path:
        os.makedirs(config.data_cache_path, exist_ok=True)
    blend, dataset_class = None, MockGPTDataset  # megatron-core: no blend means mock data
    if not config.mock_data:
        prefixes, weights = parse_blend(config.data_path)
        _check_split_documents(prefixes, config.split)
        vocab = tokenizer.vocab_size if vocab_size is None else vocab_size
        check_datasets(prefixes, tokenizer.identity, vocab, config.data_cache_path, group)
        blend, dataset_class = (prefixes, weights), GPTDataset
    gpt_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=blend,
        split=split,
        path_to_cache=config.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
    )
    builder = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, gpt_config)
    with _process_group_for_builder():
        return builder.build()


def check_datasets(
    prefixes: list[str],
    identity: TokenizerIdentity,
    vocab_size: int,
    cache_dir: str | None,
    group=None,
) -> None:
    """Every rank raises the same ``DatasetError`` when a dataset was tokenised with another
    tokenizer than ``identity`` or holds a token id outside ``[0, vocab_size)``.

    Rank 0 (of the default group, as megatron-core's builder) does the work: it reads the
    tokenizer records and the cached id ranges, scanning a dataset's ``.bin`` when it has no
    valid cache entry in ``cache_dir`` (``token_range``). It broadcasts its verdict, so that all
    ranks stop together with the same one-line error, before any other collective of the data.
    ``group``: where the others wait for it (None: the default group; a run gives its host group,
    whose timeout allows a long scan).
    """
    import torch.distributed as dist

    verdict: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _check_datasets_here(prefixes, identity, vocab_size, cache_dir)
        except DatasetError as e:
            verdict = [str(e)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0, group=group)
    if verdict[0] is not None:
        raise DatasetError(verdict[0])


def _check_datasets_here(prefixes, identity, vocab_size, cache_dir) -> None:
    for prefix in check_tokenizer(prefixes, identity):
        logger.info(
            "%s: no %s (written by an older version or another tool): its tokenizer cannot be "
            "checked, only that its token ids fit the vocabulary (%d ids)",
            prefix,
            os.path.basename(sidecar_path(prefix)),
            vocab_size,
        )
    for prefix in prefixes:
        check_token_ids(prefix, vocab_size, cache_dir)


def _check_split_documents(prefixes: list[str], split: str) -> None:
    """Every split with a share gets documents of every dataset (megatron-core loops forever
    building a split that has none). Same rounding as megatron-core."""
    parts = parse_split(split)
    bounds = [sum(parts[:i]) / sum(parts) for i in range(4)]
    for prefix in prefixes:
        n = document_count(prefix)
        for i, name in enumerate(("train", "validation", "test")):
            if parts[i] > 0 and round(bounds[i + 1] * n) <= round(bounds[i] * n):
                raise DataConfigError(
                    f"--split {split}: the {name} split of {prefix} gets none of its {n} "
                    "documents: give that split a larger share, or 0 for no such split"
                )


@contextlib.contextmanager
def _process_group_for_builder():
    """Upstream workaround: megatron-core 0.16's ``BlendedDataset`` calls
    ``torch.distributed.get_rank()`` when it caches its indices, even in a single process with no
    process group. Give such a process a private one-rank gloo group for the build.
    (tests/unit/test_gpt_data.py fails when upstream no longer needs this.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
