"""CLIP's training objective for the engine: the towers, the temperature, the five losses.

``--clip-loss`` (both sides, images and texts, as anchors; the temperatures are
``temperature.CLIPTemperature``'s):

- ``clip``: InfoNCE with one learnable global tau, trained with the model;
- ``sogclr``: the global contrastive loss with a fixed tau (``--tau-init``) and the
  moving-average estimator ``s``;
- ``isogclr``: the robust global contrastive loss with one tau per sample, kept in the
  per-sample state and updated as the iSogCLR method does: a moving average of the clipped
  estimated tau-gradient, ``u_i <- (1 - beta) u_i + beta clip(g_i, -c, c)``, then a projected
  step ``tau_i <- clamp(tau_i - eta u_i, --isogclr-tau-min, --isogclr-tau-max)`` (beta, c, eta:
  ``--isogclr-tau-beta``, ``--isogclr-grad-clip``, ``--isogclr-tau-lr``; ``u`` starts at 0);
- ``tempnet``: the same robust loss with tau predicted by an image TempNet and a text TempNet,
  learned through ``tau_grad * tau`` (their own learning rate);
- ``tau``: TaU, InfoNCE with tau from a head on the non-detached embedding.

Data parallel: each rank's anchors are scored against the global batch's candidates, gathered
with their gradient; a rank builds only its own ``[b, B]`` rows (``losses.contrastive_parallel``).
The per-anchor values are returned; the step divides their sum by the global number of anchors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_tempnet.losses.contrastive import info_nce, robust_contrastive_side, tempnet_loss
from megatron_tempnet.losses.contrastive_parallel import gather_with_grad, positive_columns
from megatron_tempnet.models.clip.config import ROBUST, CLIPLossConfig
from megatron_tempnet.models.clip.temperature import SIDES, CLIPTemperature


@dataclass
class CLIPOutput:
    """Per-anchor values of one micro-batch on this rank (images first, then texts)."""

    loss: torch.Tensor
    """``[2b]`` model loss (+ TempNet's objective) per anchor, with gradient."""
    tau: torch.Tensor
    """``[2b]`` the temperature each anchor used (detached)."""
    state: torch.Tensor | None
    """``[b, k]`` the anchors' new per-sample state (``CLIPLossConfig.state_fields``)."""
    uncertainty: torch.Tensor | None = None
    """``[2b]`` TaU's uncertainty score ``-a`` (``--clip-loss tau``)."""


def isogclr_tau_update(
    tau: torch.Tensor, tau_grad: torch.Tensor, u: torch.Tensor, cfg: CLIPLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """iSogCLR's update of the anchors' taus ``[b]``: the new taus and gradient averages ``u``.

    With ``--isogclr-tau-beta 1 --isogclr-grad-clip 0`` it is the plain projected step
    ``clamp(tau - eta g)`` exactly (``0 u + 1 g`` is ``g`` in floating point).
    """
    g = tau_grad
    if cfg.isogclr_grad_clip > 0:
        g = g.clamp(-cfg.isogclr_grad_clip, cfg.isogclr_grad_clip)
    beta = cfg.isogclr_tau_beta
    u = (1 - beta) * u.to(g.dtype) + beta * g
    step = tau - cfg.isogclr_tau_lr * u
    return step.clamp(cfg.isogclr_tau_min, cfg.isogclr_tau_max), u


class ContrastiveHead(CLIPTemperature):
    """The loss from the towers' features, for a module that mixes it in (``CLIPTrainModule``,
    the pipeline's last piece): the temperature (``CLIPTemperature``) and ``dp_group``, the
    data-parallel group the candidates are gathered over."""

    dp_group = None

    def contrastive(self, image_f, text_f, state=None, seen=None) -> CLIPOutput:
        """``[b, d]`` features (not normalised) of this rank's pairs -> ``CLIPOutput``."""
        image = nn.functional.normalize(image_f.float(), dim=-1)  # [b, d]
        text = nn.functional.normalize(text_f.float(), dim=-1)
        image_all = gather_with_grad(image, self.dp_group)  # [B, d]
        text_all = gather_with_grad(text, self.dp_group)
        positive = positive_columns(image.shape[0], self.dp_group, device=image.device)
        sims = {"image": image @ text_all.t(), "text": text @ image_all.t()}  # [b, B] each
        embeddings = {"image": image, "text": text}
        if self.loss_config.clip_loss in ROBUST:
            return self._robust(sims, embeddings, positive, state, seen)
        return self._info_nce(sims, embeddings, positive)

    @torch.no_grad()
    def encoded(self, features: dict[str, torch.Tensor]) -> dict:
        """``{side: [n, d] features}`` (either or both sides) -> the normalised embeddings, with
        the temperature each would get (``{side}_tau [n]``, where the loss predicts one from
        the input: clip, tau, tempnet) and TaU's uncertainty score (``{side}_score``)."""
        out = {}
        learned = self.loss_config.clip_loss in ("clip", "tau", "tempnet")
        for side, f in features.items():
            e = nn.functional.normalize(f.float(), dim=-1)
            out[side] = e
            if learned:
                out[f"{side}_tau"], score = self.temperature(side, e)
                if score is not None:
                    out[f"{side}_score"] = score
        return out

    def _info_nce(self, sims, embeddings, positive) -> CLIPOutput:
        losses, taus, scores = [], [], []
        for side in SIDES:
            tau, score = self.temperature(side, embeddings[side])
            if score is not None:
                scores.append(score.detach())
            losses.append(info_nce(sims[side], positive, tau))
            taus.append(tau.detach())
        uncertainty = torch.cat(scores) if scores else None
        return CLIPOutput(torch.cat(losses), torch.cat(taus), None, uncertainty)

    def _tau(self, side: str, embedding, state, seen, column) -> torch.Tensor:
        """The robust losses' tau ``[b]`` for one side."""
        cfg = self.loss_config
        if cfg.clip_loss == "tempnet":
            return self.temperature(side, embedding)[0]
        if cfg.clip_loss == "isogclr":  # the sample's own tau (tau_init on a first visit)
            return state[:, column[f"tau_{side}"]].where(seen, cfg.tau_init)
        return torch.full_like(embedding[:, 0], cfg.tau_init)

    def _robust(self, sims, embeddings, positive, state, seen) -> CLIPOutput:
        cfg = self.loss_config
        column = {name: i for i, name in enumerate(cfg.state_fields)}
        losses, taus, new = [], [], {}
        for side in SIDES:
            tau = self._tau(side, embeddings[side], state, seen, column)
            out = robust_contrastive_side(
                sims[side],
                positive,
                tau,
                state[:, column[f"s_{side}"]],
                state[:, column[f"b_{side}"]],
                seen,
                gamma=cfg.gamma,
                rho=cfg.rho,
            )
            loss = out.loss
            if cfg.clip_loss == "tempnet":
                loss = loss + tempnet_loss(tau, out.tau_grad)
            losses.append(loss)
            taus.append(tau.detach())
            new[f"s_{side}"], new[f"b_{side}"] = out.s, out.b
            if cfg.clip_loss == "isogclr":
                u = state[:, column[f"u_{side}"]].where(seen, 0.0)
                new[f"tau_{side}"], new[f"u_{side}"] = isogclr_tau_update(tau, out.tau_grad, u, cfg)
        state_rows = torch.stack([new[f].detach().float() for f in cfg.state_fields], dim=1)
        return CLIPOutput(torch.cat(losses), torch.cat(taus), state_rows)


class CLIPTrainModule(ContrastiveHead, nn.Module):
    """The towers and the temperature (the model's own parameters, ``CLIPTemperature``), as one
    module for the DeepSpeed engine.

    ``forward(images, tokens, lengths, state [b, k], seen [b])`` -> ``CLIPOutput``.
    ``dp_group``: the data-parallel group the candidates are gathered over.
    """

    def __init__(self, clip: nn.Module, loss: CLIPLossConfig, *, dp_group=None):
        nn.Module.__init__(self)
        self.clip, self.dp_group = clip, dp_group
        self.init_temperature(loss, clip.config.embed_dim)

    @torch.no_grad()
    def init_prototypes(self, images, tokens, lengths) -> None:
        """TempNet's prototypes from ``d2`` examples of the other modality."""
        if self.tempnets is None:
            return
        text = self.clip.encode_text(tokens, lengths)
        self.set_prototypes(self.clip.encode_image(images), text)

    def forward(self, images, tokens, lengths, state=None, seen=None, encode: bool = False):
        """The training objective (``CLIPOutput``), or with ``encode`` the evaluation outputs
        (``encode``'s dict); either way through the engine, so ZeRO sees every pass."""
        if encode:
            return self.encode(images, tokens, lengths)
        image_f, text_f = self.clip(images, tokens, lengths)
        return self.contrastive(image_f, text_f, state, seen)

    @torch.no_grad()
    def encode(self, images=None, tokens=None, lengths=None) -> dict:
        """``ContrastiveHead.encoded`` of the given images and/or texts."""
        features = {}
        if images is not None:
            features["image"] = self.clip.image_features(images)
        if tokens is not None:
            features["text"] = self.clip.text_features(tokens, lengths)
        return self.encoded(features)
