"""The temperature belongs to the model (OpenCLIP's rule): one module gives every anchor its tau.

By ``--clip-loss``:

- ``clip``: one learnable global tau, ``exp`` of a parameter, clamped below at
  ``--tempnet-tau-min`` (as OpenCLIP clamps its logit scale), not above;
- ``sogclr``: the fixed ``--tau-init``;
- ``isogclr``: the sample's own tau, kept in the per-sample state (``--tau-init`` on a first
  visit) and updated by the objective;
- ``tempnet``: an image ``TempNetCLIP`` and a text ``TempNetCLIP`` on the detached embeddings;
- ``tau``: TaU, ``tau = --tau-init / sigmoid(a)`` with ``a`` from a linear head on the
  (non-detached) embedding; ``-a`` is its uncertainty score.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_tempnet.models.clip.config import CLIPLossConfig
from megatron_tempnet.tempnet.clip import TempNetCLIP
from megatron_tempnet.utils.precision import f32, keep_float32

SIDES = ("image", "text")


class TaUHead(nn.Module):
    """TaU's temperature head: ``[n, d]`` normalised embedding (with gradient) -> ``a [n]``
    (float32: a float32 island, ``utils.precision``)."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.linear = keep_float32(nn.Linear(embed_dim, 1))

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        w, b = f32(self.linear.weight), f32(self.linear.bias)
        return nn.functional.linear(f32(embeddings), w, b)[:, 0]


class CLIPTemperature:
    """The temperature, for a model that mixes it in (``CLIPTrainModule``): its learnable parts
    for ``loss`` (none for sogclr and isogclr) become the model's own parameters (``log_tau``,
    ``tau_heads.*``, ``tempnets.*``), registered after the towers; all of them stay float32
    under --bf16 (``utils.precision``)."""

    def init_temperature(self, loss: CLIPLossConfig, embed_dim: int) -> None:
        """Register the temperature's parameters on this ``nn.Module``."""
        self.loss_config = loss
        self.log_tau = None
        self.tau_heads = None
        self.tempnets = None
        if loss.clip_loss == "clip":
            self.log_tau = keep_float32(nn.Parameter(torch.tensor([math.log(loss.tau_init)])))
        if loss.clip_loss == "tau":
            self.tau_heads = nn.ModuleDict({side: TaUHead(embed_dim) for side in SIDES})
        if loss.uses_tempnet:
            kw = dict(
                hidden_size=embed_dim,  # the prototypes live in the embedding space
                proj_size=loss.tempnet.tempnet_proj_size,
                tau_min=loss.tempnet.tau_min,
                tau_max=loss.tempnet.tau_max,
            )
            self.tempnets = nn.ModuleDict({side: TempNetCLIP(embed_dim, **kw) for side in SIDES})

    def global_tau(self) -> torch.Tensor:
        """CLIP's learnable tau ``[1]``."""
        return self.log_tau.float().exp().clamp(min=self.loss_config.tempnet.tau_min)

    def temperature(
        self, side: str, embeddings: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tau ``[n]`` for ``[n, d]`` normalised embeddings of ``side`` (clip, tau, tempnet), and
        TaU's uncertainty score ``[n]`` (None for the others)."""
        if self.tempnets is not None:  # the input is detached inside
            return self.tempnets[side](embeddings).float(), None
        if self.tau_heads is not None:  # 1 / tau = sigmoid(a) / tau_init
            a = self.tau_heads[side](embeddings)
            return self.loss_config.tau_init / torch.sigmoid(a), -a
        return self.global_tau().expand(embeddings.shape[0]), None

    @torch.no_grad()
    def set_prototypes(self, image: torch.Tensor, text: torch.Tensor) -> None:
        """TempNet's prototypes from ``d2`` examples' normalised embeddings: the image TempNet's
        from their texts, the text TempNet's from their images (the paper's initialisation)."""
        if self.tempnets is not None:
            self.tempnets["image"].init_prototypes(text)
            self.tempnets["text"].init_prototypes(image)
