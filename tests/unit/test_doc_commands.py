"""Every command the docs show runs as written: its program exists and takes each flag given.

The commands are the lines of the shell code blocks (fenced with no language or with bash, sh,
shell or console, and 4-space-indented blocks) of README.md and docs/*.md, with ``\\``
continuations joined. A line is read only when its first word (after a ``$`` prompt and
``VAR=value`` assignments) is a launcher or a shell command such as ``cd``; the commands on it
(split at ``&&``, ``||``, ``|``, ``;``) that start with a launcher are checked:

- ``python X.py``, ``python -m module``, ``torchrun ... X.py``, ``srun ... python X.py``: the
  program exists, and each ``--flag`` after it is one of its parser's spellings, exactly (no
  abbreviations). The entry points' and tools' parsers come from their ``build_parser()``
  (tools/cli_reference.py); another script's flags are read from its ``add_argument`` calls;
  a module outside the repository is not checked.
- ``make TARGET``: the Makefile has the target.
- ``sbatch ... X.sh``, ``bash X.sh``: the script exists.
- ``pip install '.[extra]'``: pyproject.toml declares the extra.

Other commands (``cd``, ``export``) and lines of program output are left alone.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re
import shlex

from megatron_tempnet.utils.cli_reference import option_strings
from tests.unit.test_cli_reference import cli_reference_tool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATED = ("docs/cli.md", "docs/megatron_flags.md")
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
CONTROL = {"&&", "||", "|", ";"}
LAUNCHERS = {"torchrun", "srun", "make", "sbatch", "bash", "sh", "pip", "pip3"}
PREFIXES = {"env", "time", "nohup", "exec"}  # run the command that follows
SHELL = {"cd", "export", "source", "set", "mkdir", "rm", "cp", "mv", "ls", "cat", "echo"}
PROJECT = {"megatron-tempnet", "megatron_tempnet", "."}


def doc_files() -> list[str]:
    docs = ["README.md"] + sorted(
        os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))
    )
    return [d for d in docs if d not in GENERATED]


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every line of the shell code blocks of a Markdown ``text``, with
    ``\\`` continuations joined onto their first line."""
    blocks, block = [], []
    fence, shell, indented, after_blank = None, False, False, True
    for number, line in enumerate(text.splitlines(), 1):
        if fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                blocks += [block] if shell else []
                fence, block = None, []
            else:
                block.append((number, line.strip()))
            continue
        opening = FENCE.match(line)
        if opening:
            blocks, block, indented = blocks + [block], [], False
            fence, shell = opening.group(1), opening.group(2).lower() in SHELL_FENCES
        elif line.startswith("    ") and line.strip() and (indented or after_blank):
            indented = True
            block.append((number, line.strip()))
        elif line.strip() and indented:
            blocks, block, indented = blocks + [block], [], False
        after_blank = not line.strip()
    blocks += [block] if fence is None or shell else []  # a block open at the end
    return [joined for b in blocks for joined in _join_continuations(b)]


def _join_continuations(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out, start, parts = [], None, []
    for number, line in block:
        start = number if start is None else start
        parts.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            out.append((start, " ".join(parts)))
            start, parts = None, []
    if parts:
        out.append((start, " ".join(parts)))
    return out


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line: words, split at ``&&``, ``||``, ``|`` and ``;``,
    without the comment, the ``$`` prompt, leading ``VAR=value`` assignments and ``env``. None
    unless the line starts with a launcher or a shell command (``cd``): another line is
    program output."""
    line = line.removeprefix("$ ")
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an output line with an odd quote
        words = line.split()
    out, current = [], []
    for word in words + [";"]:
        if word.endswith(";") and word != ";":
            current.append(word[:-1])
        if word in CONTROL or word.endswith(";"):
            while current and (ASSIGNMENT.match(current[0]) or current[0] in PREFIXES):
                current = current[1:]
            out += [current] if current else []
            current = []
        else:
            current.append(word)
    if not out or not (_is_launcher(out[0][0]) or out[0][0] in SHELL):
        return []
    return out


def _is_launcher(word: str) -> bool:
    name = os.path.basename(word)
    return bool(PYTHON.match(name)) or name in LAUNCHERS


def check_markdown(text: str, doc: str) -> list[str]:
    """``doc:line: problem`` for every documented command that would not run as written."""
    problems = []
    for number, line in code_lines(text):
        for words in commands(line):
            problems += [f"{doc}:{number}: {p}" for p in check_command(words)]
    return problems


def check_command(words: list[str]) -> list[str]:
    launcher = os.path.basename(words[0])
    if PYTHON.match(launcher):
        return _check_python(words[1:])
    if launcher == "torchrun":
        return _check_after_launcher(words[1:], torchrun=True)
    if launcher == "srun":
        return _check_after_launcher(words[1:], torchrun=False)
    if launcher == "make":
        return _check_make(words[1:])
    if launcher in ("sbatch", "bash", "sh"):
        scripts = [w for w in words[1:] if w.endswith(".sh")][:1]
        return [f"{s}: no such script" for s in scripts if not _exists(s)]
    if launcher in ("pip", "pip3"):
        return _check_pip(words[1:])
    return []


def _check_after_launcher(words: list[str], torchrun: bool) -> list[str]:
    """torchrun's or srun's options, then the program (srun: a command of its own)."""
    for i, word in enumerate(words):
        if PYTHON.match(os.path.basename(word)) or word == "torchrun":
            return check_command(words[i:])
        if word.endswith(".py") or (torchrun and word == "-m"):
            return _check_python(words[i:])
    return []


def _check_python(words: list[str]) -> list[str]:
    """The words after ``python``: its options, then the script or ``-m module``."""
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] != "-m":
        if words[i] == "-c":
            return []
        i += 2 if words[i] in ("-W", "-X") else 1
    if i >= len(words):
        return []
    if words[i] == "-m":
        if i + 1 >= len(words):
            return ["python -m without a module"]
        module, args = words[i + 1], words[i + 2 :]
        if module == "pip":
            return _check_pip(args)
        path = _module_path(module)
        if path is None:
            return []
        if not _exists(path):
            return [f"-m {module}: no such module in the repository"]
        return _check_flags(path, f"-m {module}", args)
    script, args = words[i], words[i + 1 :]
    if not _exists(script):
        return [f"{script}: no such file"]
    return _check_flags(os.path.normpath(script), script, args)


def _module_path(module: str) -> str | None:
    """The file of a module of this repository (None for one outside it)."""
    parts = module.split(".")
    if not os.path.isdir(os.path.join(REPO, parts[0])):
        return None
    base = os.path.join(*parts)
    package = os.path.join(base, "__main__.py")
    return package if os.path.isdir(os.path.join(REPO, base)) else base + ".py"


def _check_flags(path: str, program: str, args: list[str]) -> list[str]:
    known = program_flags(path)
    if known is None:
        return []
    problems = []
    for word in args:
        if word == "--":
            break
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and len(flag) > 2 and flag not in known:
            problems.append(f"{program}: unknown flag {flag}")
    return problems


@functools.cache
def program_flags(path: str) -> frozenset[str] | None:
    """Every spelling of the flags of the program at ``path``; None when they cannot be read
    (a script that gives another program its command line)."""
    tool = cli_reference_tool()
    if path in tool.program_paths():
        return frozenset(option_strings(tool.program_parser(path)))
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    flags = {"-h", "--help"}
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
    ]
    for call in calls:
        for arg in call.args:
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                return None  # a flag built at run time
            if arg.value.startswith("-"):
                flags.add(arg.value)
    return frozenset(flags) if calls else None


def _check_make(words: list[str]) -> list[str]:
    targets, skip = [], False
    for word in words:
        if skip or ASSIGNMENT.match(word):
            skip = False
            continue
        if word.startswith("-"):
            skip = word in ("-C", "-f", "-j", "-o", "-W")
            continue
        targets.append(word)
    return [f"make {t}: no such target in the Makefile" for t in targets if t not in make_targets()]


@functools.cache
def make_targets() -> frozenset[str]:
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        text = f.read()
    targets = set()
    for match in re.finditer(r"^([^\s#:=$][^:=]*?)\s*::?(?!=)", text, re.M):
        targets.update(match.group(1).split())
    return frozenset(targets)


def _check_pip(words: list[str]) -> list[str]:
    if "install" not in words:
        return []
    problems = []
    for word in words:
        match = re.fullmatch(r"(.+?)\[([\w,\s-]+)\]", word)
        if match and match.group(1) in PROJECT:
            problems += [
                f"pip install {word}: pyproject.toml has no extra {extra!r}"
                for extra in match.group(2).split(",")
                if extra.strip() not in project_extras()
            ]
    return problems


@functools.cache
def project_extras() -> frozenset[str]:
    """The names of pyproject.toml's [project.optional-dependencies] (read without tomllib,
    which Python 3.10 lacks)."""
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        section = f.read().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return frozenset(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _exists(path: str) -> bool:
    return os.path.isfile(os.path.join(REPO, path))


def test_every_documented_command_runs_as_written():
    problems = []
    for doc in doc_files():
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            problems += check_markdown(f.read(), doc)
    assert problems == [], "commands in the docs that would fail:\n" + "\n".join(problems)


PLANTED = """A page.

```bash
# a comment, then a command over three lines
python tools/generate.py --load ckpt \\
    --max-new-token 8 --top-k 4
cd runs && make docs test-everything
MODEL=tiny sbatch --nodes=1 examples/no_such_run.sh
pip install -e '.[eval,gpu]'
```

```python
python tools/generate.py --not-checked-in-python-code
```

Output follows.

    $ python tools/estimate_memory.py --tp 2 --bogus=1 --tensor-model-parallel-size 2
    make: the line above printed this; python tools/generate.py --help
    torchrun --nproc-per-node 2 pretrain_gpt.py --lr 1e-4 --lr-warmup 10

- a list item
  python tools/generate.py --not-code

```sh
python tools/no_such_tool.py; python -m megatron_tempnet.no_such_module --x
```

```python
python tools/generate.py --in-a-block-left-open
"""


def test_the_check_finds_a_bad_flag_target_script_and_extra():
    assert check_markdown(PLANTED, "x.md") == [
        "x.md:5: tools/generate.py: unknown flag --max-new-token",
        "x.md:7: make test-everything: no such target in the Makefile",
        "x.md:8: examples/no_such_run.sh: no such script",
        "x.md:9: pip install .[eval,gpu]: pyproject.toml has no extra 'gpu'",
        "x.md:18: tools/estimate_memory.py: unknown flag --bogus",
        "x.md:20: pretrain_gpt.py: unknown flag --lr-warmup",
        "x.md:26: tools/no_such_tool.py: no such file",
        "x.md:26: -m megatron_tempnet.no_such_module: no such module in the repository",
    ]


def test_a_script_outside_the_reference_has_its_add_argument_flags():
    flags = program_flags(os.path.join("examples", "quickstart.py"))
    assert flags is not None and "--help" in flags and len(flags) > 3
