"""Megatron-LM's (and Megatron-DeepSpeed's) GPT/LLaMA checkpoints, read without either, at any
layout, and written back (``export``).

Megatron-LM's ``--save DIR`` holds ``latest_checkpointed_iteration.txt`` (an iteration, or
``release``) naming ``DIR/iter_XXXXXXX/``, in one of two formats:

- ``torch_dist`` (megatron-core's ``dist_checkpointing``): ``.metadata`` and ``__*.distcp``
  files of ``torch.distributed.checkpoint``, ``common.pt`` (the saved ``args``) and
  ``metadata.json`` (``sharded_backend: torch_dist``). Each tensor is one global tensor under
  megatron-core's ``GPTModel`` names; the transformer layers are stacked on a leading layer
  axis (``decoder.layers.self_attention.linear_qkv.weight``: ``[L, ...]``) and the norms go by
  Transformer Engine's fused names (``...linear_qkv.layer_norm_weight``), whichever layer spec
  trained. Read with DCP's own ``FileSystemReader``, only the part of a stacked tensor a layer
  needs.
- ``torch`` (legacy): ``mp_rank_TT/model_optim_rng.pt`` (``mp_rank_TT_PPP`` with pipeline
  stages), each the ``state_dict`` of one rank's model under ``model``, its layers numbered
  from 0 in every stage, its split tensors cut as megatron-core cuts them (``distributed.
  sharding`` merges them).

Megatron-DeepSpeed's ``--save DIR`` holds DeepSpeed's ``latest`` naming ``DIR/global_stepN/``
with ``mp_rank_TT_model_states.pt`` (the saved ``args``; without pipeline stages, the model) and,
with pipeline stages, one ``layer_II-model_TT-model_states.pt`` per layer, under Megatron's
legacy names (``rank_files``).

Tensors are given under ``GPTStack``'s names (``state_names.lm_names``), full and with the
vocabulary unpadded, so a checkpoint saved at any TP x PP loads at any other. The model comes
from the saved ``args`` (``model_fields``); what ``GPTStack`` does not compute (experts, MLA,
QK-norm, a custom layer spec, ...) is refused by name. Optimizer, RNG and data position are not
read: a Megatron-LM checkpoint is a starting point (its weights), as with ``--finetune``.
"""

from megatron_tempnet.models.gpt.megatron_lm.rank_files import TE_NORMS
from megatron_tempnet.models.gpt.megatron_lm.reader import (
    MegatronLMCheckpoint,
    TrainingWeights,
    check_same_model,
    open_checkpoint,
)
from megatron_tempnet.models.gpt.megatron_lm.saved import (
    TRACKER,
    Located,
    locate,
    model_fields,
    saved_args,
)

__all__ = [
    "TE_NORMS",
    "TRACKER",
    "Located",
    "MegatronLMCheckpoint",
    "TrainingWeights",
    "check_same_model",
    "locate",
    "model_fields",
    "open_checkpoint",
    "saved_args",
]
