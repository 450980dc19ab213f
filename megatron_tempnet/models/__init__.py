"""Language models built from megatron-core layers."""

from megatron_tempnet.models.gpt import (
    PRESETS,
    ModelConfig,
    ModelConfigError,
    transformer_config,
)
from megatron_tempnet.models.gpt_layers import build_gpt_model, gpt_layer_specs

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ModelConfigError",
    "build_gpt_model",
    "gpt_layer_specs",
    "transformer_config",
]
