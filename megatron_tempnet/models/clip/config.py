"""CLIP's configs: the two towers' shapes and ``--model`` presets, the loss, TempNet for CLIP."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_tempnet.models.transformer import (
    ModelConfigError,
    TransformerImpl,
    TransformerShape,
    padded_vocab_size,
    preset_fields,
)
from megatron_tempnet.tempnet.config import TempNetConfig
from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.flags import derived, nested, option

CLIP_PRESETS: dict[str, dict] = {
    # the CPU demo: 16 x 16 grayscale digits, 4 x 4 patches
    "clip-tiny": dict(
        embed_dim=64,
        image_size=16,
        patch_size=4,
        image_channels=1,
        vision_layers=2,
        vision_hidden_size=64,
        vision_heads=4,
        text_layers=2,
        text_hidden_size=64,
        text_heads=4,
        context_length=16,
    ),
    # OpenAI CLIP ViT-B/16's shape
    "vit-b-16": dict(
        embed_dim=512,
        image_size=224,
        patch_size=16,
        image_channels=3,
        vision_layers=12,
        vision_hidden_size=768,
        vision_heads=12,
        text_layers=12,
        text_hidden_size=512,
        text_heads=8,
        context_length=77,
        quick_gelu=True,
    ),
}
"""``--model``: both towers' shapes by name; every other model flag overrides its preset's."""


@dataclass
class CLIPModelConfig(TransformerImpl):
    """Both towers' shapes (Megatron-LM's and OpenCLIP's names) and how their layers compute."""

    embed_dim: int = 64
    """Size of the shared, L2-normalised embedding."""
    image_size: int = 16
    """Square input images of this many pixels per side."""
    patch_size: int = 4
    """ViT patches of this many pixels per side (divides --image-size)."""
    image_channels: int = 3
    """3 (RGB) or 1 (grayscale)."""
    vision_layers: int = 2
    """The ViT's transformer layers."""
    vision_hidden_size: int = 64
    """The ViT's width."""
    vision_heads: int = 4
    """The ViT's attention heads."""
    text_layers: int = 2
    """The text transformer's layers."""
    text_hidden_size: int = 64
    """The text transformer's width."""
    text_heads: int = 4
    """The text transformer's attention heads."""
    context_length: int = 16
    """Caption tokens per sample, the end-of-text token included."""
    vocab_size: int | None = derived()
    """The true vocabulary size (from the tokenizer)."""
    init_method_std: float = 0.02
    """Standard deviation of the initial weights."""
    quick_gelu: bool = False
    """Both towers' MLPs use QuickGELU, x sigmoid(1.702 x) (OpenAI's CLIP models; OpenCLIP's
    -quickgelu models), instead of the exact GELU."""
    make_vocab_size_divisible_by: int = 128
    """Pad the text vocabulary to a multiple of this x the tensor-parallel size."""
    bias_swiglu_fusion: bool = derived(True)
    """No flag: CLIP's MLPs have no SwiGLU (``megatron_flags.CLIP_REFUSED``)."""
    bias_gelu_fusion: bool = derived(True)
    """No flag: CLIP's MLPs have no tanh GELU, the only one that fusion computes."""

    @classmethod
    def from_preset(cls, name: str, **overrides) -> CLIPModelConfig:
        """A preset (``--model``) with the given values (None: the preset's) taking precedence."""
        return cls(**preset_fields(CLIP_PRESETS, name, overrides))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def vision_tower(self) -> TransformerShape:
        return self._tower(self.vision_layers, self.vision_hidden_size, self.vision_heads)

    def text_tower(self) -> TransformerShape:
        return self._tower(self.text_layers, self.text_hidden_size, self.text_heads)

    def _tower(self, layers: int, hidden_size: int, heads: int) -> TransformerShape:
        return TransformerShape(
            num_layers=layers,
            hidden_size=hidden_size,
            num_attention_heads=heads,
            init_method_std=self.init_method_std,
            quick_gelu=self.quick_gelu,
            hidden_dropout=0.0,  # CLIP trains without dropout (OpenCLIP's default)
            attention_dropout=0.0,
            **self.impl(),
        )

    def impl(self) -> dict:
        """The ``TransformerImpl`` fields, for both towers."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(TransformerImpl)}

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        return padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, tensor_parallel_size
        )

    def validate(self, tensor_parallel_size: int = 1) -> None:
        if self.image_size % self.patch_size:
            raise ModelConfigError(
                f"--image-size ({self.image_size}) must be divisible by --patch-size "
                f"({self.patch_size})"
            )
        if self.image_channels not in (1, 3):
            raise ModelConfigError(f"--image-channels ({self.image_channels}) must be 1 or 3")
        if self.context_length < 2:
            raise ModelConfigError(f"--context-length ({self.context_length}) must be >= 2")
        sizes = {
            "--embed-dim": self.embed_dim,
            "--vision-layers": self.vision_layers,
            "--text-layers": self.text_layers,
        }
        for flag, value in sizes.items():
            if value < 1:
                raise ModelConfigError(f"{flag} ({value}) must be >= 1")
        for tower, prefix in ((self.vision_tower(), "--vision"), (self.text_tower(), "--text")):
            try:
                tower.validate(tensor_parallel_size)
            except ModelConfigError as e:  # name the tower's own flags
                message = str(e).replace("--hidden-size", f"{prefix}-hidden-size")
                raise ModelConfigError(
                    message.replace("--num-attention-heads", f"{prefix}-heads")
                ) from None


CLIP_LOSSES = ("clip", "sogclr", "isogclr", "tempnet", "tau")
ROBUST = ("sogclr", "isogclr", "tempnet")


class CLIPLossConfigError(UserError, ValueError):
    """Loss flags that do not fit together; names them."""


@dataclass
class CLIPTempNetConfig(TempNetConfig):
    """TempNet for CLIP (the paper's Table 6)."""

    tempnet_hidden_size: int = derived(256)
    """d1: the model's --embed-dim (the prototypes live in the embedding space)."""
    tempnet_proj_size: int = 256
    """d2: the prototypes, initialised from as many training pairs of the other modality."""
    tau_min: float = option(0.001, name="--tempnet-tau-min")
    """tau0: TempNet's lowest tau."""
    tau_max: float = option(0.05, name="--tempnet-tau-max")
    """TempNet's highest tau."""
    stop_grad: bool = derived(True)
    """CLIP's TempNet always reads the detached embedding."""


@dataclass
class CLIPLossConfig:
    """The contrastive loss and its temperatures (TempNet's settings in ``tempnet``)."""

    clip_loss: str = option("tempnet", choices=CLIP_LOSSES)
    """clip: InfoNCE with one learnable tau; sogclr: the global contrastive loss with a fixed tau;
    isogclr: a learned tau per sample; tempnet: TempNet's tau per image and per text; tau: TaU
    (tau from a head on the embedding)."""
    tau_init: float = 0.01
    """clip's initial tau, sogclr's fixed tau, isogclr's initial per-sample tau, TaU's smallest
    tau (at sigmoid = 1)."""
    gamma: float = option(0.8, name="--sogclr-gamma")
    """Moving-average weight of the per-sample estimator s, in (0, 1]."""
    isogclr_tau_lr: float = 0.03
    """iSogCLR's step eta: ``tau_i <- clamp(tau_i - eta u_i, --isogclr-tau-min,
    --isogclr-tau-max)``."""
    isogclr_tau_beta: float = 0.5
    """iSogCLR's moving-average weight beta of the tau-gradient, in (0, 1]:
    ``u_i <- (1 - beta) u_i + beta clip(g_i)`` (1 with no clipping: plain projected steps)."""
    isogclr_grad_clip: float = 5.0
    """Clip each sample's tau-gradient to [-c, c] before the moving average (0: no clipping)."""
    isogclr_tau_min: float = 0.005
    """The lower bound of iSogCLR's per-sample taus."""
    isogclr_tau_max: float = 0.05
    """The upper bound of iSogCLR's per-sample taus."""
    rho: float = option(8.0, name="--tempnet-rho")
    """The KL-DRO radius of every robust loss (the paper's range for CLIP: 7-10); rho >=
    log(global batch - 1) drives every tau to --tempnet-tau-min."""
    tempnet: CLIPTempNetConfig = nested(CLIPTempNetConfig)
    """TempNet's shape, temperature range and optimizer settings (the TempNet flags)."""

    @property
    def uses_tempnet(self) -> bool:
        return self.clip_loss == "tempnet"

    @property
    def state_fields(self) -> tuple[str, ...]:
        """The per-sample state this loss keeps (empty: none)."""
        if self.clip_loss not in ROBUST:
            return ()
        fields = ("s_image", "b_image", "s_text", "b_text")
        if self.clip_loss == "isogclr":  # each sample's tau and its gradient's moving average
            fields += ("tau_image", "tau_text", "u_image", "u_text")
        return fields

    def validate(self) -> None:
        """Raise ``CLIPLossConfigError`` naming the flags when the loss cannot train."""
        if self.clip_loss not in CLIP_LOSSES:
            raise CLIPLossConfigError(
                f"--clip-loss {self.clip_loss!r} is not one of {', '.join(CLIP_LOSSES)}"
            )
        problem = self.tempnet.range_problem()
        if problem:
            raise CLIPLossConfigError(problem)
        if self.tau_init <= 0:
            raise CLIPLossConfigError(f"--tau-init ({self.tau_init}) must be > 0")
        if self.clip_loss == "isogclr":
            self._validate_isogclr()
        if not 0 < self.gamma <= 1:
            raise CLIPLossConfigError(f"--sogclr-gamma ({self.gamma}) must be in (0, 1]")
        if self.rho < 0:
            raise CLIPLossConfigError(f"--tempnet-rho ({self.rho}) must be >= 0")

    def _validate_isogclr(self) -> None:
        low, high = self.isogclr_tau_min, self.isogclr_tau_max
        if not 0 < low <= high:
            raise CLIPLossConfigError(
                f"--isogclr-tau-min ({low}) and --isogclr-tau-max ({high}) must satisfy "
                "0 < min <= max"
            )
        if not low <= self.tau_init <= high:
            raise CLIPLossConfigError(
                f"--tau-init ({self.tau_init}) must lie in [--isogclr-tau-min, "
                f"--isogclr-tau-max] = [{low}, {high}] for --clip-loss isogclr"
            )
        if not 0 < self.isogclr_tau_beta <= 1:
            raise CLIPLossConfigError(
                f"--isogclr-tau-beta ({self.isogclr_tau_beta}) must be in (0, 1]"
            )
        if self.isogclr_grad_clip < 0 or self.isogclr_tau_lr < 0:
            raise CLIPLossConfigError(
                f"--isogclr-grad-clip ({self.isogclr_grad_clip}) and --isogclr-tau-lr "
                f"({self.isogclr_tau_lr}) must be >= 0"
            )
