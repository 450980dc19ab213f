"""The KL-DRO loss family (docs/design.md §2): dense reference, vocabulary-parallel versions,
Newton tau, where tau comes from (:mod:`tau_source`), and the contrastive losses for CLIP.

Math on local tensors lives in :mod:`dro_math`; the collectives in :mod:`vocab_parallel`,
:mod:`newton` and :mod:`output_stage` (output layer, TempNet and loss fused, chunk by chunk).
"""

from megatron_tempnet.losses.dense import dro_loss
from megatron_tempnet.losses.newton import optimal_tau
from megatron_tempnet.losses.output_stage import fused_output_stage
from megatron_tempnet.losses.tau_source import FixedTau, NewtonTau, TauSource, TempNetTau
from megatron_tempnet.losses.vocab_parallel import (
    temperature_scaled_cross_entropy,
    vocab_parallel_dro_loss,
)

__all__ = [
    "FixedTau",
    "NewtonTau",
    "TauSource",
    "TempNetTau",
    "dro_loss",
    "fused_output_stage",
    "optimal_tau",
    "temperature_scaled_cross_entropy",
    "vocab_parallel_dro_loss",
]
