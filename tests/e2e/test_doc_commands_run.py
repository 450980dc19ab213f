"""The documented commands that take seconds run as written, and print what the docs show.

``tests/unit/test_doc_commands.py`` checks every documented command statically (the program
exists and takes each flag). Here the quick ones run: every ``--help``, every memory planner
command (``tools/estimate_memory.py``) and the smoke run of docs/training.md ("A first run",
``pretrain_gpt.py --mock-data``). Each must exit 0; where the docs show its output (the plain
code block right after the command's block), every line shown must be a line it prints.
Paths under ``runs/`` are moved to the test's temporary directory.
"""

from __future__ import annotations

import json
import os

from tests.helpers.entry_points import run_program
from tests.unit.test_doc_commands import PYTHON, REPO, code_lines, commands, doc_files

FENCE = "```"


def _quick(words: list[str]) -> bool:
    if not words or not PYTHON.match(os.path.basename(words[0])):
        return False
    if "--help" in words or "-h" in words:
        return True
    script = words[1] if len(words) > 1 else ""
    return script.endswith("tools/estimate_memory.py") or (
        script.endswith("pretrain_gpt.py") and "--mock-data" in words
    )


def _shown_output(lines: list[str], start: int) -> list[str] | None:
    """The lines of the plain fenced block after the code block holding line ``start`` (1-based),
    when only blank lines lie between them; None when there is none."""
    i = start
    while i < len(lines) and not lines[i].strip().startswith(FENCE):
        i += 1  # the end of the command's block
    i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i >= len(lines) or lines[i].strip() != FENCE:
        return None
    shown = []
    for line in lines[i + 1 :]:
        if line.strip() == FENCE:
            return shown
        shown.append(line)
    return None


def documented_quick_commands() -> list[tuple[str, list[str], list[str] | None]]:
    """(where, words, output shown or None) of each quick command, each command once."""
    found, seen = [], set()
    for doc in doc_files():
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        for number, line in code_lines(text):
            simple = commands(line)
            if len(simple) != 1 or not _quick(simple[0]):
                continue
            words = simple[0]
            shown = _shown_output(lines, number)
            key = (tuple(words), tuple(shown or ()))
            if key not in seen:
                seen.add(key)
                found.append((f"{doc}:{number}", words, shown))
    return found


def test_the_quick_documented_commands_run_and_print_what_the_docs_show(tmp_path):
    found = documented_quick_commands()
    kinds = {"help": 0, "planner": 0, "smoke": 0}
    problems = []
    for where, words, shown in found:
        script = words[1]
        args = [os.path.join(tmp_path, w) if w.startswith("runs/") else w for w in words[2:]]
        out = run_program(script, args, nproc=0, timeout=300)
        if out.returncode != 0:
            problems.append(f"{where}: {' '.join(words)}: exit {out.returncode}\n{out.stderr}")
            continue
        printed = {line.rstrip() for line in out.stdout.splitlines()}
        missing = [s for s in shown or () if s.strip() and s.rstrip() not in printed]
        if missing:
            problems.append(f"{where}: not printed: {missing[:3]}")
        if "--help" in words or "-h" in words:
            kinds["help"] += 1
        elif script.endswith("estimate_memory.py"):
            kinds["planner"] += 1
        else:
            kinds["smoke"] += 1
            with open(args[args.index("--metrics-file") + 1], encoding="utf-8") as f:
                rows = [json.loads(line) for line in f]
            iters = int(args[args.index("--train-iters") + 1])
            assert max(r["iteration"] for r in rows) == iters, where
    assert problems == [], "\n".join(problems)
    # the docs hold planner commands with their output and the smoke run (a check that the
    # search above finds them, not a count to keep)
    assert kinds["planner"] >= 5 and kinds["smoke"] == 1, kinds
    assert sum(1 for _, _, shown in found if shown) >= 5


def test_the_output_block_after_a_command_is_found():
    lines = [
        "```bash",
        "python tools/estimate_memory.py --tp 2 \\",
        "    --dp 2",
        "```",
        "",
        "```",
        "total 1 GiB",
        "```",
        "```bash",
        "python tools/estimate_memory.py --tp 4",
        "```",
        "text in between",
        "```",
        "not its output",
        "```",
    ]
    assert _shown_output(lines, 2) == ["total 1 GiB"]
    assert _shown_output(lines, 10) is None
