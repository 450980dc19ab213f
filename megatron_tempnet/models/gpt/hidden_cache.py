"""The frozen LM's final hidden states, computed once and read back (``--frozen-lm-cache DIR``).

In setting (iii) the LM never changes, so the output layer's input for a sample (its tokens and
positions) is the same at every pass. The first pass over a sample computes it and stores this
rank's part (``[s, h]``, or ``[s/tp, h]`` with sequence parallelism) in
``DIR/tpRR-of-NN/KK/KEY.pt``; later passes over the same sample, in this run or another one on
the same data (a rho sweep, another loss, a resumed run), read it and run only the output stage
with TempNet. Later epochs of one run find few: GPTDataset shuffles each epoch's documents before
cutting them into samples, so an epoch's samples are other windows of the text. A
micro-batch is read when every one of its samples is stored, else computed whole (the stored
values are then the ones this batch produced), so a run over the same batches gives the same
losses cached or not.

Each rank's folder records what its hidden states depend on: a hash of this rank's LM weights
(taken at the first micro-batch, after the checkpoint was loaded), the model's settings, the
dtype and the tensor-parallel layout. A folder written for anything else is refused by name.
Size: ``h x bytes(dtype) / (tp if sequence parallel else 1)`` per token per rank; DP ranks of one
TP rank share a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import torch

from megatron_tempnet.trainer.errors import ConfigError
from megatron_tempnet.utils.files import write_atomic

FLAG = "--frozen-lm-cache"


class FrozenHiddenCache:
    """This rank's store of the frozen LM's final hidden states, keyed by sample content."""

    def __init__(
        self, directory: str, lm: torch.nn.Module, settings: dict, tp_rank: int, tp_size: int
    ):
        self.directory, self.lm = directory, lm
        self.folder = os.path.join(directory, f"tp{tp_rank:02d}-of-{tp_size:02d}")
        self.settings = settings
        self.checked = False
        self.read = self.computed = 0
        """Samples read from the store, and computed (and stored), by this rank."""

    def hidden(
        self, tokens: torch.Tensor, position_ids: torch.Tensor, compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """``[b, s]`` tokens and positions -> the final hidden states ``[s(/tp), b, h]``: read
        when every sample is stored, else ``compute()`` and store the missing ones."""
        if not self.checked:
            self._check()
        # the file names come from the samples' contents: the host needs them (one copy of the
        # micro-batch's ids per step, instead of the LM's forward pass)
        rows = torch.cat([tokens, position_ids.expand_as(tokens)], dim=1).cpu()
        paths = [self._path(row) for row in rows]
        missing = [i for i, path in enumerate(paths) if not os.path.isfile(path)]
        device = tokens.device
        if not missing:
            self.read += len(paths)
            parts = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
            return torch.stack(parts, dim=1).to(device)
        hidden = compute()
        for i in missing:
            os.makedirs(os.path.dirname(paths[i]), exist_ok=True)
            tmp = f"{paths[i]}.{os.getpid()}.tmp"
            torch.save(hidden[:, i].detach().to("cpu", copy=True), tmp)
            os.replace(tmp, paths[i])
        self.computed += len(missing)
        self.read += len(paths) - len(missing)
        return hidden

    def _path(self, row: torch.Tensor) -> str:
        key = hashlib.blake2b(row.numpy().tobytes(), digest_size=20).hexdigest()
        return os.path.join(self.folder, key[:2], f"{key}.pt")

    def _check(self) -> None:
        """Record what the stored states depend on, or refuse a folder written for another LM."""
        digest = hashlib.blake2b(digest_size=20)
        for name, param in sorted(self.lm.state_dict().items()):
            if not isinstance(param, torch.Tensor):
                continue
            value = param.detach().to("cpu").contiguous()
            digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
        record = {"weights": digest.hexdigest(), **self.settings}
        path = os.path.join(self.folder, "cache.json")
        if os.path.isfile(path):
            with open(path) as f:
                stored = json.load(f)
            if stored != record:
                differ = sorted(k for k in {*stored, *record} if stored.get(k) != record.get(k))
                raise ConfigError(
                    f"{FLAG} {self.directory}: it holds the hidden states of another frozen LM "
                    f"({', '.join(differ)} differ from this run's): give a new directory or "
                    "empty this one"
                )
        else:
            os.makedirs(self.folder, exist_ok=True)
            write_atomic(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
        self.checked = True
