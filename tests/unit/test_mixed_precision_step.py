"""fp16 on a GPU: DeepSpeed's dynamic loss scaling skips a step now and then (an overflow) and
holds loss-scaled gradients until its optimizer unscales them. The step must not stop the run on
a skipped step, nor clip the scaled gradients itself; in float32 and bf16 a NaN still stops it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_tempnet.trainer.step import (
    TrainingError,
    check_finite,
    deepspeed_clips_grad_norm,
    step_max_grad_norm,
)


def _config(zero: int, pp: int = 1, bf16: bool = False, fp16: bool = False):
    return SimpleNamespace(
        training=SimpleNamespace(bf16=bf16, fp16=fp16),
        parallel=SimpleNamespace(zero_stage=zero, pipeline_model_parallel_size=pp),
        optimizer=SimpleNamespace(clip_grad=1.0),
    )


@pytest.mark.parametrize(
    "zero,pp,bf16,fp16,deepspeed_clips",
    [
        (0, 1, False, False, False),  # float32: the step clips the true gradients
        (0, 1, True, False, False),  # bf16 gradients carry no loss scale
        (0, 1, False, True, True),  # fp16: scaled until DeepSpeed's optimizer unscales them
        (0, 2, False, True, True),
        (0, 2, True, False, True),  # a mixed-precision pipeline's float32 gradients
        (1, 1, False, False, True),  # ZeRO holds the partitions
    ],
)
def test_one_owner_clips_the_unscaled_gradients(zero, pp, bf16, fp16, deepspeed_clips):
    config = _config(zero, pp, bf16, fp16)
    assert deepspeed_clips_grad_norm(config) is deepspeed_clips
    assert step_max_grad_norm(config) == (None if deepspeed_clips else 1.0)


def test_an_fp16_overflow_skips_a_step_and_the_run_goes_on():
    nan = float("nan")
    check_finite({"loss": nan}, float("inf"), 7, overflow=True)  # no error: DeepSpeed skipped it
    with pytest.raises(TrainingError, match="iteration 7: the loss is nan"):
        check_finite({"loss": nan}, float("inf"), 7)
    with pytest.raises(TrainingError, match="iteration 7: the gradient norm is inf"):
        check_finite({"loss": 1.0}, float("inf"), 7)
    check_finite({"loss": 1.0}, 2.0, 7)
