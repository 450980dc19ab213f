"""docs/cli.md, the command-line reference, is what the programs' parsers say, and it covers every
program: the two entry points and every tools/**/*.py."""

from __future__ import annotations

import argparse
import difflib
import glob
import importlib.util
import os
import sys
from types import ModuleType

from megatron_tempnet.utils.cli_reference import render_reference

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI_MD = os.path.join(REPO, "docs", "cli.md")


def cli_reference_tool() -> ModuleType:
    """tools/cli_reference.py, imported once per test process (it imports every program)."""
    name = "_program_tools_cli_reference"  # the name the tool gives the programs it imports
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(REPO, "tools", "cli_reference.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_docs_cli_md_is_current():
    expected = cli_reference_tool().reference()
    with open(CLI_MD, encoding="utf-8") as f:
        written = f.read()
    diff = difflib.unified_diff(written.splitlines(), expected.splitlines(), lineterm="", n=0)
    assert written == expected, "docs/cli.md is stale: run `make docs`\n" + "\n".join(
        list(diff)[:20]
    )


def test_every_program_has_a_section():
    """A new tool cannot be left out: the programs are found here by their files."""
    programs = ["pretrain_gpt.py", "pretrain_clip.py"]
    programs += [
        os.path.relpath(p, REPO)
        for p in glob.glob(os.path.join(REPO, "tools", "**", "*.py"), recursive=True)
    ]
    assert len(programs) >= 15
    with open(CLI_MD, encoding="utf-8") as f:
        text = f.read()
    missing = [p for p in programs if f"\n## `{p}`\n" not in text]
    assert missing == [], "not in docs/cli.md (run `make docs`)"
    assert sorted(cli_reference_tool().program_paths()) == sorted(programs)


def test_the_reference_is_the_same_on_every_machine():
    text = cli_reference_tool().reference()
    for local in (REPO, os.path.expanduser("~"), sys.executable, " at 0x"):
        assert local not in text


def test_a_table_row_of_each_kind():
    p = argparse.ArgumentParser(prog="elsewhere", description="First line\nof one.\n\nMore.")
    p.add_argument("load", help="a directory")
    p.add_argument("--tp", "--tensor-parallel", dest="tp", type=int, default=2, help="%(default)s")
    p.add_argument("--grid", type=float, nargs="+", default=[], metavar="TAU", help="a | b")
    p.add_argument("--kind", choices=["a", "b"], default="a", help="one of %(choices)s")
    p.add_argument("--no-cache", dest="cache", action="store_false", help="off: %(prog)s")
    p.add_argument("--fn", type=int, default=print, help=argparse.SUPPRESS)
    p.add_argument("--hidden-default", default=argparse.SUPPRESS, help="")
    p.add_argument("--obj", default=object(), help="an object")
    g = p.add_argument_group("source").add_mutually_exclusive_group(required=True)
    g.add_argument("--hf-dir", help="a directory")
    g.add_argument("--gguf", required=False, help="a file")
    text = render_reference([("tools/x.py", p)], "Title", "Intro.")
    assert text == (
        "# Title\n\nIntro.\n\n- [`tools/x.py`](#toolsxpy)\n\n## `tools/x.py`\n\n"
        "First line of one.\n\nUsage: `python tools/x.py [options] load`\n\n"
        "### positional arguments\n\n| flag | default | help |\n|---|---|---|\n"
        "| `load` | required | a directory |\n\n"
        "### options\n\n| flag | default | help |\n|---|---|---|\n"
        "| `--tp`, `--tensor-parallel` `TP` | `2` | 2 |\n"
        "| `--grid` `TAU [TAU ...]` | — | a \\| b |\n"
        "| `--kind` `{a,b}` | `a` | one of a, b |\n"
        "| `--no-cache` | off | off: tools/x.py |\n"
        "| `--hidden-default` `HIDDEN_DEFAULT` | — |  |\n"
        "| `--obj` `OBJ` | `object` | an object |\n\n"
        "### source\n\n| flag | default | help |\n|---|---|---|\n"
        "| `--hf-dir` `HF_DIR` | required, or `--gguf` | a directory |\n"
        "| `--gguf` `GGUF` | required, or `--hf-dir` | a file |\n"
    )
