"""Process groups, vocabulary partitioning, the launch environment, DeepSpeed's mpu."""

from megatron_tempnet.distributed.groups import TPGroup, resolve_tp_group, vocab_partition

__all__ = ["TPGroup", "resolve_tp_group", "vocab_partition"]
