"""GPT data loading: blends through megatron-core's builder, the index cache, resumable sampling."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from megatron_tempnet.data.gpt_data import (
    GPTDataConfig,
    build_gpt_datasets,
    num_samples,
    parse_blend,
    parse_split,
)
from megatron_tempnet.data.indexed import DatasetError
from megatron_tempnet.data.loader import (
    DataConfigError,
    DataState,
    PretrainingSampler,
    ResumableLoader,
    dataset_fingerprint,
)
from tests.helpers.corpus import blend_config, blend_corpus, tokenizer_flags
from tests.helpers.entry_points import cli_flags, run_command

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return blend_corpus(str(tmp_path_factory.mktemp("corpus")))


def _config(corpus, cache: str, **kw) -> GPTDataConfig:
    return blend_config(corpus, cache, SEQ, **kw)


def _document_token_strings(prefix: str) -> list[bytes]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.array(ds[i], dtype=np.int64).tobytes() for i in range(len(ds))]


def _cache_listing(cache: str) -> dict[str, float]:
    return {f: os.path.getmtime(os.path.join(cache, f)) for f in sorted(os.listdir(cache))}


def test_blend_counts_order_and_cache_reuse(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    sizes = num_samples(train_iters=50, global_batch_size=8, eval_interval=25, eval_iters=2)
    assert sizes == [400, 48, 16]  # (50 // 25 + 1) evaluations of 2 iterations of 8
    train, valid, test = build_gpt_datasets(_config(corpus, cache), corpus["tokenizer"], sizes)
    assert len(train) >= 400 and len(valid) >= 48 and len(test) >= 16
    # samples per dataset follow the weights (megatron-core's greedy blending: within 1 sample)
    from_a = int((np.asarray(train.dataset_index[:400]) == 0).sum())
    assert abs(from_a - 0.7 * 400) <= 1
    # every sample is seq_length + 1 consecutive tokens of its dataset's documents
    docs = {i: _document_token_strings(corpus["prefix"][n]) for i, n in enumerate("AB")}
    eod = corpus["tokenizer"].eod
    samples = [train[i] for i in range(120)]
    for s in samples:
        tokens, labels = s["tokens"], s["labels"]
        assert tokens.shape == labels.shape == (SEQ,)
        assert torch.equal(tokens[1:], labels[:-1])
        stream = torch.cat([tokens, labels[-1:]]).numpy()
        pieces = np.split(stream, np.flatnonzero(stream == eod) + 1)
        for piece in pieces:
            raw = piece.astype(np.int64).tobytes()
            assert any(raw in doc for doc in docs[int(s["dataset_id"])]), "not a document slice"
    assert {int(s["dataset_id"]) for s in samples} == {0, 1}
    listing = _cache_listing(cache)
    assert len(listing) > 0
    # a rerun loads the cache (no file written or rewritten) and yields the same samples
    again = build_gpt_datasets(_config(corpus, cache), corpus["tokenizer"], sizes)[0]
    assert _cache_listing(cache) == listing
    assert dataset_fingerprint(again) == dataset_fingerprint(train)
    for i, s in enumerate(samples):
        assert torch.equal(again[i]["tokens"], s["tokens"])
    # another seed: another order
    other = build_gpt_datasets(_config(corpus, cache, seed=7), corpus["tokenizer"], sizes)[0]
    assert dataset_fingerprint(other) != dataset_fingerprint(train)
    assert any(not torch.equal(other[i]["tokens"], samples[i]["tokens"]) for i in range(20))


def test_build_data_cache_tool_prebuilds_for_training(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    p = corpus["prefix"]
    cmd = [
        sys.executable,
        os.path.join(REPO, "tools", "build_data_cache.py"),
        "--data-path",
        "0.7",
        p["A"],
        "0.3",
        p["B"],
        "--split",
        "90,8,2",
        "--seq-length",
        str(SEQ),
        "--data-cache-path",
        cache,
        "--train-iters",
        "50",
        "--global-batch-size",
        "8",
        "--eval-interval",
        "25",
        "--eval-iters",
        "2",
        *cli_flags(tokenizer_flags(corpus["spec"])),
    ]
    r = run_command(cmd)
    assert r.returncode == 0, r.stderr
    listing = _cache_listing(cache)
    sizes = num_samples(50, 8, 25, 2)
    train = build_gpt_datasets(_config(corpus, cache), corpus["tokenizer"], sizes)[0]
    assert _cache_listing(cache) == listing  # training start-up only reads the cache
    assert f"hash {dataset_fingerprint(train)}" in r.stdout
    r = run_command(cmd[:2] + ["--data-path", p["A"] + ".bin"] + cmd[7:])
    assert r.returncode == 1 and "without .bin/.idx" in r.stderr and "Traceback" not in r.stderr


def test_data_path_and_split_errors(corpus, tmp_path):
    a, b = corpus["prefix"]["A"], corpus["prefix"]["B"]
    assert parse_blend([a, b]) == ([a, b], None)
    assert parse_blend(["2", a, "1", b]) == ([a, b], [2.0, 1.0])
    for bad, message in [
        ([], "--data-path is empty"),
        (["0.5", a, b], "does not alternate"),
        (["-1", a, "1", b], "must be a positive number"),
        ([a + ".idx"], "without .bin/.idx"),
    ]:
        with pytest.raises(DataConfigError, match=message):
            parse_blend(bad)
    with pytest.raises(DatasetError, match="missing.idx: no such file"):
        parse_blend([str(tmp_path / "missing")])
    assert parse_split("949,50,1") == [949.0, 50.0, 1.0]
    assert parse_split("100") == [100.0, 0.0, 0.0]
    for bad in ["a,b", "1,2,3,4", "-1,1,1", "0,0,0"]:
        with pytest.raises(DataConfigError, match="--split"):
            parse_split(bad)


def test_a_split_without_documents_is_an_error_not_a_hang(corpus, tmp_path):
    # B has 60 documents: 1/1000 of them rounds to none (megatron-core would loop forever)
    config = GPTDataConfig(
        data_path=[corpus["prefix"]["B"]],
        split="949,50,1",
        seq_length=SEQ,
        data_cache_path=str(tmp_path / "cache"),
    )
    with pytest.raises(
        DataConfigError,
        match=r"--split 949,50,1: the test split of "
        r".*B_text_document gets none of its 60 documents",
    ):
        build_gpt_datasets(config, corpus["tokenizer"], [16, 16, 0])
    config.split = "949,50,0"
    train, valid, test = build_gpt_datasets(config, corpus["tokenizer"], [16, 16, 0])
    assert len(train) >= 16 and len(valid) >= 16 and test is None


def test_sampler_slices_global_batches_across_data_parallel_ranks():
    one = list(
        PretrainingSampler(100, 10, micro_batch_size=6, data_parallel_rank=0, data_parallel_size=1)
    )
    ranks = [list(PretrainingSampler(100, 10, 3, r, 2)) for r in range(2)]
    assert one[0] == list(range(10, 16))
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 15  # 90 samples left, 6 per step
    for g, batch in enumerate(one):
        assert ranks[0][g] + ranks[1][g] == batch
    with pytest.raises(DataConfigError, match="consumed samples"):
        PretrainingSampler(100, 101, 1, 0, 1)


def test_resumed_loader_sees_the_same_samples(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    train = build_gpt_datasets(_config(corpus, cache), corpus["tokenizer"], [200, 8, 8])[0]
    start = DataState(0, dataset_fingerprint(train))
    whole = [
        b["tokens"] for _, b in zip(range(12), ResumableLoader(train, start, 4, num_workers=2))
    ]
    first = ResumableLoader(train, start, 4, num_workers=2)
    seen = [next(first)["tokens"] for _ in range(7)]
    saved = first.state().state_dict()
    assert saved == {"consumed_samples": 28, "fingerprint": dataset_fingerprint(train)}
    resumed = ResumableLoader(train, DataState.from_state_dict(saved, train), 4, num_workers=2)
    seen += [next(resumed)["tokens"] for _ in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(seen, whole))
    assert len(seen) == len(whole) == 12


def test_upstream_blend_cache_still_needs_a_process_group(corpus, tmp_path):
    """megatron-core 0.16's BlendedDataset calls torch.distributed.get_rank() when caching even
    without a process group; gpt_data._process_group_for_builder works around it. When this test
    fails, upstream is fixed: remove the workaround."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    assert not torch.distributed.is_initialized()
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=SEQ,
        blend=parse_blend(_config(corpus, "").data_path),
        split="90,8,2",
        path_to_cache=str(tmp_path / "c"),
        tokenizer=corpus["tokenizer"],
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [50, 5, 5], lambda: True, cfg)
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        builder.build()
