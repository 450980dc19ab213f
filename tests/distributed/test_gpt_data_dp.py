"""GPT data under torch.distributed: one shared index cache, data-parallel slices of a batch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_tempnet.data.gpt_data import build_gpt_datasets
from megatron_tempnet.data.loader import DataState, ResumableLoader, dataset_fingerprint
from tests.helpers.corpus import blend_config, blend_corpus
from tests.helpers.distributed import run_distributed

SEQ = 16


def _rank_batches(corpus, cache, consumed):
    rank, world = dist.get_rank(), dist.get_world_size()
    train = build_gpt_datasets(blend_config(corpus, cache, SEQ), corpus["tokenizer"], [64, 8, 8])[0]
    state = DataState(consumed, dataset_fingerprint(train))
    loader = ResumableLoader(train, state, 2, data_parallel_rank=rank, data_parallel_size=world)
    batches = [next(loader)["tokens"] for _ in range(3)]
    return dataset_fingerprint(train), batches, loader.state().consumed_samples


def test_two_ranks_share_the_cache_and_split_each_global_batch(tmp_path):
    corpus = blend_corpus(str(tmp_path))
    cache = str(tmp_path / "cache")
    results = run_distributed(_rank_batches, world_size=2, args=(corpus, cache, 4), timeout=300)
    (hash0, b0, c0), (hash1, b1, c1) = results
    assert hash0 == hash1 and c0 == c1 == 4 + 3 * 2 * 2
    written = sorted(os.listdir(cache))
    # one process alone, DP = 1 with the global micro-batch (2 x 2): same samples, same order
    train = build_gpt_datasets(blend_config(corpus, cache, SEQ), corpus["tokenizer"], [64, 8, 8])[0]
    assert sorted(os.listdir(cache)) == written  # built once, by rank 0
    single = ResumableLoader(train, DataState(4, dataset_fingerprint(train)), 4)
    for g in range(3):
        assert torch.equal(next(single)["tokens"], torch.cat([b0[g], b1[g]]))
