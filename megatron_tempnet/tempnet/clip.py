"""TempNet for CLIP (Section 5, docs/design.md §2): a temperature per image or per text.

Input: the stop-gradient normalised embedding ``e [n, d0]`` of one modality.

    v   = sigmoid(W1 e + b1)                      W1: d1 x d0 (transformation)
    u   = W2bar^T v                               W2: d1 x d2, columns = prototypes, normalised
    s   = sum_k (softmax(u / phi)_k - 1/d2) w3_k u_k - b       (parameterised pooling)
    tau = (tau_max - tau0) sigmoid(s) + tau0                    (tau in [0.001, 0.05] by default)

Init (Appendix D.1): W1 and b1 kaiming-uniform, w3 = 1, b = 0, phi = 0.01; the prototypes are the
embeddings of randomly drawn examples of the other modality (``init_prototypes``: the image
TempNet's from texts, the text TempNet's from images), so the prototypes live in the embedding
space and ``d1`` must equal ``d0``. Before ``init_prototypes`` they are kaiming-uniform.
Parameters: ``d1 d0 + d1 + d1 d2 + d2 + 2`` (0.13M for d0 = d1 = d2 = 256, Table 13).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_tempnet.tempnet.layers import (
    ParameterisedPooling,
    bounded_temperature,
    check_tau_range,
)
from megatron_tempnet.utils.precision import f32, keep_float32


class TempNetCLIP(nn.Module):
    """Predicts a temperature for each embedding ``[n, d0] -> [n]``.

    Args:
        embed_dim: d0, the normalised embedding's size.
        hidden_size: d1 (the prototypes' size; equal to d0 for ``init_prototypes``).
        proj_size: d2, the number of prototypes.
        tau_min, tau_max: output range (paper: 0.001, 0.05).
        phi_init: initial pooling temperature (0.01 for CLIP).
    """

    def __init__(
        self,
        embed_dim: int,
        *,
        hidden_size: int = 256,
        proj_size: int = 256,
        tau_min: float = 0.001,
        tau_max: float = 0.05,
        phi_init: float = 0.01,
    ):
        super().__init__()
        check_tau_range(tau_min, tau_max)
        for name, value in (
            ("embed_dim", embed_dim),
            ("hidden_size", hidden_size),
            ("proj_size", proj_size),
        ):
            if value < 1:
                raise ValueError(f"TempNetCLIP {name} ({value}) must be >= 1")
        self.tau_min, self.tau_max = tau_min, tau_max
        self.weight1 = nn.Parameter(torch.empty(hidden_size, embed_dim))
        self.bias1 = nn.Parameter(torch.empty(hidden_size))
        self.prototypes = nn.Parameter(torch.empty(hidden_size, proj_size))  # W2, d1 x d2
        self.pooling = ParameterisedPooling(proj_size, phi_init)
        self.reset_parameters()
        keep_float32(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for weight, fan_in in (
            (self.weight1, self.weight1.shape[1]),
            (self.bias1, self.weight1.shape[1]),
            (self.prototypes, self.prototypes.shape[0]),
        ):
            bound = 1.0 / math.sqrt(fan_in)
            weight.uniform_(-bound, bound)

    @torch.no_grad()
    def init_prototypes(self, other_modality: torch.Tensor) -> None:
        """Prototypes from ``[d2, d0]`` embeddings of the other modality (drawn at random)."""
        d1, d2 = self.prototypes.shape
        if tuple(other_modality.shape) != (d2, d1):
            raise ValueError(
                f"init_prototypes needs {d2} embeddings of size {d1} (d2 x d1), got "
                f"{tuple(other_modality.shape)}: the prototypes live in the embedding space, so "
                "the TempNet hidden size must equal the embedding size"
            )
        self.prototypes.copy_(other_modality.t())

    def forward(self, embeddings: torch.Tensor, tau_max: float | None = None) -> torch.Tensor:
        """``[n, d0]`` normalised embeddings (detached here) -> ``[n]`` tau (float32)."""
        # float32 whatever the towers' dtype (utils.precision)
        e = f32(embeddings.detach())
        v = torch.sigmoid(e @ f32(self.weight1).t() + f32(self.bias1))  # [n, d1]
        w2 = f32(self.prototypes)
        prototypes = w2 / w2.norm(dim=0, keepdim=True).clamp_min(1e-12)
        u = v @ prototypes  # [n, d2], the prototypical logits
        return bounded_temperature(
            self.pooling(u), self.tau_min, self.tau_max if tau_max is None else tau_max
        )
