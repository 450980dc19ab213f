"""Write the command-line reference of every program (docs/cli.md) from the programs' parsers.

    python tools/cli_reference.py > docs/cli.md        (make docs)

The programs are the two entry points and every tools/**/*.py. Each defines ``build_parser()``,
which builds its parser and runs nothing; this tool imports each file and calls it. A test
checks docs/cli.md against this output, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import os
import sys
from types import ModuleType

from megatron_tempnet.utils.cli import UserError, run_tool
from megatron_tempnet.utils.cli_reference import render_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ("pretrain_gpt.py", "pretrain_clip.py")
TITLE = "Command-line reference"
INTRO = (
    "Every flag of the entry points and tools, with its default and help text, grouped as "
    "`--help` groups them. `make docs` writes this file from the programs' parsers; do not edit "
    "it by hand."
)


def program_paths() -> list[str]:
    """The entry points, then every tools/**/*.py, relative to the repository."""
    tools = glob.glob(os.path.join(REPO, "tools", "**", "*.py"), recursive=True)
    return [*ENTRY_POINTS, *sorted(os.path.relpath(p, REPO) for p in tools)]


@functools.cache
def load_program(path: str) -> ModuleType:
    """The program file ``path`` (relative to the repository) imported as a module; its
    ``if __name__ == "__main__"`` part does not run."""
    name = "_program_" + path.removesuffix(".py").replace(os.sep, "_")
    if name in sys.modules:  # this file, imported by a test under that name
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def program_parser(path: str) -> argparse.ArgumentParser:
    """The parser of the program ``path``, from its ``build_parser()``."""
    build = getattr(load_program(path), "build_parser", None)
    if build is None:
        raise UserError(f"{path} has no build_parser(): give it one that returns its parser")
    return build()


def reference() -> str:
    """docs/cli.md's text."""
    return render_reference([(p, program_parser(p)) for p in program_paths()], TITLE, INTRO)


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    sys.stdout.write(reference())
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
