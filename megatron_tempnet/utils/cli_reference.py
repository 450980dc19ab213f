"""A command-line reference in Markdown, read from ``argparse`` parsers (docs/cli.md).

Each program gets a section: the first paragraph of its parser's description, then one table per
argument group, ``| flag | default | help |``. The flag column holds the flag's other spellings
and its value (metavar or choices), as ``--help`` writes them. The text depends on the parsers
only, so it is the same on every machine: a default that is no plain value (a function, an
object) is written by its name, never by its address.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

NO_DEFAULT = "—"
"""The default column of a flag that sets nothing unless given (a None or empty default)."""


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every spelling of every flag of ``parser`` (``--tp``, ``--tensor-model-parallel-size``,
    ``-h``, ``--help``, ...)."""
    return {s for action in parser._actions for s in action.option_strings}


def render_reference(
    programs: Sequence[tuple[str, argparse.ArgumentParser]], title: str, intro: str
) -> str:
    """The Markdown reference of ``programs`` (name, parser): ``title``, ``intro``, a table of
    contents, then a section per program in the given order."""
    lines = [f"# {title}", "", intro, ""]
    lines += [f"- [`{name}`](#{_anchor(name)})" for name, _ in programs]
    for name, parser in programs:
        lines += ["", f"## `{name}`", ""]
        description = first_paragraph(parser.description or "")
        if description:
            lines += [description, ""]
        lines += [f"Usage: `{_usage(parser, name)}`"]
        for group_title, actions in _groups(parser):
            lines += ["", f"### {group_title}", "", "| flag | default | help |", "|---|---|---|"]
            lines += [_row(parser, action, name) for action in actions]
    return "\n".join(lines) + "\n"


def first_paragraph(text: str) -> str:
    """The first paragraph of a description, on one line."""
    paragraph = text.strip().split("\n\n")[0]
    return " ".join(paragraph.split())


def _anchor(heading: str) -> str:
    """The link target GitHub gives a ``## `heading` ``."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _usage(parser: argparse.ArgumentParser, name: str) -> str:
    """``python NAME [options]`` and the positional arguments."""
    positional = [_metavar(a) for a in parser._actions if not a.option_strings]
    return " ".join(["python", name, "[options]", *positional])


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """(title, documented actions) of each argument group that has any, in parser order."""
    groups = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
        actions = [a for a in actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            groups.append((group.title or "options", actions))
    return groups


def _row(parser: argparse.ArgumentParser, action: argparse.Action, name: str) -> str:
    cells = (_flag(action), _default(parser, action), _help(action, name))
    return "| " + " | ".join(_escape(cell) for cell in cells) + " |"


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{_metavar(action)}`"
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    return f"{names} `{_metavar(action)}`"


def _metavar(action: argparse.Action) -> str:
    """The value a flag takes, as ``--help`` writes it (``N``, ``{a,b}``, ``X [X ...]``)."""
    if action.metavar is not None:
        name = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(str(c) for c in action.choices) + "}"
    elif action.option_strings:
        name = action.dest.upper()
    else:
        name = action.dest
    if action.nargs == "+":
        return f"{name} [{name} ...]"
    if action.nargs == "*":
        return f"[{name} ...]"
    if action.nargs == "?":
        return f"[{name}]"
    if isinstance(action.nargs, int) and action.nargs > 1:
        return " ".join([name] * action.nargs)
    return name


def _default(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.required:
        return "required"
    group = _exclusive_group(parser, action)
    if group is not None and group.required:
        others = [a.option_strings[0] for a in group._group_actions if a is not action]
        return "required, or " + " or ".join(f"`{s}`" for s in others)
    value = action.default
    if action.nargs == 0:  # a switch: off unless given
        return "on" if value is not None and value == action.const else "off"
    if value is None or value == argparse.SUPPRESS or value in ([], ()):
        return NO_DEFAULT
    return f"`{_value(value)}`"


def _exclusive_group(parser: argparse.ArgumentParser, action: argparse.Action):
    return next((g for g in parser._mutually_exclusive_groups if action in g._group_actions), None)


def _value(value) -> str:
    """A default as it is written on the command line."""
    if isinstance(value, list | tuple):
        return " ".join(_value(v) for v in value)
    if value == "":
        return '""'
    if isinstance(value, str | int | float | bool):
        return str(value)
    return getattr(value, "__name__", type(value).__name__)


def _help(action: argparse.Action, name: str) -> str:
    """The help text with its ``%(default)s``-style fields filled in, on one line (``%(prog)s``
    is the program's ``name``, not the name this process was started with)."""
    text = action.help or ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = name
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    for key, value in params.items():
        if callable(value) and hasattr(value, "__name__"):
            params[key] = value.__name__
    return " ".join((text % params).split())
