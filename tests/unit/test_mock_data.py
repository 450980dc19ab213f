"""--mock-data: megatron-core's synthetic GPT documents (``1, 2, ..., len - 1`` then the end of
document, modulo the vocabulary) through the same builder, cache and resumable loader as real
data; --data-path and --mock-data exclusive; --split accepted (the documents split evenly, as in
Megatron-LM)."""

from __future__ import annotations

import pytest
import torch

from megatron_tempnet.data.gpt_data import GPTDataConfig, build_gpt_datasets, check_data_source
from megatron_tempnet.data.loader import (
    DataConfigError,
    DataState,
    ResumableLoader,
    dataset_fingerprint,
)
from megatron_tempnet.data.tokenizers import build_tokenizer

SEQ, VOCAB = 16, 50


def _mock(cache: str, seed: int = 1234, split: str = "99,1,0") -> list:
    config = GPTDataConfig(
        mock_data=True, split=split, seq_length=SEQ, seed=seed, data_cache_path=cache
    )
    return build_gpt_datasets(
        config, build_tokenizer("NullTokenizer", vocab_size=VOCAB), [40, 8, 8]
    )


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return cache, _mock(cache)


def test_samples_are_runs_of_consecutive_ids_ended_by_the_eod(mock):
    _, (train, valid, test) = mock
    eod, ids = VOCAB, VOCAB + 1  # NullTokenizer: --vocab-size N has N + 1 ids, eod N
    for dataset in (train, valid):
        for i in range(24):
            sample = dataset[i]
            tokens, labels = sample["tokens"], sample["labels"]
            assert tokens.shape == (SEQ,) and torch.equal(tokens[1:], labels[:-1])
            stream = torch.cat([tokens, labels[-1:]]).tolist()
            for now, following in zip(stream, stream[1:]):
                # within a document the next id; after the eod the next document's first id (1),
                # or another eod (a document of length 1)
                assert following in ((now + 1) % ids, eod, 1), (i, stream)
            assert sample["loss_mask"].eq(1).all()
    # --split 99,1,0 is accepted; megatron-core splits mock documents evenly whatever it says
    assert test is not None and 0.9 < len(valid) / len(train) < 1.1


def test_deterministic_cached_and_resumable(mock, tmp_path):
    cache, (train, _, _) = mock
    again, _, _ = _mock(cache)  # read back from the cache
    other_seed, _, _ = _mock(str(tmp_path), seed=7)
    assert dataset_fingerprint(again) == dataset_fingerprint(train)
    assert dataset_fingerprint(other_seed) != dataset_fingerprint(train)
    assert all(torch.equal(again[i]["tokens"], train[i]["tokens"]) for i in range(16))
    # the loader's position: three micro-batches, a resume, the fourth (samples 0 ... 15)
    loader = ResumableLoader(train, DataState(0, dataset_fingerprint(train)), 4)
    seen = [next(loader)["tokens"] for _ in range(3)]
    saved = DataState.from_state_dict(loader.state().state_dict(), train)
    seen.append(next(ResumableLoader(train, saved, 4))["tokens"])
    expected = torch.stack([train[i]["tokens"] for i in range(16)]).view(4, 4, SEQ)
    assert all(torch.equal(s, e) for s, e in zip(seen, expected))


@pytest.mark.parametrize(
    "data_path,mock_data,message",
    [
        (["d"], True, "--mock-data and --data-path are exclusive"),
        (None, False, "no training data: give --data-path [WEIGHT] PREFIX ... (tools/preprocess"),
    ],
)
def test_one_data_source(data_path, mock_data, message):
    with pytest.raises(DataConfigError) as e:
        check_data_source(GPTDataConfig(data_path=data_path, mock_data=mock_data))
    assert message in str(e.value)
