"""The training objective: which loss, where tau comes from, masking and normalisation.

``--loss``: ``ce`` (cross-entropy, tau unused), ``dro`` (the KL-DRO loss of eq. 2, the paper's
objective) or ``ts-ce`` (cross-entropy of L / tau, the paper's ablation).
``--tau-source``: ``fixed`` (one constant), ``tempnet`` (TempNet's per-token prediction, learned
through the loss), ``newton`` (the per-token minimiser of f over tau, Baseline 2; no gradient).

One contract (STYLE.md rule 5): the losses return per-token values, and the training step applies
the loss mask and divides once by the number of unmasked tokens in the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tempnet.losses import (
    optimal_tau,
    temperature_scaled_cross_entropy,
    vocab_parallel_dro_loss,
)

LOSSES = ("ce", "dro", "ts-ce")
TAU_SOURCES = ("fixed", "tempnet", "newton")


class LossConfigError(ValueError):
    """Loss or TempNet flags that do not fit together; names the flags."""


@dataclass
class LossConfig:
    """The objective and TempNet's hyper-parameters (paper's Table 5 defaults)."""

    loss: str = "dro"
    """--loss: ce, dro or ts-ce."""
    tau_source: str = "tempnet"
    """--tau-source: fixed, tempnet or newton."""
    fixed_tau: float = 1.0
    """--fixed-tau: tau for --tau-source fixed."""
    rho: float = 10.0
    """--tempnet-rho: the KL-DRO radius (paper: 10 for LLMs)."""
    tau_min: float = 0.001
    """--tempnet-tau-min: tau0, TempNet's lower bound and Newton's (paper: 0.001)."""
    tau_max: float = 2.0
    """--tempnet-tau-max: TempNet's upper bound (paper: 2.0)."""
    stop_grad: bool = True
    """Off with --no-tempnet-stop-grad: tau's gradient also flows into the LM (ablation)."""

    def validate(self) -> None:
        if self.loss not in LOSSES:
            raise LossConfigError(f"--loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.tau_source not in TAU_SOURCES:
            raise LossConfigError(
                f"--tau-source {self.tau_source!r} is not one of {', '.join(TAU_SOURCES)}"
            )
        if not 0 < self.tau_min < self.tau_max:
            raise LossConfigError(
                f"--tempnet-tau-min ({self.tau_min}) must be > 0 and < --tempnet-tau-max "
                f"({self.tau_max})"
            )
        if self.rho < 0:
            raise LossConfigError(f"--tempnet-rho ({self.rho}) must be >= 0")
        if self.tau_source == "fixed" and not self.fixed_tau > 0:
            raise LossConfigError(f"--fixed-tau ({self.fixed_tau}) must be > 0")
        if self.tau_source == "newton" and self.rho == 0:
            raise LossConfigError(
                "--tau-source newton needs --tempnet-rho > 0 (f decreases in tau)"
            )
        if self.loss == "ce" and self.tau_source == "tempnet":
            raise LossConfigError(
                "--loss ce does not use tau, so TempNet would get no gradient: use --loss dro or "
                "ts-ce with --tau-source tempnet, or --tau-source fixed/newton to only report tau"
            )
        if not self.stop_grad and self.tau_source != "tempnet":
            raise LossConfigError("--no-tempnet-stop-grad needs --tau-source tempnet")

    @property
    def uses_tempnet(self) -> bool:
        return self.tau_source == "tempnet"


@dataclass
class TokenLosses:
    """Per-token values, all ``[b, s]``; only ``loss`` carries gradients."""

    loss: torch.Tensor
    ce: torch.Tensor
    tau: torch.Tensor
    ts_ce: torch.Tensor | None = None  # cross-entropy of L / tau (T-LLM), in eval mode only


def token_losses(
    logits: torch.Tensor,
    labels: torch.Tensor,
    config: LossConfig,
    *,
    vocab_size: int,
    tempnet: torch.nn.Module | None = None,
    tau: torch.Tensor | None = None,
    tp_group=None,
) -> TokenLosses:
    """Per-token training loss, cross-entropy and tau from vocabulary-parallel logits.

    Args:
        logits: ``[b, s, V_pad/tp]`` this rank's slice of the output layer (never gathered).
        labels: ``[b, s]`` target ids.
        vocab_size: the true vocabulary |C|; padded columns are excluded from every sum.
        tempnet: the ``TempNetLM`` for ``--tau-source tempnet``.
        tau: ``[b, s]`` TempNet's prediction, when it ran already (pipeline's last stage).
    """
    if config.tau_source == "tempnet":
        if tau is None:
            tau = tempnet(logits)  # [b, s]; detached input unless --no-tempnet-stop-grad
    elif config.tau_source == "newton":
        with torch.no_grad():
            tau = optimal_tau(
                logits.detach(), rho=config.rho, tau_min=config.tau_min,
                vocab_size=vocab_size, tp_group=tp_group,
            )  # fmt: skip
    else:
        tau = torch.full(labels.shape, config.fixed_tau, dtype=torch.float32, device=labels.device)
    common = {"vocab_size": vocab_size, "tp_group": tp_group}
    if config.loss == "dro":
        loss = vocab_parallel_dro_loss(logits, labels, tau, rho=config.rho, **common)
    elif config.loss == "ts-ce":
        loss = temperature_scaled_cross_entropy(logits, labels, tau, **common)
    else:
        loss = temperature_scaled_cross_entropy(logits, labels, 1.0, **common)
    if config.loss == "ce":
        ce = loss.detach()
    else:  # reported, not trained on: one more read of the logits, no graph
        with torch.no_grad():
            ce = temperature_scaled_cross_entropy(logits.detach(), labels, 1.0, **common)
    ts_ce = None
    if not torch.is_grad_enabled():  # evaluation: the T-LLM perplexity's per-token term
        ts_ce = (
            loss
            if config.loss == "ts-ce"
            else temperature_scaled_cross_entropy(logits, labels, tau, **common)
        )
    return TokenLosses(loss=loss, ce=ce, tau=tau.detach(), ts_ce=ts_ce)


def masked_mean(values: torch.Tensor, loss_mask: torch.Tensor, num_tokens: torch.Tensor | float):
    """``sum(values * mask) / num_tokens``: the normalisation by the global token count.

    ``num_tokens`` is the number of unmasked tokens in the whole global batch (all micro-batches
    and data-parallel ranks), so gradients summed over them equal the global-batch mean.
    """
    return (values.float() * loss_mask.float()).sum() / num_tokens
