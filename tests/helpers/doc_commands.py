"""Run a Markdown document's own commands: its ```bash blocks, in order, in one bash with
``set -euo pipefail``, then its ```python blocks in this process.

In the bash, ``python`` and ``torchrun`` are shell functions that hand their command line, as bash
expanded it, to the test over two pipes. The test runs it with ``entry_points.run_command`` (a
process from the preloaded server: no 5 s of imports per command) and answers with its exit
status, which the function returns. Every other command (``mkdir``, ``printf``, ``$(cat ...)``)
is bash's own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers.entry_points import run_command

_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
_PRELUDE = r"""set -euo pipefail
_project() {
    printf '%s\0' "$#" "$PWD" "$@" >&"$DOC_REQUEST_FD"
    local status
    read -r status <&"$DOC_ANSWER_FD"
    return "$status"
}
python() { _project python "$@"; }
torchrun() { _project torchrun "$@"; }
"""


def blocks(path: str) -> list[tuple[str, str]]:
    """The fenced code blocks of ``path``: (language, code), in order."""
    with open(path, encoding="utf-8") as f:
        return [(m[1], m[2]) for m in _BLOCK.finditer(f.read())]


def run_document(
    path: str, env: dict, log: str, timeout: float = 600
) -> tuple[list[subprocess.CompletedProcess], list[dict]]:
    """Run ``path``'s bash blocks, then its python blocks (``env`` is their environment; the
    python blocks see it as ``os.environ`` while they run); bash's own output goes to ``log``.
    Returns each program's ``CompletedProcess`` and each python block's variables, in order; a
    failing command fails the test with its output."""
    found = blocks(path)
    languages = [lang for lang, _ in found]
    if "python" in languages and "bash" in languages[languages.index("python") :]:
        raise ValueError(f"{path}: a bash block after a python block (they run bash first)")
    script = _PRELUDE + "\n".join(code for lang, code in found if lang == "bash")
    programs = _run_bash(script, env, log, timeout)
    saved, namespaces = dict(os.environ), []
    os.environ.update(env)
    try:
        for lang, code in found:
            if lang == "python":
                namespaces.append({"__name__": "__doc__"})
                exec(compile(code, path, "exec"), namespaces[-1])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return programs, namespaces


def _run_bash(
    script: str, env: dict, log: str, timeout: float
) -> list[subprocess.CompletedProcess]:
    request_r, request_w = os.pipe()
    answer_r, answer_w = os.pipe()
    fds = {"DOC_REQUEST_FD": str(request_w), "DOC_ANSWER_FD": str(answer_r)}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", script, "bash"],
            env={**env, **fds},
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=(request_w, answer_r),
        )
    os.close(request_w)
    os.close(answer_r)
    programs, reader = [], _Fields(request_r)
    try:
        while (count := reader.next()) is not None:
            pwd, argv = reader.next(), [reader.next() for _ in range(int(count))]
            if pwd != os.getcwd():
                raise AssertionError(f"{argv}: ran in {pwd}, the test is in {os.getcwd()}")
            r = run_command(_python_command(argv), env=env, timeout=timeout)
            programs.append(r)
            if r.returncode != 0:
                raise AssertionError(f"{' '.join(argv)} failed:\n{r.stderr[-4000:]}")
            os.write(answer_w, b"0\n")
        status = proc.wait(timeout=60)
    finally:
        os.close(request_r)
        os.close(answer_w)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open(log) as f:
        assert status == 0, f"bash exited with {status}:\n{f.read()[-4000:]}"
    return programs


def _python_command(argv: list[str]) -> list[str]:
    """``python ARGS`` and ``torchrun OPTIONS SCRIPT ARGS`` as ``run_command`` takes them."""
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


class _Fields:
    """NUL-terminated fields read from a pipe; ``next`` gives None at its end."""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""

    def next(self) -> str | None:
        while b"\0" not in self.buffer:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        field, self.buffer = self.buffer.split(b"\0", 1)
        return field.decode()
