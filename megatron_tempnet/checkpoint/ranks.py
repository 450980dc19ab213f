"""What every rank's part of a checkpoint shares: this run's layout, and the host group's
timeout as an error that names its flag."""

from __future__ import annotations

import contextlib

from megatron.core import parallel_state

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError


def current_layout(engine) -> dict[str, int]:
    return {
        "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel": parallel_state.get_data_parallel_world_size(),
        "zero_stage": engine.zero_optimization_stage(),
    }


def describe_layout(layout: dict[str, int]) -> str:
    return (
        f"TP {layout['tensor_parallel']} x PP {layout['pipeline_parallel']} x DP "
        f"{layout['data_parallel']} (ZeRO {layout['zero_stage']})"
    )


@contextlib.contextmanager
def timeout_named(minutes: float):
    """The host group's timeout (a rank still writing or reading its files while the others
    wait in a collective) as a ``CheckpointError`` that names its flag and value."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CheckpointError) or "Timed out" not in str(e):
            raise
        raise CheckpointError(
            "the ranks waited for each other's checkpoint files longer than "
            f"--checkpoint-timeout-minutes ({minutes:g}): a slow file system needs a larger "
            f"value ({str(e).splitlines()[0]})"
        ) from e
