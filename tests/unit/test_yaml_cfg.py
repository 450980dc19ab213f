"""--yaml-cfg: flag values from a file, checked like the flags; a run's resolved config written
back as a file that rebuilds it (the end-to-end round trip is in tests/e2e/test_pretrain.py)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_tempnet.models.clip.arguments import build_clip_parser, clip_config_from_args
from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
from megatron_tempnet.trainer.config import ConfigError
from megatron_tempnet.trainer.validation import validate_run
from megatron_tempnet.utils.yaml_cfg import YamlConfigError, config_yaml, parse_with_yaml

GPT = ["--tokenizer-type", "GPT2BPETokenizer", "--train-iters", "7"]
CLIP = ["--train-data", "t", "--tokenizer-type", "GPT2BPETokenizer", "--train-iters", "7"]


def _gpt(tmp_path, text: str, *argv: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    data = [] if "data_path" in text else ["--data-path", "d"]
    data += [] if "model:" in text else ["--model", "tiny"]
    argv = [*GPT, *data, "--yaml-cfg", str(path), *argv]
    return config_from_args(parse_with_yaml(build_parser(), argv))


def test_values_switches_lists_and_the_command_line_winning(tmp_path):
    text = """
model: llama2-7b
num-layers: 3          # dashes or underscores
hidden_size: 96
disable_bias_linear: false   # a switch given as false: the bias stays
no_tempnet_stop_grad: true
lr: 3e-4               # YAML reads this as a string; the flag's type converts it
data_path: [2, a, 1, b]
tempnet_rho: null      # the default
"""
    config = _gpt(tmp_path, text, "--num-layers", "5")
    assert config.preset == "llama2-7b" and config.model.swiglu  # the preset's
    assert (config.model.num_layers, config.model.hidden_size) == (5, 96)
    assert config.model.add_bias_linear and not config.loss.tempnet.stop_grad
    assert config.optimizer.lr == 3e-4 and config.data.data_path == ["2", "a", "1", "b"]
    assert config.loss.rho == 10.0


@pytest.mark.parametrize(
    "text,message",
    [
        ("num_layer: 2\n", "unknown key 'num_layer' (no flag --num_layer); did you mean 'num_l"),
        ("swiglu: 1\n", "key 'swiglu' is a switch: expected true or false, got 1"),
        ("num-layers: two\n", "key 'num-layers': expected int, got 'two'"),
        ("num-layers: true\n", "key 'num-layers': expected int, got True"),
        ("loss: mse\n", "key 'loss': 'mse' is not one of ce, dro, ts-ce"),
        ("seed: [1, 2]\n", "key 'seed': expected one value, got [1, 2]"),
        ("- 1\n", "expected a mapping of flag names to values, got a list"),
        ("lr: [1\n", "not valid YAML"),
    ],
)
def test_bad_files_name_the_key_and_the_file(tmp_path, text, message):
    with pytest.raises(YamlConfigError) as e:
        _gpt(tmp_path, text)
    assert str(e.value).startswith(f"--yaml-cfg {tmp_path / 'c.yaml'}: ") and message in str(
        e.value
    )


@pytest.mark.parametrize("family", ["gpt", "clip"])
def test_a_resolved_config_written_as_yaml_rebuilds_it(tmp_path, family):
    gpt = [
        "--data-path",
        "d",
        "--model",
        "llama2-7b",
        "--swiglu",
        "--disable-bias-linear",
        "--no-tempnet-stop-grad",
        "--num-layers",
        "4",
        "--lr-warmup-iters",
        "2",
        "--lr",
        "1e-3",
    ]
    clip = ["--image-mean", "0.5", "0.4", "0.3", "--clip-loss", "isogclr", "--lr", "1e-3"]
    build, make, argv = {
        "gpt": (build_parser, config_from_args, [*GPT, *gpt]),
        "clip": (build_clip_parser, clip_config_from_args, [*CLIP, *clip]),
    }[family]
    config = make(build().parse_args(argv))
    validate_run(config, world_size=1)  # fills the derived values (global batch, decay length)
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(config, "a header\non two lines"))
    assert path.read_text().startswith("# a header\n# on two lines\n")
    again = make(parse_with_yaml(build(), ["--yaml-cfg", str(path)]))
    assert dataclasses.asdict(again) == dataclasses.asdict(config)


def test_wandb_flags_are_checked(tmp_path):
    config = _gpt(tmp_path, "wandb_exp_name: x\nwandb_save_dir: d\nlr: 1e-3\n")
    with pytest.raises(ConfigError, match="--wandb-exp-name, --wandb-save-dir without --wandb-pro"):
        validate_run(config, world_size=1)
