"""GPT-2 and LLaMA language models with TempNet: config and presets, layers, pipeline stages, the
objective, the step, the task, its flags, tensor-parallel sharding rules, the memory planner."""

from megatron_tempnet.models.gpt.config import PRESETS, ModelConfig, model_flags
from megatron_tempnet.models.gpt.layers import build_gpt_model, gpt_layer_specs
from megatron_tempnet.models.transformer import ModelConfigError, transformer_config

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ModelConfigError",
    "build_gpt_model",
    "gpt_layer_specs",
    "model_flags",
    "transformer_config",
]
