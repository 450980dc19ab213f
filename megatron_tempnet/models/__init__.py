"""Language models built from megatron-core layer specs."""

from megatron_tempnet.models.gpt import (
    PRESETS,
    ModelConfig,
    ModelConfigError,
    build_gpt_model,
    transformer_config,
)

__all__ = ["PRESETS", "ModelConfig", "ModelConfigError", "build_gpt_model", "transformer_config"]
