"""The model-parallel unit ("mpu") DeepSpeed asks for, read from megatron-core's parallel_state.

DeepSpeed uses it to find the data-parallel group (gradient reduction, ZeRO partitioning) and the
model-parallel group (gradient norms, checkpoint file names), and to tell tensor-parallel
parameters (megatron-core marks them ``tensor_model_parallel``) from replicated ones.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state


class MegatronMPU:
    """megatron-core's process groups under the method names DeepSpeed calls."""

    def __init__(self):
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("initialise megatron-core's parallel_state before the engine")
        self._ps = parallel_state

    # model parallel = tensor x pipeline
    def get_model_parallel_group(self):
        return self._ps.get_model_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(group=self.get_model_parallel_group())

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self.get_model_parallel_group())

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_group(self):
        return self._ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._ps.get_pipeline_model_parallel_world_size()
