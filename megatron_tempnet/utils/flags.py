"""Command-line flags declared once: a config dataclass field is its flag.

A field's flag is ``--`` and the field's name with dashes (``lr_warmup_iters`` ->
``--lr-warmup-iters``) unless ``option(name=...)`` gives Megatron-LM's name for it
(``rho`` -> ``--tempnet-rho``). Its type annotation gives the flag's type, its default the flag's
default, and the docstring written under it the flag's ``--help`` text::

    @dataclass
    class OptimizerConfig:
        lr: float = 6e-4
        \"\"\"Peak learning rate.\"\"\"
        clip_grad: float = option(1.0, choices=None)
        ...

    parser = argparse.ArgumentParser()
    add_flags(parser, OptimizerConfig, "optimizer")
    config = from_flags(OptimizerConfig, parser.parse_args())

Booleans: a field that defaults to False is switched on by its flag; one that defaults to True is
switched off by its flag, whose name must say so (``--no-tempnet-stop-grad``,
``--disable-bias-linear``). ``list[...]`` and ``tuple[..., ...]`` fields take one or more values.
A field made with ``derived()`` is no flag: the program fills it from other flags or the data.
With ``preset=True`` (architecture presets) every flag defaults to None, meaning "the preset's".
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any

_FLAG = "flag"  # field metadata: the flag's name, or None for a derived field
_CHOICES = "choices"
_METAVAR = "metavar"
_ALIASES = "aliases"


def option(
    default: Any = dataclasses.MISSING,
    *,
    name: str | None = None,
    choices: typing.Sequence | None = None,
    metavar: str | None = None,
    default_factory: Any = dataclasses.MISSING,
    aliases: typing.Sequence[str] = (),
) -> Any:
    """A config field with a flag of another ``name`` than its own, ``choices`` (matched without
    regard to case: ``rmsnorm`` is ``RMSNorm``), a ``metavar``, or other spellings of its flag
    (``aliases``: Megatron-DeepSpeed's ``--deepspeed_config``)."""
    metadata = {_FLAG: name or "", _CHOICES: choices, _METAVAR: metavar, _ALIASES: tuple(aliases)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def derived(default: Any = None) -> Any:
    """A config field that is no flag: filled from other flags or from the data."""
    return dataclasses.field(default=default, metadata={_FLAG: None})


def nested(factory: type) -> Any:
    """A config field holding another config, whose flags its own group adds
    (``LossConfig.tempnet``)."""
    return dataclasses.field(default_factory=factory, metadata={_FLAG: None})


def flag_name(f: dataclasses.Field) -> str | None:
    """``--flag-name`` of a field, or None for a derived one."""
    name = f.metadata.get(_FLAG, "")
    if name is None:
        return None
    return name or "--" + f.name.replace("_", "-")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of ``cls`` and of its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for stmt, following in zip(body, body[1:]):
            documented = isinstance(following, ast.Expr) and isinstance(
                following.value, ast.Constant
            )
            if isinstance(stmt, ast.AnnAssign) and documented:
                text = inspect.cleandoc(str(following.value.value))
                docs[stmt.target.id] = " ".join(text.split())
    return docs


def _without_none(annotation):
    """``X`` for ``X | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _unwrap(annotation) -> tuple[type, bool]:
    """(element type, takes several values) of a field's type."""
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) in (list, tuple):
        return typing.get_args(annotation)[0], True
    return annotation, False


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    title: str | None = None,
    *,
    preset: bool = False,
    exclude: typing.Collection[str] = (),
    required: bool | None = None,
    preset_required: typing.Collection[str] = (),
):
    """Add the flags of ``cls``'s fields: to a new argument group titled ``title``, or with no
    title to ``parser`` itself (which may be a group). ``preset_required``: with ``preset``, the
    fields that must be given when no preset is (the program checks; the help says so).

    ``exclude``: fields left out (the program derives them). ``required``: override whether
    fields without a default must be given. Returns the group.
    """
    group = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        flag = flag_name(f)
        if flag is None or f.name in exclude:
            continue
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring: it is {flag}'s help text")
        names = (flag, *f.metadata.get(_ALIASES, ()))
        must = preset and f.name in preset_required
        spec = _argument(f, hints[f.name], docs[f.name], preset, required, must)
        group.add_argument(*names, **spec)
    return group


def _argument(
    f: dataclasses.Field,
    annotation,
    doc: str,
    preset: bool,
    required: bool | None,
    preset_required: bool = False,
) -> dict:
    kind, several = _unwrap(annotation)
    has_default = f.default is not dataclasses.MISSING or (
        f.default_factory is not dataclasses.MISSING
    )
    default = f.default if f.default is not dataclasses.MISSING else None
    if f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    help_text = doc.replace("%", "%%")
    if preset and preset_required:
        help_text += " (required without --model, as in Megatron-LM; else the preset's)"
        default = None
    elif preset:
        if "(default:" not in help_text:
            shown = "none" if not has_default or default is None else default
            if isinstance(default, bool):
                shown = "off"
            help_text += f" (default: {shown}, or the --model preset's)"
        default = None
    elif has_default and default is not None and not isinstance(default, bool | tuple | list):
        help_text += f" (default: {default})"
    out: dict = {"dest": _dest(flag_name(f)), "help": help_text}
    if kind is bool:
        # a True default is turned off by the flag (--no-tempnet-stop-grad)
        out.update(action="store_false" if f.default is True else "store_true", default=default)
        return out
    out.update(type=kind, default=default)
    if several:
        out["nargs"] = "+"
    if f.metadata.get(_CHOICES):
        out["choices"] = list(f.metadata[_CHOICES])
        if kind is str:
            out["type"] = _canonical_choice(out["choices"])
    if f.metadata.get(_METAVAR):
        out["metavar"] = f.metadata[_METAVAR]
    if not has_default and not preset:
        out["required"] = True if required is None else required
    return out


def _canonical_choice(choices: list[str]):
    """A flag type that spells a choice as ``choices`` does, whatever its case."""
    by_lower = {c.lower(): c for c in choices}

    def canonical(value: str) -> str:
        return by_lower.get(value.lower(), value)

    return canonical


def add_preset_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    presets: dict,
    default: str | None,
    what: str,
    required: tuple[str, ...] = (),
):
    """The ``model`` group: ``--model`` (one of ``presets``, describing ``what``) and ``cls``'s
    flags, each overriding the preset's value; the fields in ``required`` must be given without
    --model (their help says so instead of a default)."""
    group = parser.add_argument_group("model")
    none = "none: the model is what its flags say, with Megatron-LM's defaults"
    group.add_argument(
        "--model",
        default=default,
        choices=sorted(presets),
        help=f"{what}; every other model flag overrides it, and the overrides are listed at "
        f"start-up (default: {default or none})",
    )
    return add_flags(group, cls, preset=True, preset_required=frozenset(required))


def flag_values(cls: type, args: argparse.Namespace) -> dict:
    """The parsed values of ``cls``'s flags that ``args`` has, by field name."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        flag = flag_name(f)
        if flag is None or not hasattr(args, _dest(flag)):
            continue
        value = getattr(args, _dest(flag))
        if value is not None and typing.get_origin(_without_none(hints[f.name])) is tuple:
            value = tuple(value)
        values[f.name] = value
    return values


def from_flags(cls: type, args: argparse.Namespace, **values):
    """A ``cls`` from its parsed flags; ``values`` fill (or override) the other fields."""
    return cls(**{**flag_values(cls, args), **values})
