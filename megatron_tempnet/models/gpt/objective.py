"""The GPT objective: which loss, where tau comes from, and the module the engine trains.

``--loss``: ``ce`` (cross-entropy, tau unused), ``dro`` (the KL-DRO loss of eq. 2, the paper's
objective) or ``ts-ce`` (cross-entropy of L / tau, the paper's ablation).
``--tau-source``: ``fixed`` (one constant), ``tempnet`` (TempNet's per-token prediction, learned
through the loss), ``newton`` (the per-token minimiser of f over tau, Baseline 2; no gradient).

One contract: the losses return per-token values, and the training step applies the loss mask and
divides once by the number of unmasked tokens in the global batch (``masked_mean``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_tempnet.losses import (
    fused_output_stage,
    temperature_scaled_cross_entropy,
    vocab_parallel_dro_loss,
)
from megatron_tempnet.losses.tau_source import FixedTau, NewtonTau, TauSource, TempNetTau
from megatron_tempnet.models.gpt.layers import FinalHidden
from megatron_tempnet.tempnet import TempNetLM
from megatron_tempnet.tempnet.config import TempNetConfig
from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.flags import nested, option

LOSSES = ("ce", "dro", "ts-ce")
TAU_SOURCES = ("fixed", "tempnet", "newton")


class LossConfigError(UserError, ValueError):
    """Loss or TempNet flags that do not fit together; names the flags."""


@dataclass
class LossConfig:
    """What the run optimises: the loss, where tau comes from, and TempNet's settings
    (``tempnet``)."""

    loss: str = option("dro", choices=LOSSES)
    """The per-token loss: the KL-DRO loss of eq. 2 (dro), cross-entropy (ce), or cross-entropy
    of L / tau (ts-ce, the paper's ablation)."""
    tau_source: str = option("tempnet", choices=TAU_SOURCES)
    """Where tau comes from: TempNet's prediction learned through the loss (tempnet), one value
    (fixed: --fixed-tau), or each token's optimal tau by Newton's method (newton, Baseline 2)."""
    fixed_tau: float = 1.0
    """tau for --tau-source fixed."""
    rho: float = option(10.0, name="--tempnet-rho")
    """rho of eq. 2, the KL-DRO radius (the loss's and --tau-source newton's); it must stay
    below log|C| for tau to have an interior optimum (the paper's 10 suits 32k-50k
    vocabularies)."""
    tempnet_dropout: float = 0.0
    """Dropout on TempNet's hidden layer in training (the paper's own code uses 0.5)."""
    fused_output_stage: bool = option(True, name="--no-fused-output-stage")
    """The flag turns off the fused output stage (output layer, TempNet and loss computed chunk
    by chunk from the final hidden states, never holding the [tokens, V/tp] logits) and
    computes the whole logits first, as megatron-core's output layer does."""
    output_stage_chunk_size: int = 0
    """Tokens per chunk of the fused output stage; 0: as many as keep one chunk's logits under
    32M values per rank (128 MiB in float32)."""
    tempnet: TempNetConfig = nested(TempNetConfig)
    """TempNet's shape, temperature range and optimizer settings (the TempNet flags)."""

    @property
    def uses_tempnet(self) -> bool:
        return self.tau_source == "tempnet"

    def tau(self, tempnet: torch.nn.Module | None = None, params=None) -> TauSource:
        """--tau-source as the losses take it (``losses.tau_source``): ``tempnet`` (and the
        stand-ins ``params`` for its parameters) for ``tempnet``."""
        if self.tau_source == "tempnet":
            return TempNetTau(tempnet, params)
        if self.tau_source == "newton":
            return NewtonTau(self.rho, self.tempnet.tau_min)
        return FixedTau(self.fixed_tau)

    def validate(self) -> None:
        """Raise ``LossConfigError`` naming the flags when the objective cannot train."""
        if self.loss not in LOSSES:
            raise LossConfigError(f"--loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.tau_source not in TAU_SOURCES:
            raise LossConfigError(
                f"--tau-source {self.tau_source!r} is not one of {', '.join(TAU_SOURCES)}"
            )
        problem = self.tempnet.range_problem()
        if problem:
            raise LossConfigError(problem)
        if self.rho < 0:
            raise LossConfigError(f"--tempnet-rho ({self.rho}) must be >= 0")
        if not 0.0 <= self.tempnet_dropout < 1.0:
            raise LossConfigError(f"--tempnet-dropout ({self.tempnet_dropout}) must be in [0, 1)")
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
        if not self.tempnet.stop_grad and self.tau_source != "tempnet":
            raise LossConfigError("--no-tempnet-stop-grad needs --tau-source tempnet")
        if self.output_stage_chunk_size < 0:
            raise LossConfigError(
                f"--output-stage-chunk-size ({self.output_stage_chunk_size}) must be >= 1 token, "
                "or 0 for the default"
            )


@dataclass
class TokenLosses:
    """Per-token values, all ``[b, s]``; only ``loss`` carries gradients."""

    loss: torch.Tensor
    ce: torch.Tensor
    tau: torch.Tensor
    ts_ce: torch.Tensor | None = None  # cross-entropy of L / tau (T-LLM), in eval mode only


def token_losses_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    config: LossConfig,
    *,
    vocab_size: int,
    tempnet: torch.nn.Module | None = None,
    tau: torch.Tensor | None = None,
    tp_group=None,
) -> TokenLosses:
    """Per-token training loss, cross-entropy and tau from vocabulary-parallel logits (the path
    of ``--no-fused-output-stage``).

    Args:
        logits: ``[b, s, V_pad/tp]`` this rank's slice of the output layer (never gathered).
        labels: ``[b, s]`` target ids.
        config: the loss and where tau comes from.
        vocab_size: the true vocabulary |C|; padded columns are excluded from every sum.
        tempnet: the ``TempNetLM`` for ``--tau-source tempnet``.
        tau: ``[b, s]`` TempNet's prediction, when it ran already (pipeline's last stage).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
    Returns:
        ``TokenLosses``, each ``[b, s]``; ``ts_ce`` in evaluation (no gradients) only.
    """
    common = {"vocab_size": vocab_size, "tp_group": tp_group}
    if tau is None:  # TempNet's input is detached unless --no-tempnet-stop-grad
        tau = config.tau(tempnet).tau_of(logits, **common)  # [b, s]
    if config.loss != "ce":
        # reported, not trained on: one more read of the logits, no graph; before the loss, so
        # that its transient [T, V/tp] buffer is freed before the loss keeps its own
        with torch.no_grad():
            ce = temperature_scaled_cross_entropy(logits.detach(), labels, 1.0, **common)
    if config.loss == "dro":
        loss = vocab_parallel_dro_loss(logits, labels, tau, rho=config.rho, **common)
    elif config.loss == "ts-ce":
        loss = temperature_scaled_cross_entropy(logits, labels, tau, **common)
    else:
        loss = temperature_scaled_cross_entropy(logits, labels, 1.0, **common)
        ce = loss.detach()
    ts_ce = None
    if not torch.is_grad_enabled():  # evaluation: the T-LLM perplexity's per-token term
        ts_ce = (
            loss
            if config.loss == "ts-ce"
            else temperature_scaled_cross_entropy(logits, labels, tau, **common)
        )
    return TokenLosses(loss=loss, ce=ce, tau=tau.detach(), ts_ce=ts_ce)


def token_losses_fused(
    final: FinalHidden,
    labels: torch.Tensor,
    config: LossConfig,
    *,
    vocab_size: int,
    tempnet: torch.nn.Module | None = None,
    tp_group=None,
    loss_mask: torch.Tensor | None = None,
) -> TokenLosses:
    """Per-token training loss, cross-entropy and tau from the final hidden states, through the
    fused output stage (``fused_output_stage``): the logits are never formed. The same values
    and gradients as ``token_losses_from_logits`` on the output layer's logits.

    Args:
        final: the LM's ``FinalHidden``: hidden states ``[s, b, h]`` (sequence parallel:
            ``[s/tp, b, h]``, this rank's shard) and the output weight ``[V_pad/tp, h]``.
        labels: ``[b, s]`` target ids.
        config: the loss, where tau comes from and the chunk size.
        vocab_size: the true vocabulary |C|; padded columns are excluded from every sum.
        tempnet: the ``TempNetLM`` for ``--tau-source tempnet``; None: ``final.tempnet``
            (pipeline's last stage).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        loss_mask: ``[b, s]`` 0/1, when the loss is trained on as ``masked_mean`` (the step's
            contract): the backward pass then waits for nothing (``fused_output_stage``'s
            ``upstream_mask``).
    Returns:
        ``TokenLosses``, each ``[b, s]``; ``ts_ce`` in evaluation (no gradients) only.
    """
    tempnet = tempnet if tempnet is not None else final.tempnet
    out = fused_output_stage(
        final.hidden,  # [s, b, h] or [s/tp, b, h]: the labels are transposed instead
        final.weight,
        labels.t(),
        loss=config.loss,
        vocab_size=vocab_size,
        rho=config.rho,
        tp_group=tp_group,
        chunk_size=config.output_stage_chunk_size or None,
        eval_terms=not torch.is_grad_enabled(),
        sequence_parallel=final.sequence_parallel,
        upstream_mask=None if loss_mask is None else loss_mask.t(),
        tau=config.tau(tempnet, final.tempnet_params),
    )
    ts_ce = out.ts_ce.t() if out.ts_ce is not None else None
    return TokenLosses(loss=out.loss.t(), ce=out.ce.t(), tau=out.tau.t(), ts_ce=ts_ce)


def masked_mean(values: torch.Tensor, loss_mask: torch.Tensor, num_tokens: torch.Tensor | float):
    """``sum(values * mask) / num_tokens``: the normalisation by the global token count.

    ``num_tokens`` is the number of unmasked tokens in the whole global batch (all micro-batches
    and data-parallel ranks), so gradients summed over them equal the global-batch mean.
    """
    total = (values.float() * loss_mask.float()).sum()
    if isinstance(num_tokens, torch.Tensor):  # a count on the device: divide in float32 too
        num_tokens = num_tokens.to(total.dtype)
    return total / num_tokens


class OutputStage(torch.nn.Module):
    """The fused output stage of the one-process model, as a module without parameters.

    It reads the output layer's weight and TempNet's parameters, which stay the LM's and
    TempNet's (in checkpoints and optimizer groups). Being a module lets ZeRO-3 gather them around
    its forward and backward passes: ``zero3_parameters`` are registered with it.
    """

    def __init__(
        self,
        weight,
        tempnet,
        loss: LossConfig,
        vocab_size: int,
        tp_group=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        # tuples: neither is a submodule here (no second name in the state dict)
        self._weight, self._tempnet = (weight,), (tempnet,)
        self.loss_config, self.vocab_size, self.tp_group = loss, vocab_size, tp_group
        self.sequence_parallel = sequence_parallel

    def zero3_parameters(self) -> list[torch.nn.Parameter]:
        tempnet = self._tempnet[0]
        return [self._weight[0]] + (list(tempnet.parameters()) if tempnet is not None else [])

    def forward(
        self, hidden: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``[s, b, h]`` final hidden states (sequence parallel: ``[s/tp, b, h]``), ``[b, s]``
        labels (and the loss mask the step trains with) -> ``(loss, ce, tau[, ts_ce])``
        (tensors: ZeRO-3 finds its backward hooks' anchors in them)."""
        final = FinalHidden(hidden, self._weight[0], sequence_parallel=self.sequence_parallel)
        out = token_losses_fused(
            final,
            labels,
            self.loss_config,
            vocab_size=self.vocab_size,
            tempnet=self._tempnet[0],
            tp_group=self.tp_group,
            loss_mask=loss_mask,
        )
        return (out.loss, out.ce, out.tau) + ((out.ts_ce,) if out.ts_ce is not None else ())


class TrainModule(torch.nn.Module):
    """The LM and (when tau comes from it) TempNet, as one module for the engine.

    Its forward is the whole objective, so that every pass goes through the DeepSpeed engine
    (ZeRO's per-micro-batch bookkeeping happens in the engine's forward). With the fused output
    stage the LM stops at its final hidden states and ``output_stage`` does the rest.
    """

    def __init__(
        self,
        lm: torch.nn.Module,
        tempnet: TempNetLM | None,
        loss: LossConfig,
        vocab_size: int,
        freeze_lm: bool,
        tp_group=None,
    ):
        super().__init__()
        self.lm = lm
        self.tempnet = tempnet
        self.loss_config, self.vocab_size = loss, vocab_size
        self.freeze_lm, self.tp_group = freeze_lm, tp_group
        self.output_stage = None
        self.hidden_cache = None
        """``FrozenHiddenCache`` (--frozen-lm-cache): the frozen LM's hidden states, stored."""
        if loss.fused_output_stage:
            self.output_stage = OutputStage(
                lm.output_weight, tempnet, loss, vocab_size, tp_group, lm.sequence_parallel
            )

    def forward(self, tokens, position_ids, labels, loss_mask=None) -> TokenLosses:
        """``[b, s]`` token ids, positions and labels -> per-token loss, CE and tau.
        ``loss_mask`` (``[b, s]``): the mask the step's ``masked_mean`` applies, which spares the
        fused output stage's backward pass its waits for the device."""
        with torch.no_grad() if self.freeze_lm else contextlib.nullcontext():
            if self.hidden_cache is not None:
                hidden = self.hidden_cache.hidden(  # [s(/tp), b, h]
                    tokens, position_ids, lambda: self.lm.final_hidden(tokens, position_ids).hidden
                )
            elif self.output_stage is not None:
                hidden = self.lm.final_hidden(tokens, position_ids).hidden  # [s(/tp), b, h]
            else:
                logits = self.lm(tokens, position_ids)  # [b, s, V_pad/tp]
        if self.output_stage is not None:
            return TokenLosses(*self.output_stage(hidden, labels, loss_mask))
        return token_losses_from_logits(
            logits,
            labels,
            self.loss_config,
            vocab_size=self.vocab_size,
            tempnet=self.tempnet,
            tp_group=self.tp_group,
        )
