"""Rank 0 serves a client (lm-eval, HTTP requests); the other tensor-parallel ranks follow.

Every model operation is collective: each rank runs its shard. The client lives on rank 0 only,
which broadcasts each operation and its inputs (``Service.call``) before running it; the other
ranks wait in ``Service.follow`` and run what they receive until rank 0 says ``stop``. Inputs are
checked on rank 0 before they are broadcast, so a bad request never reaches the followers.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_tempnet.inference.evaluation import score_sequences
from megatron_tempnet.inference.generation import generate
from megatron_tempnet.inference.model import InferenceModel
from megatron_tempnet.utils.cli import UserError

STOP = "stop"


def world() -> tuple[int, int]:
    """(rank, number of processes) of this inference job."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def share(value=None):
    """Rank 0's ``value`` on every rank (the others pass nothing)."""
    rank, size = world()
    if size == 1:
        return value
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Service:
    """The model's collective operations, driven from rank 0.

    ``generate``: ``generation.generate``'s arguments, plus ``tau_max_eval`` for this call
    (None: the model's own). ``score``: ``evaluation.score_sequences``'s arguments.
    """

    def __init__(self, model: InferenceModel):
        self.model = model
        self.rank, self.size = world()

    def call(self, op: str, **inputs):
        """Run ``op`` on every rank (rank 0 only) and return rank 0's result."""
        assert self.rank == 0, "only rank 0 drives the service"
        share((op, inputs))
        return self._run(op, inputs)

    def follow(self) -> None:
        """Run rank 0's operations until it stops (ranks other than 0)."""
        while True:
            op, inputs = share()
            if op == STOP:
                return
            try:
                self._run(op, inputs)
            except UserError:  # rank 0 met the same error and reports it
                pass

    def stop(self) -> None:
        """Release the followers (rank 0; nothing to do in a one-process job)."""
        if self.rank == 0 and self.size > 1:
            share((STOP, {}))

    def _run(self, op: str, inputs: dict):
        if op == "generate":
            return self._generate(**inputs)
        if op == "score":
            return score_sequences(self.model, **inputs)
        raise ValueError(f"unknown operation {op!r}")

    def _generate(self, tau_max_eval: float | None = None, **inputs):
        tempnet = self.model.tempnet
        if tempnet is None or tau_max_eval is None:
            return generate(self.model, **inputs)
        saved, tempnet.tau_max_eval = tempnet.tau_max_eval, tau_max_eval
        try:
            return generate(self.model, **inputs)
        finally:
            tempnet.tau_max_eval = saved
