"""Checkpoint files in and out: writes that reach the disk and whose failures are kept, loads that
never run code from a file.

``FileWriter.save`` writes through a Python file object (so a failure carries its errno and the
path) and flushes the file to disk. A writer that ``records`` failures keeps the first one and
skips the writes after it instead of raising: a rank whose disk filled up still takes part in
the save's collectives, and the ranks agree on the outcome at the end
(``checkpoint.checkpoint_writer``).

``load_file`` is ``torch.load(weights_only=True)``: tensors, containers, numbers and strings,
plus the few DeepSpeed value classes the earlier format's files hold
(``compat.checkpoint_safe_globals``, for ``tools/checkpoint/upgrade.py``). A file whose
unpickling would call anything else (a planted ``os.system``) is refused, named, before anything
in it runs. Every pickled file the project reads goes through it.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
from collections.abc import Callable
from typing import BinaryIO

import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError


def describe_error(path: str, error: BaseException) -> str:
    """``PATH: cause``, one line: the errno's text and name for an OS error (ENOSPC, EIO,
    EACCES), the first line of anything else."""
    if isinstance(error, OSError) and error.errno is not None:
        name = errno.errorcode.get(error.errno, str(error.errno))
        return f"{path}: {error.strerror or os.strerror(error.errno)} ({name})"
    return f"{path}: {str(error).strip().splitlines()[0] if str(error).strip() else type(error)}"


class FileWriter:
    """Writes checkpoint files; ``records`` keeps the first failure in ``failure`` instead of
    raising it (a ``CheckpointError`` otherwise)."""

    def __init__(self, *, records: bool = False, zipfile: bool = True):
        self.records = records
        self.zipfile = zipfile
        self.failure: str | None = None

    def save(self, obj, path: str) -> None:
        """``torch.save(obj)`` to ``path``, flushed to disk."""
        self._write(path, lambda f: torch.save(obj, f, _use_new_zipfile_serialization=self.zipfile))

    def stream(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """``write(f)`` to the open file ``path``, flushed to disk."""
        self._write(path, write)

    def write_text(self, path: str, text: str) -> None:
        self._write(path, lambda f: f.write(text.encode("utf-8")))

    def _write(self, path: str, write) -> None:
        if self.failure is not None:  # one failure is enough: the save is lost already
            return
        try:
            with open(path, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        except CheckpointError:  # the data could not be made (a source refused): not a write error
            raise
        except (OSError, RuntimeError) as e:
            self.failure = describe_error(path, e)
            if not self.records:
                raise CheckpointError(f"cannot write {self.failure}") from None


_GLOBAL = re.compile(r"GLOBAL (\S+)")


def load_file(path: str, map_location="cpu", *, mmap: bool = False):
    """``torch.load`` without code execution (``weights_only``); a ``CheckpointError`` naming
    ``path`` when it cannot be read or would run code."""
    from megatron_tempnet import compat

    try:
        with torch.serialization.safe_globals(compat.checkpoint_safe_globals()):
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = f"it calls {found.group(1)}" if found else str(e).strip().splitlines()[0]
        raise CheckpointError(
            f"{path}: refused: loading it would run code ({what}); only files of tensors are "
            "loaded (torch.load weights_only=True)"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{describe_error(path, e)}: the file cannot be read") from None


class Opaque:
    """A value of a class that ``load_foreign_file`` does not load (a Megatron-LM enum in its
    saved arguments, NumPy's RNG state): its class name and arguments, nothing of its code."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__name__}>"


_FOREIGN_CLASSES = {
    ("collections", "OrderedDict"),
    ("argparse", "Namespace"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("_codecs", "encode"),
    ("torch", "Size"),
    ("torch", "device"),
}


class _ForeignUnpickler(pickle.Unpickler):
    """Builds tensors, containers and ``argparse.Namespace``; any other class becomes an
    ``Opaque`` placeholder, so no code from the file runs."""

    def find_class(self, module: str, name: str):
        if (module, name) in _FOREIGN_CLASSES:
            return super().find_class(module, name)
        if module == "torch._utils" and name.startswith("_rebuild_"):
            return super().find_class(module, name)
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return super().find_class(module, name)
        if module == "torch" and (name.endswith("Storage") or name in _DTYPES):
            return super().find_class(module, name)
        return type(name, (Opaque,), {"__module__": module})


_DTYPES = {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


class _ForeignPickle:
    """The ``pickle_module`` ``load_foreign_file`` gives ``torch.load``."""

    Unpickler = _ForeignUnpickler
    __name__ = "megatron_tempnet_foreign_pickle"

    @staticmethod
    def load(file, **kwargs):
        return _ForeignUnpickler(file, **kwargs).load()


def load_foreign_file(path: str, *, mmap: bool = False):
    """A file another framework pickled (Megatron-LM's ``model_optim_rng.pt`` and
    ``common.pt``, whose ``args`` is an ``argparse.Namespace`` that may hold its enums):
    tensors, containers, numbers, strings and namespaces are loaded; every other class becomes
    an ``Opaque`` placeholder, and nothing from the file runs. A ``CheckpointError`` names
    ``path`` when it cannot be read."""
    try:
        return torch.load(
            path, map_location="cpu", mmap=mmap, weights_only=False, pickle_module=_ForeignPickle
        )
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{describe_error(path, e)}: the file cannot be read") from None
