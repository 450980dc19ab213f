"""Temperature networks (Section 5 of the TempNet paper)."""

from megatron_tempnet.tempnet.config import TempNetConfig
from megatron_tempnet.tempnet.layers import ParameterisedPooling, bounded_temperature
from megatron_tempnet.tempnet.llm import TempNetLM

__all__ = ["ParameterisedPooling", "TempNetConfig", "TempNetLM", "bounded_temperature"]
