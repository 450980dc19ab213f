"""Activation recomputation (Megatron-LM's --recompute-granularity/-method/-num-layers).

What a transformer layer keeps for its backward pass can instead be recomputed there:

- ``selective``: the core attention of every layer (megatron-core's ``core_attn``: its
  ``[b, heads/tp, s, s]`` softmax with --attention-backend unfused; the fused kernels keep no
  ``s^2`` tensor anyway). Set on megatron-core's ``TransformerConfig``
  (``models.transformer.transformer_config``), which checkpoints the core attention of
  ``models.attention`` whatever the backend.
- ``full`` + ``uniform``: the layers of a stack on one pipeline stage in consecutive chunks of
  ``num_layers`` (the last one shorter if need be); each chunk keeps only its input and reruns as
  a unit in the backward pass.
- ``full`` + ``block``: the first ``num_layers`` layers of the stack on each pipeline stage keep
  only their input, one layer at a time; the others keep everything.

The layers stay one piece each (seeded by their index, so the weights do not depend on the
setting): a chunk's first ``TransformerPiece`` runs the whole chunk inside megatron-core's
checkpoint (which restores the RNG for the rerun), and the chunk's other pieces pass their input
through while it trains (``TransformerPiece.recompute_with``). ``Recompute.apply`` sets this up
on a stage's built layers, since the chunks depend on what the stage holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recompute:
    """The recomputation flags (validated by ``trainer.validation.validate_run``)."""

    granularity: str | None = None
    """None, ``full`` or ``selective``."""
    method: str | None = None
    """With ``full``: ``uniform`` or ``block``."""
    num_layers: int | None = None
    """With ``full``: layers per chunk (uniform) or recomputed layers per stage (block)."""

    @classmethod
    def from_training(cls, training) -> Recompute:
        """From a validated ``TrainingConfig`` (--recompute-activations is selective there)."""
        return cls(
            training.recompute_granularity,
            training.recompute_method,
            training.recompute_num_layers,
        )

    def describe(self) -> str | None:
        """One start-up phrase for the recomputation, or None when there is none."""
        if self.granularity is None:
            return None
        if self.selective:
            return "selective: the core attention of every layer"
        s = "s" if self.num_layers != 1 else ""
        if self.method == "uniform":
            return f"full, uniform: chunks of {self.num_layers} layer{s}"
        return f"full, block: the first {self.num_layers} layer{s} of each pipeline stage"

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    def units(self, count: int) -> list[int]:
        """For ``count`` consecutive layers of one stack on one stage: ``units[j] > 0`` when a
        unit of that many layers, recomputed together, starts at layer ``j``; 0 for a layer
        inside the unit before it or not recomputed at all."""
        if self.granularity != "full":
            return [0] * count
        k = self.num_layers
        if self.method == "uniform":
            return [min(k, count - j) if j % k == 0 else 0 for j in range(count)]
        return [1 if j < k else 0 for j in range(count)]

    def apply(self, layers: list) -> None:
        """Set up the units on one stage's ``TransformerPiece``s of one stack, in order."""
        for j, size in enumerate(self.units(len(layers))):
            if size:
                layers[j].recompute_with(layers[j + 1 : j + size])
