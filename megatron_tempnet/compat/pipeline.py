"""DeepSpeed's pipeline internals: the accessors and the class that touches them.

A ``PipelineModule`` keeps its built pieces in ``forward_funcs`` and the global index of its
first piece in ``_local_start``; the ``PipelineEngine`` maps schedule instructions to methods in
``_INSTRUCTION_MAP`` and runs backward in ``_exec_backward_pass``. The accessors and
``last_stage_backward_engine`` below are the only code that touches them (and the module's
``tied_modules`` and the ``ds_pipe_replicated`` mark it puts on tied copies).
"""

from __future__ import annotations

import functools


def pipeline_pieces(module) -> list:
    """The pieces this pipeline stage built, in order (layers, or functions for tied layers)."""
    return module.forward_funcs


def pipeline_first_index(module) -> int:
    """The global index (in the model's list of layer specs) of this stage's first piece."""
    return module._local_start


def pipeline_tied_modules(module) -> list:
    """The modules this stage shares with another stage (a tied embedding)."""
    return list(module.tied_modules.values())


def is_pipe_replicated(parameter) -> bool:
    """The second pipeline stage's copy of a tied parameter (counted once in a norm)."""
    return getattr(parameter, "ds_pipe_replicated", False)


@functools.cache
def last_stage_backward_engine() -> type:
    """DeepSpeed's ``PipelineEngine`` running backward on the last stage only.

    For a pipeline whose earlier stages are frozen and whose last stage detaches its input:
    every stage runs forward, only the last one runs backward, and no gradient is sent or
    received between stages.
    """
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class LastStageBackwardEngine(PipelineEngine):
        def _exec_last_stage_backward(self, buffer_id):
            if self.is_last_stage():
                super()._exec_backward_pass(buffer_id)

        def _exec_nothing(self, buffer_id):
            pass

        _INSTRUCTION_MAP = {
            **PipelineEngine._INSTRUCTION_MAP,
            schedule.BackwardPass: _exec_last_stage_backward,
            schedule.SendGrad: _exec_nothing,
            schedule.RecvGrad: _exec_nothing,
        }

    return LastStageBackwardEngine
