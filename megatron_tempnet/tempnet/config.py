"""TempNet's settings in one place: its shape, its temperature range and how it is optimised.
Every field is a flag of the training entry points (``--tempnet-*``, ``--no-tempnet-stop-grad``;
CLIP derives its width and always stops the gradient).

Each family's loss config holds one (``LossConfig.tempnet``, ``CLIPLossConfig.tempnet``), beside
the loss's own settings such as the KL-DRO radius rho, so a run's saved config keeps them in the
``tempnet`` entry of its ``loss`` section (``saved_loss_settings`` reads both layouts). The
defaults are the paper's for language models (Table 5: d1 = d2 = 256, tau0 = 0.001, tau_max =
2.0); CLIP's TempNet config sets the CLIP ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tempnet.utils.flags import option


@dataclass
class TempNetConfig:
    tempnet_hidden_size: int = 256
    """d1: width of TempNet's transformation layer."""
    tempnet_proj_size: int = 256
    """d2: number of TempNet's prototypical logits."""
    tau_min: float = option(0.001, name="--tempnet-tau-min")
    """tau0, the smallest temperature: TempNet's lower bound (and that of --tau-source newton)."""
    tau_max: float = option(2.0, name="--tempnet-tau-max")
    """TempNet's upper bound in training."""
    stop_grad: bool = option(True, name="--no-tempnet-stop-grad")
    """The flag lets tau's gradient flow into the LM through TempNet's input (the paper's
    ablation); by default TempNet reads the detached logits."""
    tempnet_lr: float | None = None
    """TempNet's peak learning rate (default: --lr), on the same schedule shape."""
    tempnet_weight_decay: float | None = None
    """TempNet's weight decay (default: --weight-decay)."""
    tempnet_constant_lr: bool = False
    """Keep TempNet's learning rate at --tempnet-lr from the first iteration to the last (no
    warm-up, no decay), as the paper's own code trains it; default: --lr-decay-style's shape."""

    def resolve_optimizer(self, lr: float, weight_decay: float) -> None:
        """Fill the defaults that follow the model's optimizer flags."""
        if self.tempnet_lr is None:
            self.tempnet_lr = lr
        if self.tempnet_weight_decay is None:
            self.tempnet_weight_decay = weight_decay

    def range_problem(self) -> str | None:
        """The message for a temperature range that cannot work, or None."""
        if not 0 < self.tau_min < self.tau_max:
            return (
                f"--tempnet-tau-min ({self.tau_min}) must be > 0 and < --tempnet-tau-max "
                f"({self.tau_max})"
            )
        return None


def saved_loss_settings(section: dict) -> dict:
    """A saved run config's ``loss`` section as one flat mapping: the loss's settings and
    TempNet's (kept in its ``tempnet`` entry; runs saved by earlier versions have them flat)."""
    flat = {k: v for k, v in section.items() if k != "tempnet"}
    return {**flat, **(section.get("tempnet") or {})}
