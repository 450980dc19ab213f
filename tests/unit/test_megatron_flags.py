"""pretrain_gpt.py's command line as a Megatron-LM user meets it: the flags' meanings and
defaults, no silent model changes, every problem at once, no prefix matching."""

from __future__ import annotations

import logging

import pytest

from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
from megatron_tempnet.utils.flag_parser import FlagError
from megatron_tempnet.utils.yaml_cfg import parse_with_yaml

RUN = [
    "--data-path",
    "corpus_text_document",
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    "vocab.json",
    "--merge-file",
    "merges.txt",
    "--train-iters",
    "10",
    "--lr",
    "3e-4",
    "--micro-batch-size",
    "1",
]
SHAPE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
]


def parse(argv: list[str], caplog) -> tuple:
    """(the run's config, its start-up lines) for ``argv``."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_tempnet"):
        config = config_from_args(parse_with_yaml(build_parser(), argv))
    return config, [r.getMessage() for r in caplog.records]


def refusal(argv: list[str]) -> str:
    with pytest.raises(FlagError) as e:
        parse_with_yaml(build_parser(), argv)
    return str(e.value)


def test_without_model_no_preset_fills_anything(caplog):
    """Megatron-LM's defaults and derived values, not the tiny preset's."""
    config, _ = parse(RUN + SHAPE, caplog)
    m, o = config.model, config.optimizer
    assert config.preset is None
    assert (m.num_layers, m.hidden_size, m.ffn_size(), m.seq_length) == (2, 128, 512, 64)
    # Megatron-LM's defaults (megatron/training/arguments.py)
    assert (m.hidden_dropout, m.attention_dropout, m.init_method_std) == (0.1, 0.1, 0.02)
    assert (m.normalization, m.position_embedding_type) == ("LayerNorm", "learned_absolute")
    assert (o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps) == (0.01, 0.9, 0.999, 1e-8)
    assert (o.lr_decay_style, o.lr_warmup_iters, o.min_lr) == ("linear", 0, 0.0)
    assert (config.logging.log_interval, config.training.eval_iters) == (100, 100)
    swiglu, _ = parse(RUN + SHAPE + ["--swiglu"], caplog)
    assert swiglu.model.ffn_size() == int(4 * 128 * 2 / 3 / 64) * 64 == 320


def test_a_shape_flag_missing_without_model_is_named_with_the_others():
    message = refusal(RUN + ["--hidden-size", "128", "--num-attention-heads", "4"])
    assert "--num-layers --max-position-embeddings --seq-length: required without --model" in (
        message
    )


def test_preset_overrides_are_listed_once(caplog):
    argv = RUN + ["--model", "llama2-7b", *SHAPE[:-2]]  # SHAPE but --max-position-embeddings
    config, lines = parse(argv, caplog)
    assert config.model.ffn_hidden_size == 11008  # the preset sets it
    overrides = [line for line in lines if "overrides --model llama2-7b" in line]
    assert overrides == [
        "--hidden-size 128 overrides --model llama2-7b's 4096",
        "--num-attention-heads 4 overrides --model llama2-7b's 32",
        "--num-layers 2 overrides --model llama2-7b's 32",
        "--seq-length 64 overrides --model llama2-7b's 4096",
    ]


def test_rope_is_never_silently_dropped(caplog):
    llama = RUN + SHAPE + ["--swiglu", "--normalization", "rmsnorm", "--disable-bias-linear"]
    config, lines = parse(llama + ["--use-rotary-position-embeddings"], caplog)
    assert config.model.position_embedding_type == "rope"
    assert config.model.normalization == "RMSNorm"
    assert "--use-rotary-position-embeddings: the same." in lines
    config, lines = parse(llama, caplog)  # the RoPE flags deleted: said at start-up
    assert config.model.position_embedding_type == "learned_absolute"
    assert any(line.startswith("learned absolute positions") for line in lines)
    message = refusal(llama + ["--no-position-embedding"])
    assert "--no-position-embedding: allowed with --position-embedding-type rope only" in message


def test_grouped_query_attention_as_megatron_lm_spells_it(caplog):
    config, _ = parse(RUN + SHAPE + ["--group-query-attention"], caplog)
    assert config.model.num_query_groups == 1  # Megatron-LM's default
    config, _ = parse(RUN + SHAPE + ["--group-query-attention", "--num-query-groups", "2"], caplog)
    assert config.model.num_query_groups == 2
    config, lines = parse(RUN + SHAPE + ["--num-key-value-heads", "2"], caplog)
    assert config.model.num_query_groups == 2
    assert "--num-key-value-heads 2: --group-query-attention --num-query-groups N." in lines
    message = refusal(RUN + SHAPE + ["--num-query-groups", "2"])
    assert "--num-query-groups 2 needs --group-query-attention" in message
    assert "--kv-channels 16: heads of another width" in refusal(
        RUN + SHAPE + ["--kv-channels", "16"]
    )
    config, _ = parse(RUN + SHAPE + ["--kv-channels", "32"], caplog)  # 128 / 4: accepted
    assert config.model.hidden_size // config.model.num_attention_heads == 32


def test_no_prefix_matching_and_close_names_suggested(caplog):
    config, lines = parse(RUN + SHAPE + ["--deepspeed"], caplog)
    assert config.parallel.deepspeed_config is None
    assert (
        "--deepspeed: always; DeepSpeed is the engine (and, as in Megatron-DeepSpeed, "
        "--recompute-num-layers defaults to 1)." in lines
    )
    message = refusal(RUN + SHAPE + ["--lr-decay-iter", "5", "--hiden-size", "3"])
    assert "--lr-decay-iter: unknown flag; did you mean --lr-decay-iters" in message
    assert "--hiden-size: unknown flag; did you mean --hidden-size" in message
    assert "2 problems with the command line" in message


def test_spellings_map_to_the_projects_flags(caplog):
    argv = (
        RUN
        + SHAPE
        + [
            "--use-flash-attn",
            "--use-distributed-optimizer",
            "--optimizer",
            "adam",
            "--deepspeed_config",
            "ds.json",
            "--no-masked-softmax-fusion",
            "--use-mcore-models",
            "--data-impl",
            "mmap",
        ]
    )
    config, lines = parse(argv, caplog)
    assert config.model.attention_backend == "auto"
    assert config.parallel.zero_stage == 1
    assert config.parallel.deepspeed_config == "ds.json"
    assert "--attention-backend flash: computed by --attention-backend auto" in lines
    mapped = [
        "--use-flash-attn",
        "--use-distributed-optimizer",
        "--optimizer adam",
        "--no-masked-softmax-fusion",
        "--use-mcore-models",
        "--data-impl mmap",
    ]
    for flag in mapped:
        assert sum(line.startswith(flag + ":") for line in lines) == 1, flag


@pytest.mark.parametrize(
    ("flags", "recompute"),
    [
        # Megatron-DeepSpeed's older spelling: full and uniform, chunks of --checkpoint-num-layers
        (["--checkpoint-activations"], ("full", "uniform", 1)),
        (["--checkpoint-activations", "--checkpoint-num-layers", "2"], ("full", "uniform", 2)),
        # it wins over the other recompute flags, as there; --recompute-num-layers over its own
        (["--checkpoint-activations", "--recompute-activations"], ("full", "uniform", 1)),
        (["--checkpoint-activations", "--recompute-num-layers", "2"], ("full", "uniform", 2)),
        # its LLaMA-2 script: --recompute-num-layers is 1 by default under --deepspeed
        (
            [
                "--deepspeed",
                "--deepspeed-activation-checkpointing",
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
            ],
            ("full", "uniform", 1),
        ),  # fmt: skip
        # DeepSpeed's checkpointing alone recomputes nothing, as in Megatron-DeepSpeed
        (["--deepspeed-activation-checkpointing", "--partition-activations"], (None, None, None)),
        (["--contigious-checkpointing", "--synchronize-each-layer"], (None, None, None)),
        (["--no-pipeline-parallel"], (None, None, None)),
    ],
)
def test_megatron_deepspeeds_recompute_flags(flags, recompute, caplog):
    config, lines = parse(RUN + SHAPE + flags, caplog)
    t = config.training
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == recompute
    for flag in (f for f in flags if f.startswith("--") and f[2:].replace("-", "_") in _MD):
        assert sum(line.startswith(flag) for line in lines) == 1, (flag, lines)


_MD = {
    "checkpoint_activations",
    "checkpoint_num_layers",
    "deepspeed_activation_checkpointing",
    "partition_activations",
    "contigious_checkpointing",
    "synchronize_each_layer",
    "no_pipeline_parallel",
}
"""Megatron-DeepSpeed's activation-checkpointing flags: each says at start-up what it maps to."""


def test_no_pipeline_parallel_with_pipeline_stages_is_refused():
    argv = RUN + SHAPE + ["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"]
    assert "--no-pipeline-parallel: contradicts --pipeline-model-parallel-size 2" in refusal(argv)


def test_decoupled_lr_is_checked_as_a_learning_rate(caplog):
    config, _ = parse(RUN + SHAPE + ["--decoupled-lr", "5e-4"], caplog)
    assert (config.optimizer.decoupled_lr, config.optimizer.decoupled_min_lr) == (5e-4, None)
    from megatron_tempnet.models.gpt.task import validate_gpt
    from megatron_tempnet.trainer.config import ConfigError

    bad = ["--decoupled-lr", "1e-5", "--min-lr", "2e-5", "--lr", "3e-4"]
    with pytest.raises(ConfigError, match=r"--min-lr \(2e-05\) must be in \[0, --decoupled-lr"):
        validate_gpt(parse(RUN + SHAPE + bad, caplog)[0], 1)
    bad = ["--decoupled-lr", "1e-4", "--decoupled-min-lr", "2e-4"]
    with pytest.raises(ConfigError, match=r"--decoupled-min-lr \(0.0002\) must be in"):
        validate_gpt(parse(RUN + SHAPE + bad, caplog)[0], 1)


def test_the_objective_default_is_said_and_use_tempnet_is_tempnets(caplog):
    _, lines = parse(RUN + SHAPE, caplog)
    assert any(line.startswith("objective: the KL-DRO loss") for line in lines)
    _, lines = parse(RUN + SHAPE + ["--loss", "ce"], caplog)
    assert not any(line.startswith("objective:") for line in lines)
    config, _ = parse(RUN + SHAPE + ["--use-tempnet"], caplog)
    assert config.training.freeze_lm
    assert (config.loss.loss, config.loss.tau_source) == ("dro", "tempnet")
    assert "--use-tempnet trains TempNet with the DRO loss" in refusal(
        RUN + SHAPE + ["--use-tempnet", "--loss", "ce"]
    )


def test_help_shows_megatron_lms_defaults():
    text = build_parser().format_help()
    flat = " ".join(text.split())
    assert "--hidden-dropout HIDDEN_DROPOUT Dropout after attention and MLP. (default: 0.1, or" in (
        flat
    )
    assert "4 x --hidden-size; with --swiglu int(8 x --hidden-size / 3 / 64) x 64" in flat


def test_the_flag_table_in_the_docs_is_current():
    """docs/megatron_flags.md is what the code declares (make docs regenerates it)."""
    import os

    from megatron_tempnet.models.gpt.flag_table import markdown

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "megatron_flags.md")
    with open(path) as f:
        assert f.read() == markdown(), "docs/megatron_flags.md is stale: run make docs"


def test_flags_of_megatron_deepspeeds_example_scripts(caplog):
    """The flags Megatron-DeepSpeed's GPT example scripts pass beyond the launch-script test's:
    other spellings map to this project's flags, dense-model MoE flags and logging flags say
    what they do here, and the features that are not built are refused all at once."""
    argv = RUN + SHAPE + [
        "--position-embedding-type", "rope", "--rotary-position-embeddings-theta", "500000",
        "--use-flash-attn-v2", "--override-opt_param-scheduler", "--num-experts", "1",
        "--create-moe-param-group", "--disable-moe-token-dropping", "--checkpoint-in-cpu",
        "--DDP-impl", "local", "--no-async-tensor-model-parallel-allreduce",
        "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--log-timers-to-tensorboard", "--log-optimizer-states-to-tensorboard",
        "--tensorboard-queue-size", "1", "--timing-log-level", "2",
    ]  # fmt: skip
    config, lines = parse(argv, caplog)
    assert config.model.rotary_base == 500000 and config.optimizer.override_opt_param_scheduler
    for flag in ("--use-flash-attn", "--num-experts 1", "--checkpoint-in-cpu", "--DDP-impl local"):
        assert sum(line.startswith(flag) for line in lines) == 1, (flag, lines)
    assert any(line.startswith("--log-timers-to-tensorboard: no effect") for line in lines)
    assert "--num-experts 2 4: mixture of experts is not built" in refusal(
        RUN + SHAPE + ["--num-experts", "2", "4"]
    )
    refused = refusal(
        RUN + SHAPE + ["--cpu-optimizer", "--ds-sequence-parallel-size", "4", "--random-ltd",
                       "--lr-decay-tokens", "100", "--universal-checkpoint",
                       "--activations-checkpoint-method", "uniform"]
    )  # fmt: skip
    for flag, why in [
        ("--cpu-optimizer", "ZeRO-Offload"),
        ("--ds-sequence-parallel-size", "DeepSpeed-Ulysses"),
        ("--random-ltd", "data-efficiency"),
        ("--lr-decay-tokens", "token-based"),
        ("--universal-checkpoint", "universal checkpoints"),
        ("--activations-checkpoint-method", "--recompute-method"),
    ]:
        assert flag in refused and why in refused, (flag, refused)


def test_fp16_loss_scaling_flags_reach_deepspeed_with_megatrons_defaults():
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    from megatron_tempnet.trainer.config import ConfigError, RunConfig, TrainingConfig
    from megatron_tempnet.trainer.engine import fp16_section
    from megatron_tempnet.trainer.validation import validate_run

    dynamic = DeepSpeedFP16Config(enabled=True, **fp16_section(TrainingConfig()))
    assert dynamic.initial_dynamic_scale() == 2**32  # Megatron-LM's --initial-loss-scale
    assert (dynamic.loss_scale, dynamic.loss_scale_window, dynamic.hysteresis) == (0, 1000, 2)
    assert dynamic.min_loss_scale == 1
    static = TrainingConfig(loss_scale=4096.0, hysteresis=3)
    assert DeepSpeedFP16Config(enabled=True, **fp16_section(static)).loss_scale == 4096
    for bad, message in [
        (dict(loss_scale=3000.0), r"--loss-scale \(3000\) must be a positive power of 2"),
        (dict(initial_loss_scale=1e9), r"--initial-loss-scale \(1e\+09\) must be a positive"),
        (dict(min_loss_scale=0.5), r"--min-loss-scale \(0.5\) must be a whole number >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_run(RunConfig(training=TrainingConfig(train_iters=1, **bad)), 1)
