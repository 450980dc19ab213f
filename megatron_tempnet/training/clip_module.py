"""CLIP's training objective for the engine: the towers, the temperatures, the five losses.

``--clip-loss`` (DESIGN.md §2; both sides, images and texts, as anchors):

- ``clip``: InfoNCE with one learnable global tau (``exp`` of a parameter, clamped below at
  ``--tempnet-tau-min``), trained with the model;
- ``sogclr``: the global contrastive loss with a fixed tau (``--tau-init``) and the
  moving-average estimator ``s``;
- ``isogclr``: the robust global contrastive loss with one tau per sample, kept in the
  per-sample state and updated by projected gradient descent with the estimated
  tau-gradient: ``tau_i <- clip(tau_i - --isogclr-tau-lr * grad_i, tau_min, tau_max)``;
- ``tempnet``: the same robust loss with tau predicted by an image TempNet and a text TempNet
  (``TempNetCLIP``), learned through ``tau_grad * tau`` (their own learning rate);
- ``tau``: TaU, InfoNCE with ``tau = --tau-init / sigmoid(a)`` where ``a`` comes from a linear
  head on the non-detached normalised embedding; ``-a`` is the uncertainty score.

Data parallel: each rank's anchors are scored against the global batch's candidates, gathered
with their gradient; a rank builds only its own ``[b, B]`` rows (``contrastive_parallel``).
The per-anchor values are returned; the step divides their sum by the global number of anchors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megatron_tempnet.losses.contrastive import info_nce, robust_contrastive_side, tempnet_loss
from megatron_tempnet.losses.contrastive_parallel import gather_with_grad, positive_columns
from megatron_tempnet.models.clip import CLIPModel
from megatron_tempnet.tempnet.clip import TempNetCLIP

CLIP_LOSSES = ("clip", "sogclr", "isogclr", "tempnet", "tau")
ROBUST = ("sogclr", "isogclr", "tempnet")


class CLIPLossConfigError(ValueError):
    """Loss flags that do not fit together; names them."""


@dataclass
class CLIPLossConfig:
    clip_loss: str = "tempnet"
    """--clip-loss: clip, sogclr, isogclr, tempnet or tau."""
    tau_init: float = 0.01
    """--tau-init: clip's initial tau, sogclr's fixed tau, isogclr's initial per-sample tau,
    TaU's smallest tau (at sigmoid = 1)."""
    tau_min: float = 0.001
    """--tempnet-tau-min: TempNet's and iSogCLR's lower bound (paper: 0.001)."""
    tau_max: float = 0.05
    """--tempnet-tau-max: TempNet's and iSogCLR's upper bound (paper: 0.05)."""
    rho: float = 8.0
    """--tempnet-rho: the KL-DRO radius (paper's range for CLIP: 7-10)."""
    gamma: float = 0.8
    """--sogclr-gamma: moving-average weight of the estimator s, in (0, 1]."""
    isogclr_tau_lr: float = 0.01
    """--isogclr-tau-lr: step size of iSogCLR's per-sample tau update."""

    @property
    def uses_tempnet(self) -> bool:
        return self.clip_loss == "tempnet"

    @property
    def state_fields(self) -> tuple[str, ...]:
        """The per-sample state this loss keeps (empty: none)."""
        if self.clip_loss not in ROBUST:
            return ()
        fields = ("s_image", "b_image", "s_text", "b_text")
        return fields + (("tau_image", "tau_text") if self.clip_loss == "isogclr" else ())

    def validate(self) -> None:
        if self.clip_loss not in CLIP_LOSSES:
            raise CLIPLossConfigError(
                f"--clip-loss {self.clip_loss!r} is not one of {', '.join(CLIP_LOSSES)}"
            )
        if not 0 < self.tau_min < self.tau_max:
            raise CLIPLossConfigError(
                f"--tempnet-tau-min ({self.tau_min}) must be > 0 and < --tempnet-tau-max "
                f"({self.tau_max})"
            )
        if self.tau_init <= 0:
            raise CLIPLossConfigError(f"--tau-init ({self.tau_init}) must be > 0")
        if self.clip_loss == "isogclr" and not self.tau_min <= self.tau_init <= self.tau_max:
            raise CLIPLossConfigError(
                f"--tau-init ({self.tau_init}) must lie in [--tempnet-tau-min, "
                f"--tempnet-tau-max] = [{self.tau_min}, {self.tau_max}] for --clip-loss isogclr"
            )
        if not 0 < self.gamma <= 1:
            raise CLIPLossConfigError(f"--sogclr-gamma ({self.gamma}) must be in (0, 1]")
        if self.rho < 0:
            raise CLIPLossConfigError(f"--tempnet-rho ({self.rho}) must be >= 0")


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


class TaUHead(nn.Module):
    """TaU's temperature head: ``[n, d]`` normalised embedding (with gradient) -> ``a [n]``."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.linear = nn.Linear(embed_dim, 1)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.linear(embeddings.to(self.linear.weight.dtype))[:, 0].float()


class CLIPTrainModule(nn.Module):
    """The towers and the loss's temperature parts, as one module for the DeepSpeed engine.

    ``forward(images, tokens, lengths, state [b, k], seen [b])`` -> ``CLIPOutput``.
    ``dp_group``: the data-parallel group the candidates are gathered over.
    """

    def __init__(self, clip: CLIPModel, loss: CLIPLossConfig, *, dp_group=None,
                 tempnet_proj_size: int = 256):  # fmt: skip
        super().__init__()
        self.clip, self.loss_config, self.dp_group = clip, loss, dp_group
        d = clip.config.embed_dim
        self.log_tau = nn.Parameter(torch.tensor([math.log(loss.tau_init)])) if (
            loss.clip_loss == "clip") else None  # fmt: skip
        self.tau_heads = nn.ModuleDict({"image": TaUHead(d), "text": TaUHead(d)}) if (
            loss.clip_loss == "tau") else None  # fmt: skip
        self.tempnets = None
        if loss.uses_tempnet:
            kw = dict(hidden_size=d, proj_size=tempnet_proj_size, tau_min=loss.tau_min,
                      tau_max=loss.tau_max)  # fmt: skip
            self.tempnets = nn.ModuleDict(
                {"image": TempNetCLIP(d, **kw), "text": TempNetCLIP(d, **kw)}
            )

    @torch.no_grad()
    def init_prototypes(self, images, tokens, lengths) -> None:
        """TempNet's prototypes from ``d2`` examples: the image TempNet's from their texts, the
        text TempNet's from their images (the paper's initialisation)."""
        if self.tempnets is None:
            return
        self.tempnets["image"].init_prototypes(self.clip.encode_text(tokens, lengths))
        self.tempnets["text"].init_prototypes(self.clip.encode_image(images))

    def forward(self, images, tokens, lengths, state=None, seen=None, encode: bool = False):
        """The training objective (``CLIPOutput``), or with ``encode`` the evaluation outputs
        (``encode``'s dict); either way through the engine, so ZeRO sees every pass."""
        if encode:
            return self.encode(images, tokens, lengths)
        image_f, text_f = self.clip(images, tokens, lengths)
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

    def global_tau(self) -> torch.Tensor:
        """CLIP's learnable tau ``[1]``, clamped below at ``tau_min`` (as OpenCLIP clamps its
        logit scale), not above."""
        return self.log_tau.float().exp().clamp(min=self.loss_config.tau_min)

    @torch.no_grad()
    def encode(self, images=None, tokens=None, lengths=None) -> dict:
        """Normalised embeddings ``[n, d]`` of the given images and/or texts, with the
        temperature each would get (``{side}_tau [n]``, where the loss predicts one from the
        input: clip, tau, tempnet) and TaU's uncertainty score (``{side}_score``)."""
        out = {}
        inputs = {"image": (images,), "text": (tokens, lengths)}
        for side, args in inputs.items():
            if args[0] is None:
                continue
            features = self.clip.image_features(*args) if side == "image" else (
                self.clip.text_features(*args))  # fmt: skip
            e = nn.functional.normalize(features.float(), dim=-1)
            out[side] = e
            cfg = self.loss_config
            if self.tempnets is not None:
                out[f"{side}_tau"] = self.tempnets[side](e).float()
            elif self.tau_heads is not None:
                a = self.tau_heads[side](e)
                out[f"{side}_tau"], out[f"{side}_score"] = cfg.tau_init / torch.sigmoid(a), -a
            elif self.log_tau is not None:
                out[f"{side}_tau"] = self.global_tau().expand(e.shape[0])
        return out

    def _info_nce(self, sims, embeddings, positive) -> CLIPOutput:
        cfg, n = self.loss_config, positive.shape[0]
        losses, taus, scores = [], [], []
        for side in ("image", "text"):
            if self.tau_heads is None:  # clip: one global tau
                tau = self.global_tau().expand(n)
            else:  # TaU: 1 / tau = sigmoid(a) / tau_init
                a = self.tau_heads[side](embeddings[side])
                tau = cfg.tau_init / torch.sigmoid(a)
                scores.append(-a.detach())
            losses.append(info_nce(sims[side], positive, tau))
            taus.append(tau.detach())
        return CLIPOutput(torch.cat(losses), torch.cat(taus), None,
                          torch.cat(scores) if scores else None)  # fmt: skip

    def _robust(self, sims, embeddings, positive, state, seen) -> CLIPOutput:
        cfg = self.loss_config
        column = {name: i for i, name in enumerate(cfg.state_fields)}
        losses, taus, new = [], [], {}
        for side in ("image", "text"):
            if cfg.clip_loss == "tempnet":
                tau = self.tempnets[side](embeddings[side]).float()  # [b], input detached inside
            elif cfg.clip_loss == "isogclr":  # the sample's own tau (tau_init on a first visit)
                tau = state[:, column[f"tau_{side}"]].where(seen, torch.tensor(cfg.tau_init))
            else:
                tau = torch.full_like(sims[side][:, 0], cfg.tau_init)
            out = robust_contrastive_side(
                sims[side], positive, tau, state[:, column[f"s_{side}"]],
                state[:, column[f"b_{side}"]], seen, gamma=cfg.gamma, rho=cfg.rho,
            )  # fmt: skip
            loss = out.loss
            if cfg.clip_loss == "tempnet":
                loss = loss + tempnet_loss(tau, out.tau_grad)
            losses.append(loss)
            taus.append(tau.detach())
            new[f"s_{side}"], new[f"b_{side}"] = out.s, out.b
            if cfg.clip_loss == "isogclr":  # projected gradient step on the sample's tau
                step = tau - cfg.isogclr_tau_lr * out.tau_grad
                new[f"tau_{side}"] = step.clamp(cfg.tau_min, cfg.tau_max)
        state_rows = torch.stack([new[f].detach().float() for f in cfg.state_fields], dim=1)
        return CLIPOutput(torch.cat(losses), torch.cat(taus), state_rows)
