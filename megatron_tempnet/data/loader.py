"""The position in the training data, and a loader that resumes from it exactly.

The position is one number, the global count of consumed samples: sample ``i`` of the run is
``dataset[i]`` whatever the data-parallel layout, global batch ``g`` covers samples
``g * B ... (g + 1) * B - 1`` and each data-parallel rank takes its slice of every micro-batch.
``DataState`` keeps the position (with a fingerprint of the dataset) for checkpoints, so a resumed
run sees exactly the samples an uninterrupted run would have seen, on any layout.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.logging import warn_rank0


class DataConfigError(UserError, ValueError):
    """A data flag with an unusable value; the message names the flag."""


def dataset_fingerprint(dataset) -> str | None:
    """megatron-core's hash of everything that decides a dataset's samples (None for None)."""
    return None if dataset is None else dataset.unique_description_hash


class PretrainingSampler:
    """Micro-batches of sample indices for one data-parallel rank, in global order.

    Global batch ``g`` (of ``micro_batch_size * data_parallel_size`` samples) covers indices
    ``consumed_samples + g * mbs * dp ...``; rank ``r`` takes the ``r``-th slice of each. Only
    full global micro-batches are produced. Starting from ``consumed_samples`` resumes exactly.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ):
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise DataConfigError("micro batch size and data-parallel size must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise DataConfigError(
                f"data-parallel rank {data_parallel_rank} outside [0, {data_parallel_size})"
            )
        if not 0 <= consumed_samples <= total_samples:
            raise DataConfigError(
                f"consumed samples ({consumed_samples}) outside the dataset's {total_samples}: "
                "the checkpoint's data position does not fit this dataset"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.world = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.world)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.world
        first = self.consumed_samples + self.rank * self.micro_batch_size
        for start in range(first, first + len(self) * step, step):
            yield list(range(start, start + self.micro_batch_size))


@dataclass
class DataState:
    """The checkpointed position in the training data."""

    consumed_samples: int
    fingerprint: str | None

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "fingerprint": self.fingerprint}

    @classmethod
    def from_state_dict(cls, state: dict, dataset) -> DataState:
        """Restore, warning when the dataset now differs from the checkpoint's."""
        now = dataset_fingerprint(dataset)
        if state.get("fingerprint") and now and state["fingerprint"] != now:
            warn_rank0(
                "the training data differs from the checkpoint's (dataset hash %s, was %s): "
                "the resumed run continues at sample %d of the new data",
                now,
                state["fingerprint"],
                state["consumed_samples"],
            )
        return cls(int(state["consumed_samples"]), now)


def _ignore_stop_signals(worker_id: int) -> None:
    """A worker leaves SIGTERM/SIGUSR1 (SLURM's warning and preemption, sent to every process of
    the job) to the training process, which stops at a checkpoint and takes its workers down."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


class ResumableLoader:
    """A DataLoader over a ``PretrainingSampler`` that counts what it has handed out.

    ``state()`` is the position after the micro-batches returned so far, whatever the
    DataLoader's workers have prefetched: sample ``i`` is ``dataset[i]`` in any process (the
    datasets draw their randomness from the index), so the batches and a resume are the same
    with any ``num_workers``.
    """

    def __init__(
        self,
        dataset,
        state: DataState,
        micro_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        num_workers: int = 0,
    ):
        import torch

        self.state_ = DataState(state.consumed_samples, state.fingerprint)
        self._step = micro_batch_size * data_parallel_size
        sampler = PretrainingSampler(
            len(dataset),
            state.consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        self._loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            # page-locked batches on a GPU machine: the step copies them without waiting
            pin_memory=torch.cuda.is_available(),
            persistent_workers=num_workers > 0,
            worker_init_fn=_ignore_stop_signals if num_workers > 0 else None,
            # its own generator: the DataLoader draws a worker seed per iterator, which must
            # not move the run's RNG (restored on resume before the loader exists)
            generator=torch.Generator().manual_seed(0),
        )
        self._iter = iter(self._loader)

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> dict:
        batch = next(self._iter)
        self.state_.consumed_samples += self._step
        return batch

    def state(self) -> DataState:
        return DataState(self.state_.consumed_samples, self.state_.fingerprint)
