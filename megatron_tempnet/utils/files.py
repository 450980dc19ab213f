"""Files that appear whole or not at all."""

from __future__ import annotations

import os


def write_atomic(path: str, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` under a temporary name, then rename it to ``path``.

    A reader sees the old file or the new one, never a part; a failure leaves no partial file.
    ``fsync``: flush the data to disk before the rename (a file others depend on after a crash,
    such as a checkpoint's ``latest``).
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
