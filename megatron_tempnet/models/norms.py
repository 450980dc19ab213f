"""The layers' norm where megatron-core's local one cannot be used: ``--apply-layernorm-1p`` and
``--sequence-parallel``.

Without apex or Transformer Engine, megatron-core's local spec builds ``WrappedTorchNorm``
(``torch.nn.LayerNorm`` / ``RMSNorm``), which refuses both settings. ``Norm`` computes the same
functions (``torch.nn.functional.layer_norm`` / ``rms_norm``, so its numbers equal the torch
modules') and supports them:

* zero-centred gamma (Megatron-LM's ``--apply-layernorm-1p``, megatron-core's
  ``layernorm_zero_centered_gamma``): the weight starts at 0 and the norm multiplies by
  ``1 + weight``, so that weight decay pulls the scale towards 1 instead of 0. Exports to other
  formats write ``1 + weight`` (``inference.hf_weights``);
* sequence parallelism: the norm runs on this rank's sequence shard ``[s/tp, b, h]``, so its
  weight and bias receive the gradient of those tokens only. They carry megatron-core's mark
  (``param.sequence_parallel = True``), by which ``distributed.sequence_parallel`` sums their
  gradients over the tensor-parallel group.

The parameters have the names and shapes of torch's modules (``weight``; LayerNorm also
``bias``), so checkpoints are the same with either module (with the 1p weights shifted by 1).
"""

from __future__ import annotations

import torch
from torch import nn


class Norm(nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) over the last dimension.

    ``forward``: ``[..., h]`` -> ``[..., h]`` (with sequence parallelism ``[s/tp, b, h]``, this
    rank's shard). The constructor takes megatron-core's norm arguments (``build_module``).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_megatron_kwargs):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {config.normalization!r}: LayerNorm or RMSNorm")
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.shape, self.eps = (hidden_size,), eps
        start = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(start(hidden_size))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(hidden_size))
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)

    def scale(self) -> torch.Tensor:
        """What the normalised values are multiplied by: ``[h]``."""
        return self.weight + 1 if self.zero_centered else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return nn.functional.rms_norm(x, self.shape, self.scale(), self.eps)
        return nn.functional.layer_norm(x, self.shape, self.scale(), self.bias, self.eps)

    def extra_repr(self) -> str:
        kind = "RMSNorm" if self.rms else "LayerNorm"
        return f"{kind}({self.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered})"
