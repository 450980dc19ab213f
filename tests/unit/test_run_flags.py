"""Megatron-LM's communication, precision, profiling, logging and checkpoint flags as the run
config and the DeepSpeed config dict see them: --overlap-grad-reduce / --overlap-param-gather at
each ZeRO stage, float32 gradients under --bf16 (--grad-reduce-in-bf16 opts out), the flag
checks, and the FLOP count of --log-throughput against Megatron-LM's formula."""

from __future__ import annotations

import json
import types

import pytest

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
from megatron_tempnet.models.gpt.config import PRESETS, ModelConfig
from megatron_tempnet.models.gpt.flops import flops_per_token
from megatron_tempnet.trainer import communication
from megatron_tempnet.trainer.config import ConfigError
from megatron_tempnet.trainer.engine import deepspeed_config
from megatron_tempnet.trainer.profiling import RunHooks, tflops_per_gpu
from megatron_tempnet.trainer.validation import validate_run
from tests.helpers.run_flags import MOCK_RUN


def _config(*argv: str, world_size: int = 2):
    config = config_from_args(build_parser().parse_args([*MOCK_RUN, *argv]))
    validate_run(config, world_size)
    return config


def _zero(config, world_size: int = 2) -> dict:
    return deepspeed_config(config, world_size)["zero_optimization"]


@pytest.mark.parametrize(
    "argv,world,zero,grads,params",
    [
        ((), 2, {"stage": 0, "overlap_comm": False}, "no effect at ZeRO 0", "no effect at ZeRO 0"),
        (
            ("--zero-stage", "2", "--overlap-grad-reduce"),
            2,
            {"stage": 2, "overlap_comm": True},
            "DeepSpeed zero_optimization.overlap_comm on (ZeRO 2)",
            "no effect at ZeRO 2",
        ),
        (
            ("--zero-stage", "1", "--overlap-grad-reduce", "--overlap-param-gather"),
            2,
            {"stage": 1, "overlap_comm": True},
            "overlap_comm on (ZeRO 1)",
            "no effect at ZeRO 1",
        ),
        (
            ("--zero-stage", "3"),
            2,
            {"stage": 3, "overlap_comm": False, "stage3_prefetch_bucket_size": 0},
            "overlap_comm off (ZeRO 3)",
            "ZeRO-3 parameter prefetch, stage3_prefetch_bucket_size 0",
        ),
        (
            ("--zero-stage", "3", "--overlap-grad-reduce", "--overlap-param-gather"),
            2,
            {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": 50_000_000},
            "overlap_comm on (ZeRO 3)",
            "stage3_prefetch_bucket_size 50000000",
        ),
        (
            ("--zero-stage", "1", "--pipeline-model-parallel-size", "2", "--overlap-grad-reduce"),
            4,
            {"stage": 1, "overlap_comm": True},
            "no effect with pipeline parallelism",
            "ZeRO 1",
        ),
    ],
)
def test_overlap_flags_at_each_zero_stage(argv, world, zero, grads, params):
    config = _config(*argv, world_size=world)
    ds = deepspeed_config(config, world)
    assert ds["zero_optimization"] == zero
    said = communication.describe(config, ds)
    assert grads in said["--overlap-grad-reduce"] and params in said["--overlap-param-gather"]


def test_a_deepspeed_json_keeps_its_overlaps_unless_a_flag_is_given(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"zero_optimization": {"overlap_comm": True, "prefetch_bucket_size": 1000}})
    )
    config = _config("--zero-stage", "3", "--deepspeed-config", str(path))
    assert _zero(config) == {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": 1000}
    path.write_text(json.dumps({"zero_optimization": {"stage3_prefetch_bucket_size": 0}}))
    config = _config(
        "--zero-stage",
        "3",
        "--deepspeed-config",
        str(path),
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    )
    assert _zero(config)["stage3_prefetch_bucket_size"] == communication.DEEPSPEED_PREFETCH


@pytest.mark.parametrize(
    "argv,stage,dtype",
    [
        (("--bf16",), 1, "fp32"),  # float32 needs DeepSpeed's bf16 optimizer: ZeRO 1
        (("--bf16", "--zero-stage", "2"), 2, "fp32"),
        (("--bf16", "--grad-reduce-in-bf16"), 0, "bf16"),
        (("--bf16", "--grad-reduce-in-bf16", "--zero-stage", "3"), 3, "bf16"),
        (("--grad-reduce-in-bf16",), 0, None),  # float32 training: no effect
    ],
)
def test_gradients_are_accumulated_and_reduced_in_float32_under_bf16(argv, stage, dtype):
    config = _config(*argv)
    ds = deepspeed_config(config, 2)
    assert config.parallel.zero_stage == ds["zero_optimization"]["stage"] == stage
    if dtype is None:
        assert "data_types" not in ds and "communication_data_type" not in ds
        assert communication.describe(config, ds)["--grad-reduce-in-bf16"].startswith("no effect")
        return
    assert ds["data_types"] == {"grad_accum_dtype": dtype}
    assert ds["communication_data_type"] == dtype
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}
    name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    said = communication.describe(config, ds)["--grad-reduce-in-bf16"]
    assert said.startswith(f"gradients accumulated and reduced in {name}")


def test_a_deepspeed_json_keeps_its_other_data_types(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"data_types": {"grad_accum_dtype": "bf16", "param_dtype": "x"}}))
    ds = deepspeed_config(_config("--bf16", "--deepspeed-config", str(path)), 2)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32", "param_dtype": "x"}


@pytest.mark.parametrize(
    "argv,message",
    [
        (("--overlap-param-gather",), "--overlap-param-gather needs --overlap-grad-reduce"),
        (
            ("--overlap-param-gather", "--overlap-grad-reduce"),
            "it needs a sharded optimizer (--zero-stage 1, 2 or 3, or --use-distributed-optimizer)",
        ),
        (("--distributed-timeout-minutes", "0"), "--distributed-timeout-minutes (0) must be >= 1"),
        (("--manual-gc", "--manual-gc-interval", "-1"), "--manual-gc-interval (-1) must be >= 0"),
        (("--use-pytorch-profiler",), "--use-pytorch-profiler chooses the profiler of --profile"),
        (
            ("--profile", "--profile-step-start", "4", "--profile-step-end", "4"),
            "--profile-step-start (4) must be >= 0 and < --profile-step-end (4)",
        ),
        (
            ("--profile", "--profile-ranks", "0", "5"),
            "--profile-ranks 0 5: rank(s) [5] are not among the 2 ranks of this run",
        ),
        (
            ("--profile", "--use-pytorch-profiler"),
            "--use-pytorch-profiler writes its trace to --tensorboard-dir: give --tensorboard-dir",
        ),
        (("--use-checkpoint-args",), "--use-checkpoint-args is about the checkpoint in --load"),
        (("--no-load-rng",), "--no-load-rng is about the checkpoint in --load: give --load"),
        (("--exit-on-missing-checkpoint",), "--exit-on-missing-checkpoint is about the checkpoint"),
    ],
)
def test_wrong_combinations_name_the_flags(argv, message):
    with pytest.raises(ConfigError) as e:
        _config(*argv)
    assert message in str(e.value)


def test_exit_on_missing_checkpoint_stops_before_anything_is_built(tmp_path):
    with pytest.raises(CheckpointError) as e:
        _config("--load", str(tmp_path), "--exit-on-missing-checkpoint")
    assert str(e.value) == (
        f"--load {tmp_path}: no checkpoint there (no 'latest'), and --exit-on-missing-checkpoint "
        "stops the run instead of starting from scratch"
    )
    (tmp_path / "latest").write_text("iter_0000004")
    assert _config("--load", str(tmp_path), "--exit-on-missing-checkpoint").checkpoint.load


def test_megatron_defaults():
    config = _config()
    p, t, log = config.parallel, config.training, config.logging
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.distributed_timeout_minutes) == (
        False,
        False,
        10,
    )
    assert (t.grad_reduce_in_bf16, t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) == (
        False,
        False,
        0,
        True,
    )
    assert (log.profile, log.use_pytorch_profiler, log.profile_step_start) == (False, False, 10)
    assert (log.profile_step_end, log.profile_ranks, log.log_throughput) == (12, [0], False)
    ckpt = config.checkpoint
    assert not (ckpt.no_load_rng or ckpt.exit_on_missing_checkpoint or ckpt.use_checkpoint_args)
    assert config.tokenizer.vocab_size == 100 and config.data.mock_data


def _megatron_flops(args, batch_size: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for a dense GPT, written out from its
    terms: 3 passes x 2 FLOPs per multiply-add; QKV, the causal core attention (half the
    positions, QK^T and PV), the output projection, the MLP (3 matrices with SwiGLU, 2 without)
    and the logits over the padded vocabulary."""
    fwd_bwd, fma = 3, 2
    query = args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * args.num_query_groups
    attention = (
        fwd_bwd
        * fma
        * (
            args.hidden_size * (query + 2 * kv)
            + query * args.seq_length / 2 * 2
            + query * args.hidden_size
        )
    )
    mlp = fwd_bwd * fma * args.hidden_size * args.ffn_hidden_size * (3 if args.swiglu else 2)
    logits = fwd_bwd * fma * args.hidden_size * args.padded_vocab_size
    return batch_size * args.seq_length * (args.num_layers * (mlp + attention) + logits)


@pytest.mark.parametrize("preset,tp", [("gpt2-125m", 1), ("llama3-8b", 2), ("llama2-70b", 8)])
def test_the_flop_count_is_megatron_lms(preset, tp):
    model = ModelConfig.from_preset(preset, vocab_size=PRESETS[preset].get("vocab_size", 50257))
    args = types.SimpleNamespace(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        kv_channels=model.hidden_size // model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        swiglu=model.swiglu,
        seq_length=model.seq_length,
        padded_vocab_size=model.padded_vocab_size(tp),
    )
    reference = _megatron_flops(args, batch_size=3)
    assert 3 * model.seq_length * flops_per_token(model, None, tp) == pytest.approx(reference)
    # TempNet's W1 (d1 x the true vocabulary) and W2 (d2 x d1), 6 FLOPs per weight
    with_tempnet = flops_per_token(model, (256, 128), tp) - flops_per_token(model, None, tp)
    assert with_tempnet == 6 * (256 * model.vocab_size + 128 * 256)
    # --freeze-lm: the LM forward only
    frozen = flops_per_token(model, None, tp, frozen_lm=True)
    assert frozen == pytest.approx(flops_per_token(model, None, tp) / 3)


def test_throughput_per_gpu():
    # 1e12 FLOPs per sample, 48 samples in 2 s on 8 GPUs: 3 TFLOP/s per GPU
    assert tflops_per_gpu(1e12, 48, 2.0, 8) == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="--log-throughput: this model has no FLOP count"):
        RunHooks(_config("--log-throughput"), None, 2, 0)
