"""DeepSpeed's pipeline internals: the accessors and the class that touches them.

A ``PipelineModule`` keeps its built pieces in ``forward_funcs`` and the global index of its
first piece in ``_local_start``; the ``PipelineEngine`` maps schedule instructions to methods in
``_INSTRUCTION_MAP``, runs backward in ``_exec_backward_pass`` and marks a stage stepped by its
bf16 optimizer ``using_bf16_optimizer``. The accessors and ``last_stage_backward_engine`` below
are the only code that touches them (and the module's ``tied_modules`` and the
``ds_pipe_replicated`` mark it puts on tied copies).
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
    received between stages (a frozen tied weight has none to reduce either).

    An earlier stage trains only its group placeholders (``trainer.pipeline``). DeepSpeed's bf16
    optimizer takes the norm of the gradients it holds and fails on a stage with none, so there
    each backward instruction runs a backward of zero through the placeholders: the stage then
    adds 0 to the norm that all stages reduce, and its step leaves the placeholders at zero.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class LastStageBackwardEngine(PipelineEngine):
        def _exec_last_stage_backward(self, buffer_id):
            if self.is_last_stage():
                super()._exec_backward_pass(buffer_id)
            elif self.using_bf16_optimizer:
                trainable = [p for p in self.module.parameters() if p.requires_grad]
                zero = sum(p.float().sum() for p in trainable) * 0.0
                DeepSpeedEngine.backward(self, zero)  # what the last stage runs on its loss

        def _exec_nothing(self, buffer_id=None):
            pass

        _INSTRUCTION_MAP = {
            **PipelineEngine._INSTRUCTION_MAP,
            schedule.BackwardPass: _exec_last_stage_backward,
            schedule.SendGrad: _exec_nothing,
            schedule.RecvGrad: _exec_nothing,
            schedule.ReduceTiedGrads: _exec_nothing,
        }

    return LastStageBackwardEngine
