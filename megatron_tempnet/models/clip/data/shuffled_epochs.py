"""Training positions over repeated, shuffled epochs of an image-text dataset.

Position ``p`` of training (``p = iteration * global_batch + slot``) reads from epoch
``e = p // per_epoch`` the pair ``perm_e[p % per_epoch]``, where ``perm_e`` is a permutation of
the pairs seeded by ``(seed, e)`` and ``per_epoch`` is the dataset size cut down to a whole
number of global batches. Each epoch drops its last ``len % global_batch`` permuted pairs (a
different few each epoch), so a global batch never holds a pair twice: the contrastive losses
treat the other pairs of the batch as negatives, and the per-sample state is updated once per
pair and step.

The epoch also seeds the augmentation: a position is read with ``dataset.get(index, epoch)``,
so a pair gets a new random crop every epoch, the same one on every data-parallel layout.
"""

from __future__ import annotations

import hashlib

import torch

from megatron_tempnet.models.clip.data.image_text import ImageTextDataError, ImageTextDataset


class EpochShuffledDataset:
    """Positions ``0..num_positions-1`` over repeated epochs of ``dataset``.

    Epoch ``e`` is a permutation of the dataset's indices seeded by ``(seed, e)`` (the identity
    with ``shuffle=False``), cut to a whole number of global batches (drop-last per epoch) so
    that no global batch holds a sample twice. ``self[p]`` is
    ``dataset.get(index_at(p), epoch_of_position(p))``: the sample dict of ``ImageTextDataset``.

    Args:
        dataset: needs ``len``, ``get(index, epoch)`` and ``unique_description_hash``.
        global_batch_size: ``--global-batch-size``.
        num_positions: samples to serve, e.g. ``--train-iters * --global-batch-size``.
        seed: ``--seed``.
        shuffle: False reads each epoch in index order (tests, debugging).
    """

    def __init__(
        self,
        dataset: ImageTextDataset,
        *,
        global_batch_size: int,
        num_positions: int,
        seed: int,
        shuffle: bool = True,
    ):
        if global_batch_size < 1 or num_positions < 0:
            raise ImageTextDataError(
                f"--global-batch-size ({global_batch_size}) must be >= 1 and the number of "
                f"training samples ({num_positions}) >= 0"
            )
        if len(dataset) < global_batch_size:
            raise ImageTextDataError(
                f"--train-data has {len(dataset)} pairs, fewer than one global batch "
                f"(--global-batch-size {global_batch_size}): add data or lower the batch"
            )
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.global_batch_size, self.num_positions = global_batch_size, num_positions
        self.per_epoch = len(dataset) // global_batch_size * global_batch_size
        self._epoch, self._perm = -1, torch.arange(0)
        key = (dataset.unique_description_hash, global_batch_size, seed, shuffle)
        self.unique_description_hash = hashlib.sha256(repr(key).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return self.num_positions

    def epoch_of_position(self, position: int) -> int:
        """The epoch that training position ``position`` falls in."""
        return position // self.per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """``[len(dataset)]`` int64: epoch ``epoch``'s order (only the first ``per_epoch``
        entries are read)."""
        if epoch != self._epoch:  # cached: a DataLoader reads positions in order
            n = len(self.dataset)
            # seed * 100003 + epoch: distinct for every epoch a run reaches
            gen = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            self._perm = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
            self._epoch = epoch
        return self._perm

    def index_at(self, position: int) -> int:
        """The dataset index read at training position ``position``."""
        if not 0 <= position < self.num_positions:
            raise IndexError(f"position {position} of {self.num_positions} training samples")
        epoch = self.epoch_of_position(position)
        return int(self.permutation(epoch)[position % self.per_epoch])

    def __getitem__(self, position: int) -> dict:
        return self.dataset.get(self.index_at(position), self.epoch_of_position(position))
