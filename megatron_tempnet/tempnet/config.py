"""TempNet's settings in one place: its shape, its temperature range, the robust loss's radius and
how it is optimised. Every field is a ``--tempnet-*`` flag of the training entry points.

The defaults are the paper's for language models (Table 5: d1 = d2 = 256, tau0 = 0.001,
tau_max = 2.0, rho = 10); CLIP's subclass (``models.clip``) sets the CLIP ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tempnet.utils.flags import option


@dataclass
class TempNetConfig:
    hidden_size: int = option(256, name="--tempnet-hidden-size")
    """d1: width of TempNet's transformation layer."""
    proj_size: int = option(256, name="--tempnet-proj-size")
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
    lr: float | None = option(None, name="--tempnet-lr")
    """TempNet's peak learning rate (default: --lr), on the same schedule shape."""
    weight_decay: float | None = option(None, name="--tempnet-weight-decay")
    """TempNet's weight decay (default: --weight-decay)."""

    def resolve(self, lr: float, weight_decay: float) -> None:
        """Fill the defaults that follow the model's optimizer flags."""
        if self.lr is None:
            self.lr = lr
        if self.weight_decay is None:
            self.weight_decay = weight_decay

    def range_problem(self) -> str | None:
        """The message for a temperature range that cannot work, or None."""
        if not 0 < self.tau_min < self.tau_max:
            return (
                f"--tempnet-tau-min ({self.tau_min}) must be > 0 and < --tempnet-tau-max "
                f"({self.tau_max})"
            )
        if self.rho < 0:
            return f"--tempnet-rho ({self.rho}) must be >= 0"
        return None
