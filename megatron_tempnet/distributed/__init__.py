"""Process groups, vocabulary partitioning and the CPU runtime for megatron-core."""

from megatron_tempnet.distributed.cpu_support import apply_cpu_support
from megatron_tempnet.distributed.groups import TPGroup, resolve_tp_group, vocab_partition

__all__ = ["TPGroup", "apply_cpu_support", "resolve_tp_group", "vocab_partition"]
