"""fp16 on a GPU: DeepSpeed's dynamic loss scaling skips a step now and then (an overflow) and
holds loss-scaled gradients until its optimizer unscales them. The step must not stop the run on
a skipped step, nor clip the scaled gradients itself; in float32 and bf16 a NaN still stops it.
Under bf16 DeepSpeed's bf16 optimizer adds each gradient to its float32 sum as it is produced
(``bf16.immediate_grad_update``), also with a --deepspeed-config file's bf16 section; a file that
turns this off is refused when micro-batches are accumulated."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
from megatron_tempnet.trainer.config import ConfigError
from megatron_tempnet.trainer.engine import deepspeed_config
from megatron_tempnet.trainer.step import (
    TrainingError,
    check_finite,
    deepspeed_clips_grad_norm,
    step_max_grad_norm,
)
from megatron_tempnet.trainer.validation import validate_run
from tests.helpers.run_flags import MOCK_RUN


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


def _bf16_section(tmp_path, given: dict | None, *argv: str, global_batch: int = 16) -> dict | None:
    """The DeepSpeed config's bf16 section at DP = 2, micro-batches of 4 (``global_batch`` 16:
    two accumulated), with ``given`` as the --deepspeed-config file."""
    flags = ["--micro-batch-size", "4", "--global-batch-size", str(global_batch), *argv]
    if given is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(given))
        flags += ["--deepspeed-config", str(path)]
    config = config_from_args(build_parser().parse_args([*MOCK_RUN, *flags]))
    validate_run(config, 2)
    ds = deepspeed_config(config, 2)
    assert "bfloat16" not in ds  # DeepSpeed's older name, moved to "bf16"
    return ds.get("bf16")


@pytest.mark.parametrize(
    "given,argv,expected",
    [
        (None, ("--bf16",), {"enabled": True, "immediate_grad_update": True}),
        (  # the file's other entries stay, under DeepSpeed's current name; the flag enables
            {"bfloat16": {"enabled": False, "check_grad_overflow": False}},
            ("--bf16",),
            {"enabled": True, "check_grad_overflow": False, "immediate_grad_update": True},
        ),
        ({"bf16": {"enabled": True}}, (), {"enabled": True, "immediate_grad_update": True}),
        ({"bf16": {"enabled": False}}, (), {"enabled": False}),  # float32: left as it is
        (None, (), None),
    ],
)
def test_bf16_gradients_reach_the_float32_sum_as_they_are_produced(tmp_path, given, argv, expected):
    assert _bf16_section(tmp_path, given, *argv) == expected


def test_a_deepspeed_json_that_delays_the_bf16_gradients_is_refused_with_accumulation(tmp_path):
    delayed = {"bf16": {"immediate_grad_update": False}}
    refused = "immediate_grad_update false counts each of the 2 micro-batches"
    with pytest.raises(ConfigError, match=refused):
        _bf16_section(tmp_path, delayed, "--bf16")
    # one micro-batch per iteration: nothing accumulates, the file's choice stands
    section = _bf16_section(tmp_path, delayed, "--bf16", global_batch=8)
    assert section == {"enabled": True, "immediate_grad_update": False}
