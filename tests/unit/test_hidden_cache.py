"""models.gpt.hidden_cache (--frozen-lm-cache): which micro-batches are read and which computed,
and the folders it refuses."""

from __future__ import annotations

import pytest
import torch

from megatron_tempnet.models.gpt.hidden_cache import FrozenHiddenCache
from megatron_tempnet.trainer.errors import ConfigError


class Counted:
    """A stand-in frozen LM body: ``[b, s]`` tokens -> ``[s, b, h]`` (``offset``: other
    values, to tell a read from a recomputation)."""

    def __init__(self, lm: torch.nn.Embedding):
        self.lm = lm

    def __call__(self, tokens: torch.Tensor, offset: int = 0):
        return lambda: self.lm(tokens + offset).transpose(0, 1)


def test_a_micro_batch_is_read_when_every_sample_is_stored(tmp_path):
    torch.manual_seed(0)
    lm = torch.nn.Embedding(50, 4).requires_grad_(False)
    body = Counted(lm)
    cache = FrozenHiddenCache(str(tmp_path), lm, {"model": "x"}, 1, 2)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    positions = torch.arange(3)[None]
    first = cache.hidden(tokens, positions, body(tokens))
    assert (cache.read, cache.computed) == (0, 2)
    assert len(list((tmp_path / "tp01-of-02").glob("*/*.pt"))) == 2
    # stored values are read back, not recomputed: a stand-in giving other values is not called
    again = cache.hidden(tokens, positions, body(tokens, offset=10))
    assert torch.equal(again, first) and (cache.read, cache.computed) == (2, 2)
    # samples in another grouping are found one by one
    swapped = cache.hidden(tokens.flip(0), positions, body(tokens, offset=10))
    assert torch.equal(swapped, first.flip(1))
    # a sample not stored (other positions count as another sample): the batch is computed
    # whole, and only the missing sample is added
    mixed = torch.tensor([[1, 2, 3], [7, 8, 9]])
    out = cache.hidden(mixed, positions, body(mixed))
    assert torch.equal(out, lm(mixed).transpose(0, 1)) and cache.computed == 3
    reset = torch.tensor([[0, 1, 0], [0, 1, 2]])  # the first sample's positions restart
    cache.hidden(tokens, reset, body(tokens))
    assert cache.computed == 4
    assert len(list((tmp_path / "tp01-of-02").glob("*/*.pt"))) == 4


def test_a_folder_of_another_lm_is_refused(tmp_path):
    lm = torch.nn.Embedding(50, 4).requires_grad_(False)
    tokens, positions = torch.tensor([[1, 2]]), torch.arange(2)[None]
    FrozenHiddenCache(str(tmp_path), lm, {"model": "x"}, 0, 1).hidden(
        tokens, positions, lambda: lm(tokens).transpose(0, 1)
    )
    with torch.no_grad():
        lm.weight[3, 1] += 1e-6
    for settings, differ in (({"model": "x"}, "(weights differ"), ({"model": "y"}, "(model, ")):
        cache = FrozenHiddenCache(str(tmp_path), lm, settings, 0, 1)
        with pytest.raises(ConfigError, match=r"--frozen-lm-cache .*: it holds the hidden") as e:
            cache.hidden(tokens, positions, lambda: lm(tokens).transpose(0, 1))
        assert differ in str(e.value)
    # another TP rank's folder is its own
    other = FrozenHiddenCache(str(tmp_path), lm, {"model": "y"}, 0, 2)
    other.hidden(tokens, positions, lambda: lm(tokens).transpose(0, 1))
    assert other.computed == 1
