"""The command-line parser of the training entry points: every problem of a command line at once.

argparse stops at the first flag it does not know, after printing its usage; a Megatron-LM launch
script with a dozen flags this project does not build would take a dozen attempts. ``FlagParser``
instead reads the whole command line, then raises one ``FlagError`` naming

- every flag that is refused (``refused``: a feature that is not built, with the reason),
- every unknown flag, with the close names it may have meant (``did you mean --lr-decay-iters?``),
- every problem the ``checks`` find in the values (a value that is not built, such as
  ``--context-parallel-size 2``),
- every required flag that is missing.

Flags are never matched by prefix (``allow_abbrev=False``): ``--deepspeed`` is not
``--deepspeed-config``.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Mapping, Sequence

from megatron_tempnet.utils.cli import UserError

Check = Callable[[argparse.Namespace], list[str]]
"""A check of the parsed values: one line per problem (``--flag value: why``)."""


class FlagError(UserError, ValueError):
    """A command line with unknown, refused, missing or bad flags; names each of them."""


class FlagParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without prefix matching that reports every problem at once.

    ``refused``: flag -> why it is refused; ``refused_prefixes``: the same for flag families
    (``--moe-``). ``checks`` (added with ``add_check``) look at the parsed values. The parsed
    namespace's ``given_flags`` holds the destinations the user set (``given``).
    """

    def __init__(
        self,
        *args,
        refused: Mapping[str, str] | None = None,
        refused_prefixes: Mapping[str, str] | None = None,
        **kwargs,
    ):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.refused = dict(refused or {})
        self.refused_prefixes = dict(refused_prefixes or {})
        self._checks: list[Check] = []
        self._fills: list[Callable[[argparse.Namespace], None]] = []
        self.extra_given: set[str] = set()
        """Destinations set by other means than the command line (a --yaml-cfg file)."""

    def add_check(self, check: Check) -> None:
        self._checks.append(check)

    def add_fill(self, fill: Callable[[argparse.Namespace], None]) -> None:
        """``fill(args)`` sets derived values (before the required flags are checked)."""
        self._fills.append(fill)

    def error(self, message: str):
        raise FlagError(f"{message} (--help lists every flag)")

    def known_flags(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        required = [a for a in self._actions if a.required]
        for action in required:  # checked below, with everything else
            action.required = False
        try:
            parsed, extras = self.parse_known_args(args, namespace)
        finally:
            for action in required:
                action.required = True
        parsed.given_flags = self.given(args) | self.extra_given
        for fill in self._fills:
            fill(parsed)
        problems = [self._unsupported(flag) for flag in _flags_among(extras)]
        for check in self._checks:
            problems += check(parsed)
        missing = [a.option_strings[0] for a in required if getattr(parsed, a.dest) is None]
        if missing:
            problems.append(f"missing required flag{'s' * (len(missing) > 1)}: {' '.join(missing)}")
        if problems:
            raise FlagError(_report(problems))
        return parsed

    def given(self, args: Sequence[str] | None = None) -> set[str]:
        """The destinations of the flags written on the command line ``args`` (default:
        ``sys.argv[1:]``), as opposed to those left at their defaults."""
        words = sys.argv[1:] if args is None else list(args)
        written = {w.split("=", 1)[0] for w in words if w.startswith("--")}
        return {a.dest for a in self._actions if written.intersection(a.option_strings)}

    def _unsupported(self, flag: str) -> str:
        reason = self.refused.get(flag)
        if reason is None:
            reason = next(
                (why for prefix, why in self.refused_prefixes.items() if flag.startswith(prefix)),
                None,
            )
        if reason is not None:
            return f"{flag}: {reason}"
        close = difflib.get_close_matches(flag, self.known_flags(), n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        return f"{flag}: unknown flag{hint}"


def _flags_among(extras: list[str]) -> list[str]:
    """The flags among argparse's unread words (their values are not flags)."""
    flags = []
    for word in extras:
        if word.startswith("--") and len(word) > 2:
            flag = word.split("=", 1)[0]
            if flag not in flags:
                flags.append(flag)
    return flags


def _report(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    lines = "\n  ".join(problems)
    return f"{len(problems)} problems with the command line (nothing was started):\n  {lines}"
