"""``--yaml-cfg FILE``: flag values from a YAML file (Megatron-LM's flag), and the reverse.

The file is a mapping whose keys are flag names without the leading dashes, spelled with
dashes or underscores (``num-layers`` or ``num_layers``); flags given on the command line win::

    # llama_tiny.yaml
    model: tiny
    position_embedding_type: rope
    swiglu: true              # a switch: true = the flag is given
    data_path: [data/owt2_text_document]
    train_iters: 2000
    lr: 3.0e-4

A switch flag (``--swiglu``, ``--disable-bias-linear``) takes ``true`` (the flag is given) or
``false``. ``null`` leaves a flag at its default. An unknown key, a value of the wrong type or
outside the flag's choices is an error naming the key and the file.

``config_yaml`` writes a run's resolved config in the same form, so the file saved with every
run is itself a valid ``--yaml-cfg``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.flags import flag_name

FLAG = "--yaml-cfg"


class YamlConfigError(UserError, ValueError):
    """A ``--yaml-cfg`` file that cannot be read or names unknown flags or bad values."""


def add_yaml_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        FLAG,
        metavar="FILE",
        help="Read flag values from this YAML file (keys are flag names without the dashes; "
        "switches take true/false); flags on the command line win. Every run saves its resolved "
        "config as config.yaml in --save, itself a valid --yaml-cfg.",
    )


def parse_with_yaml(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with the values of ``--yaml-cfg`` as the defaults (a
    ``FlagParser`` counts them as given)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument(FLAG)
    path = getattr(pre.parse_known_args(argv)[0], "yaml_cfg", None)
    values = {}
    if path:
        values = yaml_flag_values(parser, path)
        for action in parser._actions:  # argparse has no public list of its flags
            if action.dest in values:
                action.required = False  # given by the file
        parser.set_defaults(**values)
    if hasattr(parser, "extra_given"):  # a FlagParser: the file's flags count as given
        parser.extra_given = set(values)
    return parser.parse_args(argv)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag of ``parser`` by its name with underscores (``num_layers``)."""
    flags = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and action.dest not in ("help", "yaml_cfg"):
                flags[option[2:].replace("-", "_")] = action
    return flags


def _load(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise YamlConfigError(f"{FLAG} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise YamlConfigError(f"{FLAG} {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise YamlConfigError(
            f"{FLAG} {path}: expected a mapping of flag names to values, got a "
            f"{type(data).__name__}"
        )
    return data


def yaml_flag_values(parser: argparse.ArgumentParser, path: str) -> dict:
    """The file's values by argparse destination, converted and checked like the flags."""
    flags = _flags(parser)
    values = {}
    for key, value in _load(path).items():
        name = str(key).lstrip("-").replace("-", "_")
        action = flags.get(name)
        if action is None:
            close = difflib.get_close_matches(name, flags, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see --help for the flags"
            raise YamlConfigError(f"{FLAG} {path}: unknown key {key!r} (no flag --{key}){hint}")
        if value is not None:
            values[action.dest] = _convert(action, value, f"{FLAG} {path}: key {key!r}")
    return values


def _convert(action: argparse.Action, value, where: str):
    if action.nargs == 0:  # a switch: store_true / store_false
        if not isinstance(value, bool):
            raise YamlConfigError(f"{where} is a switch: expected true or false, got {value!r}")
        return action.const if value else not action.const
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if not items and action.nargs == "+":
            raise YamlConfigError(f"{where}: expected one or more values, got an empty list")
        return [_scalar(action, item, where) for item in items]
    if isinstance(value, list | dict):
        raise YamlConfigError(f"{where}: expected one value, got {value!r}")
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value, where: str):
    kind = action.type or str
    if isinstance(value, bool) or isinstance(value, list | dict):
        bad = True
    elif kind is int:
        bad = not isinstance(value, int) and not _parses(int, value)
    elif kind is float:
        bad = not isinstance(value, int | float) and not _parses(float, value)
    else:
        bad = False
    if bad:
        raise YamlConfigError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    converted = kind(value) if kind in (int, float) else kind(str(value))
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise YamlConfigError(f"{where}: {converted!r} is not one of {choices}")
    return converted


def _parses(kind: type, value) -> bool:
    try:
        kind(value)
        return isinstance(value, str)
    except (TypeError, ValueError):
        return False


def config_flags(config) -> dict:
    """The flag values (``--yaml-cfg`` keys) that rebuild ``config``, a run config of nested
    config dataclasses; a switch's value says whether its flag is given."""
    values: dict = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            for key, item in config_flags(value).items():
                values.setdefault(key, item)
            continue
        name = flag_name(f)
        if name is None:
            continue
        if isinstance(value, bool) and f.default is True:
            value = not value  # --no-tempnet-stop-grad: given when the field is False
        if isinstance(value, tuple):
            value = list(value)
        values.setdefault(name[2:].replace("-", "_"), value)
    return values


def config_yaml(config, header: str = "") -> str:
    """``config`` as a ``--yaml-cfg`` file (with ``header`` as a leading comment)."""
    import yaml

    lines = [f"# {line}" for line in header.splitlines()]
    body = yaml.safe_dump(config_flags(config), sort_keys=False, default_flow_style=None)
    return "\n".join([*lines, body])
