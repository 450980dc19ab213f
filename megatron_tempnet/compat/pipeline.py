"""DeepSpeed's pipeline internals: the accessors and the two classes that touch them.

A ``PipelineModule`` keeps its built pieces in ``forward_funcs``, the global index of its first
piece in ``_local_start`` and its process grid in ``_grid``, and reads its layer files in
``load_state_dir``; the ``PipelineEngine`` maps schedule instructions to methods in
``_INSTRUCTION_MAP`` and runs backward in ``_exec_backward_pass``. The accessors,
``pipeline_module_base`` and ``last_stage_backward_engine`` below are the only code that touches
them (and the module's ``tied_modules``, ``ckpt_layer_path_list`` and the ``ds_pipe_replicated``
mark it puts on tied copies).
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


def pipeline_layer_files(module, checkpoint: str, local_index: int) -> list[str]:
    """The layer files of this stage's piece ``local_index`` in a checkpoint directory."""
    return module.ckpt_layer_path_list(checkpoint, local_index)


def is_pipe_replicated(parameter) -> bool:
    """The second pipeline stage's copy of a tied parameter (counted once in a norm)."""
    return getattr(parameter, "ds_pipe_replicated", False)


def is_stage_writer(module) -> bool:
    """This rank is the first of its stage's data- and tensor-parallel replicas."""
    grid = module._grid
    return grid.data_parallel_id == 0 and grid.get_slice_parallel_rank() == 0


@functools.cache
def pipeline_module_base() -> type:
    """DeepSpeed's ``PipelineModule`` whose load can leave the stage's last piece out.

    Subclasses answer ``skip_last_piece_on_load(load_dir)``; when it is True, the stage loads
    every piece but the last (which keeps what it holds) from ``load_dir``; the other pieces keep
    their indices, so their files match.
    """
    from deepspeed.runtime.pipe.module import PipelineModule

    class PipelineModuleWithOptionalLastPiece(PipelineModule):
        def skip_last_piece_on_load(self, load_dir: str) -> bool:
            return False

        def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
            if not self.skip_last_piece_on_load(load_dir):
                return super().load_state_dir(load_dir, checkpoint_engine, strict)
            pieces = self.forward_funcs
            self.forward_funcs = pieces[:-1]
            try:
                return super().load_state_dir(load_dir, checkpoint_engine, strict)
            finally:
                self.forward_funcs = pieces

    return PipelineModuleWithOptionalLastPiece


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
