"""Per-sample state sharded over 1, 2 and 3 ranks: fetch/store against one dense tensor, the
checkpoint round trip, re-keying to another DP size, and errors."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

N, FIELDS, STEPS, LOCAL = 23, ("s", "b", "tau"), 6, 4


def _batches(world: int):
    """Per step: [world * LOCAL] distinct indices (a shuffled epoch-like draw)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randperm(N, generator=g)[: world * LOCAL] for _ in range(STEPS)]


def _run(world: int):
    from megatron_tempnet.models.clip.sample_state import ShardedSampleState

    rank = torch.distributed.get_rank()
    state = ShardedSampleState(N, FIELDS)
    seen_log, fetched = [], []
    for step, batch in enumerate(_batches(world)):
        mine = batch[rank * LOCAL : (rank + 1) * LOCAL]
        values, seen = state.fetch(mine)
        fetched.append(values.clone())
        seen_log.append(seen.clone())
        state.store(mine, values + mine[:, None].float() * (step + 1) + torch.tensor([0, 1, 2.0]))
    saved = state.state_dict()
    restored = ShardedSampleState(N, FIELDS)
    restored.load_state_dict(saved)
    check, _ = restored.fetch(torch.arange(rank * 3, rank * 3 + 3))
    return fetched, seen_log, check, state.values.numel(), saved


def _reference(world: int):
    dense, seen = torch.zeros(N, len(FIELDS)), torch.zeros(N, dtype=torch.bool)
    fetched, seen_log = [], []
    for step, batch in enumerate(_batches(world)):
        fetched.append(dense[batch].clone())
        seen_log.append(seen[batch].clone())
        dense[batch] = (
            dense[batch] + batch[:, None].float() * (step + 1) + torch.tensor([0, 1, 2.0])
        )
        seen[batch] = True
    return fetched, seen_log, dense


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_state_equals_one_dense_tensor(world):
    results = run_distributed(_run, world_size=world, args=(world,))
    fetched, seen_log, dense = _reference(world)
    for step in range(STEPS):
        got = torch.cat([r[0][step] for r in results])
        torch.testing.assert_close(got, fetched[step], rtol=0, atol=0)
        assert torch.equal(torch.cat([r[1][step] for r in results]), seen_log[step])
    for rank, r in enumerate(results):  # after a checkpoint round trip
        torch.testing.assert_close(r[2], dense[rank * 3 : rank * 3 + 3], rtol=0, atol=0)
    assert sum(r[3] for r in results) == N * len(FIELDS)  # each sample stored exactly once


def _rekeyed(saved: list[dict]):
    from megatron_tempnet.models.clip.sample_state import ShardedSampleState

    state = ShardedSampleState(N, FIELDS)
    state.load_state_dicts(saved)
    return state.fetch(torch.arange(N))


@pytest.mark.parametrize("saved_world,world", [(2, 3), (3, 2), (2, 1)])
def test_a_checkpoint_of_another_data_parallel_size_is_rekeyed_exactly(saved_world, world):
    """Sample i moves to rank i % DP': every rank fetches every sample's saved row, bit for bit."""
    saved = [r[4] for r in run_distributed(_run, world_size=saved_world, args=(saved_world,))]
    _, _, dense = _reference(saved_world)
    seen = torch.zeros(N, dtype=torch.bool)
    for batch in _batches(saved_world):
        seen[batch] = True
    for values, fetched_seen in run_distributed(_rekeyed, world_size=world, args=(saved,)):
        torch.testing.assert_close(values, dense, rtol=0, atol=0)
        assert torch.equal(fetched_seen, seen)


def _errors():
    from megatron_tempnet.models.clip.sample_state import SampleStateError, ShardedSampleState

    state = ShardedSampleState(N, FIELDS)
    messages = []
    for action in (
        lambda: state.fetch(torch.tensor([0, N])),
        lambda: state.store(torch.tensor([1]), torch.zeros(1, 2)),
        lambda: ShardedSampleState(N + 1, FIELDS).load_state_dict(state.state_dict()),
        lambda: ShardedSampleState(0, FIELDS),
        lambda: ShardedSampleState(N, FIELDS).load_state_dicts(
            [{**state.state_dict(), "world": 2}]
        ),
    ):
        with pytest.raises(SampleStateError) as e:
            action()
        messages.append(str(e.value))
    return messages


def test_errors_name_the_problem():
    messages = run_distributed(_errors, world_size=1)[0]
    assert f"sample index {N} is outside the dataset's {N} samples" in messages[0]
    assert "should be (1, 3)" in messages[1]
    assert "same dataset and data-parallel size" in messages[2]
    assert "dataset size >= 1" in messages[3]
    assert "the shard of rank 0 of 2 has 23 rows, 12 expected" in messages[4]


def test_memory_per_rank_at_400m_samples():
    from megatron_tempnet.models.clip.sample_state import ShardedSampleState

    per_rank = ShardedSampleState.bytes_per_rank(400_000_000, 6, 64)
    assert per_rank == 6_250_000 * 25 and per_rank / 2**20 == pytest.approx(149.0, abs=0.1)
