"""Per-sample state (CLIP's moving averages ``s``, ``b`` and iSogCLR's ``tau``), sharded.

Sample ``i`` of the dataset is owned by data-parallel rank ``i % world``, which keeps its row in
``values [ceil(N / world), k]`` at position ``i // world`` (plus a ``seen`` flag). A training step
exchanges only the global batch's rows:

- ``fetch(local_indices)``: the global batch's indices are all-gathered (``[B]``); each owner
  writes the rows it holds into a zero ``[B, k + 1]`` buffer, one SUM all-reduce completes it, and
  every rank keeps the rows of its own anchors;
- ``store(local_indices, values)``: the new rows are all-gathered and each owner writes its own.

The state lives on the compute device. Rows are selected with ``where``, never by boolean
indexing: the rows another rank owns are read from and written to one scratch row, so no shape
depends on the indices and a step never waits for the device. The indices are checked against
the dataset on the host (the loader's batch).

Memory per rank: ``ceil(N / world) * (4 k + 1)`` bytes (float32 values + a bool). For 400M
image-text pairs with (s, b) per image and per text and iSogCLR's two taus (k = 6): 400M x 25 B
= 10 GB in all, 149 MiB per rank at DP = 64. Communication per step: ``O(B k)``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_tempnet.trainer.step import compute_device
from megatron_tempnet.utils.cli import UserError


class SampleStateError(UserError, ValueError):
    """State that does not fit the dataset or the layout; says which."""


class ShardedSampleState:
    """``k`` float values per dataset sample, sharded over ``group`` (default: the world)."""

    def __init__(
        self,
        num_samples: int,
        fields: tuple[str, ...],
        group=None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ):
        """``device``: where the state lives (default: the compute device)."""
        if num_samples < 1:
            raise SampleStateError(f"per-sample state needs a dataset size >= 1, got {num_samples}")
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.num_samples, self.fields = num_samples, tuple(fields)
        owned = math.ceil(max(num_samples - self.rank, 0) / self.world)
        device = compute_device() if device is None else device
        # one row more: the scratch row that other ranks' samples read and write
        self._values = torch.zeros(owned + 1, len(self.fields), dtype=dtype, device=device)
        self._seen = torch.zeros(owned + 1, dtype=torch.bool, device=device)
        self.values, self.seen = self._values[:owned], self._seen[:owned]
        self._scratch = owned

    @staticmethod
    def bytes_per_rank(num_samples: int, num_fields: int, world: int, itemsize: int = 4) -> int:
        return math.ceil(num_samples / world) * (num_fields * itemsize + 1)

    def check(self, indices: torch.Tensor) -> None:
        """Every index in the dataset (``indices`` on the host: a device tensor would wait)."""
        if indices.numel() == 0:
            return
        low, high = int(indices.min()), int(indices.max())
        bad = low if low < 0 else high if high >= self.num_samples else None
        if bad is not None:
            raise SampleStateError(
                f"sample index {bad} is outside the dataset's {self.num_samples} samples"
            )

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts)

    def _rows(self, everyone: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of the global batch's samples this rank owns (``[B]`` bool), and their rows
        (the scratch row for the others)."""
        mine = everyone % self.world == self.rank
        return mine, torch.where(mine, everyone // self.world, self._scratch)

    def fetch(
        self, indices: torch.Tensor, checked: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's anchors' rows: ``values [b, k]`` and ``seen [b]`` (collective).
        ``checked``: the indices passed ``check`` already (on the host)."""
        if not checked:
            self.check(indices)
        everyone = self._all_gather(indices.to(self._values.device, non_blocking=True))  # [B]
        mine, rows = self._rows(everyone)
        held = torch.cat([self._values[rows].double(), self._seen[rows, None].double()], dim=1)
        buffer = torch.where(mine[:, None], held, 0.0)  # [B, k + 1]
        if self.world > 1:
            dist.all_reduce(buffer, group=self.group)
        start = self.rank * indices.numel()
        local = buffer[start : start + indices.numel()]
        return local[:, :-1].to(self._values.dtype), local[:, -1] > 0.5

    def store(self, indices: torch.Tensor, values: torch.Tensor, checked: bool = False) -> None:
        """Write this rank's anchors' new rows and mark them seen (collective)."""
        if not checked:
            self.check(indices)
        if values.shape != (indices.numel(), len(self.fields)):
            raise SampleStateError(
                f"values {tuple(values.shape)} should be ({indices.numel()}, {len(self.fields)})"
            )
        everyone = self._all_gather(indices.to(self._values.device, non_blocking=True))
        new = self._all_gather(values.detach().to(self._values.device, self._values.dtype))
        _, rows = self._rows(everyone)
        self._values[rows] = new
        self._seen[rows] = True

    def state_dict(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "fields": self.fields,
            "world": self.world,
            "rank": self.rank,
            "values": self.values.clone(),
            "seen": self.seen.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        expected = (self.num_samples, self.fields, self.world, self.rank)
        saved = (state["num_samples"], tuple(state["fields"]), state["world"], state["rank"])
        if saved != expected:
            raise SampleStateError(
                f"per-sample state saved for (samples, fields, DP size, rank) = {saved}, this run "
                f"has {expected}: resume with the same dataset and data-parallel size"
            )
        self.values.copy_(state["values"])
        self.seen.copy_(state["seen"])

    def load_state_dicts(self, states: list[dict]) -> None:
        """This rank's rows from the shards of a run with another data-parallel size (every
        saved rank's ``state_dict``; duplicates of a shard, e.g. from TP ranks, are harmless):
        sample ``i`` = row ``j`` of saved rank ``i % W`` at ``j = i // W``."""
        fields = (self.num_samples, self.fields)
        covered = set()
        for state in states:
            saved = (state["num_samples"], tuple(state["fields"]))
            if saved != fields:
                raise SampleStateError(
                    f"per-sample state saved for (samples, fields) = {saved}, this run has "
                    f"{fields}: resume with the same dataset and --clip-loss"
                )
            world, rank = state["world"], state["rank"]
            samples = torch.arange(rank, self.num_samples, world)  # the saved shard's samples
            if state["values"].shape[0] != samples.numel():
                raise SampleStateError(
                    f"per-sample state: the shard of rank {rank} of {world} has "
                    f"{state['values'].shape[0]} rows, {samples.numel()} expected: the checkpoint "
                    "is damaged"
                )
            mine = samples % self.world == self.rank
            rows = samples[mine] // self.world
            self.values[rows] = state["values"][mine].to(self.values)
            self.seen[rows] = state["seen"][mine].to(self.seen.device)
            covered.add((world, rank))
        world = states[0]["world"]
        if covered != {(world, r) for r in range(world)}:
            raise SampleStateError(
                f"per-sample state: the checkpoint has {len(covered)} shard(s), not those of its "
                f"{world} data-parallel ranks: it is incomplete"
            )
