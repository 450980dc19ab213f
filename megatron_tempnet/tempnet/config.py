"""TempNet's settings in one place: its shape, its temperature range, the robust loss's radius and
how it is optimised. Every field is a flag of the training entry points (``--tempnet-*``,
``--no-tempnet-stop-grad``; CLIP derives its width and always stops the gradient).

Each family's loss config extends it (``models.gpt.objective.LossConfig``,
``models.clip.config.CLIPLossConfig``), so a run's saved config keeps them in its ``loss``
section. The defaults are the paper's for language models (Table 5: d1 = d2 = 256, tau0 = 0.001,
tau_max = 2.0, rho = 10); CLIP's loss config sets the CLIP ones.
"""

from __future__ import annotations

import dataclasses
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
    rho: float = option(10.0, name="--tempnet-rho")
    """rho of eq. 2, the KL-DRO radius; it must stay below log|C| for tau to have an interior
    optimum (the paper's 10 suits 32k-50k vocabularies)."""
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

    def rho_problem(self) -> str | None:
        """The message for a radius that cannot work, or None."""
        return f"--tempnet-rho ({self.rho}) must be >= 0" if self.rho < 0 else None


TEMPNET_FIELDS = tuple(f.name for f in dataclasses.fields(TempNetConfig))
"""The fields a loss config inherits from ``TempNetConfig`` (its flags form the TempNet group)."""
