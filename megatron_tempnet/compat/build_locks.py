"""Stale locks of PyTorch's extension builder, through which DeepSpeed builds its ops.

DeepSpeed builds an op the first time a process needs it, with ``torch.utils.cpp_extension``: on
CPU its shared-memory communication op (``deepspeed_shm_comm``), when the first process group
starts. The builder's lock is a file, ``lock`` in the op's build directory
(``$TORCH_EXTENSIONS_DIR/<op>/``, default ``~/.cache/torch_extensions/py311_cpu/<op>/``): it
creates the file (failing if it exists), holds it open while it checks or builds the op, then
deletes it; every other process waits while the file exists. A builder killed in between leaves
the file behind, and every later start then waits for it forever, without a word.

A lock is left over when no process holds it open. On this host that is certain (``/proc``
lists every process's open files). A build directory on a network file system (a cluster's home
directory) may be shared with other hosts, whose builders cannot be seen: there a lock is taken
for left over only after ``SHARED_GRACE`` (a build takes under a minute), and a younger one is
reported and waited for.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_tempnet.utils.logging import get_logger

logger = get_logger(__name__)

SHARED_GRACE = 600.0
"""Seconds after which an unheld lock on a network file system is taken for left over."""
NETWORK_FILE_SYSTEMS = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "9p", "panfs"}
    | {"glusterfs", "sshfs", "wekafs"}  # as fuse.<name>
)


@dataclass(frozen=True)
class BuildLock:
    """A build lock no process on this host holds."""

    path: str
    age: float
    """Seconds since it was made."""
    shared: bool
    """On a network file system: a builder on another host may hold it."""

    @property
    def left_over(self) -> bool:
        return not self.shared or self.age >= SHARED_GRACE


def extensions_root(environ: Mapping[str, str] = os.environ) -> str:
    """The folder the ops' build directories are in, by PyTorch's rule: $TORCH_EXTENSIONS_DIR,
    else ``py<version>_<cpu or cu<CUDA>>`` in the user's cache."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if environ.get("TORCH_EXTENSIONS_DIR"):
        return environ["TORCH_EXTENSIONS_DIR"]
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


def unheld_build_locks(root: str | None = None, now: float | None = None) -> list[BuildLock]:
    """The build locks in ``root`` (default ``extensions_root()``) that no process on this host
    holds open."""
    root = root or extensions_root()
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    locks = [os.path.join(root, name, "lock") for name in names]
    locks = [os.path.realpath(p) for p in locks if os.path.isfile(p)]
    if not locks:
        return []
    held = _open_files()
    now = time.time() if now is None else now
    found = []
    for path in locks:
        if path in held:
            continue
        try:
            made = os.stat(path).st_mtime
        except OSError:  # released meanwhile
            continue
        found.append(BuildLock(path, max(0.0, now - made), _on_network_file_system(path)))
    return found


def remove_stale_build_locks(root: str | None = None) -> list[BuildLock]:
    """Delete the left-over build locks (``BuildLock.left_over``), one log line each, and warn
    about an unheld young one on a network file system. Call it from one process per host
    (the job's local rank 0) before DeepSpeed starts. Returns the locks deleted."""
    removed = []
    for lock in unheld_build_locks(root):
        if not lock.left_over:
            logger.warning(
                "%s: a build lock no process on this host holds (%.0f s old, on a network file "
                "system): waiting for the build on another host; if none is building, delete it",
                lock.path,
                lock.age,
            )
            continue
        try:
            os.remove(lock.path)
        except FileNotFoundError:
            continue
        logger.warning(
            "removed %s, a build lock left %.0f s ago by a stopped build (no process holds it): "
            "DeepSpeed checks or builds the op again",
            lock.path,
            lock.age,
        )
        removed.append(lock)
    return removed


def _open_files() -> set[str]:
    """The files every process on this host (that this user may inspect) holds open."""
    found: set[str] = set()
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                found.add(os.readlink(os.path.join(fd_dir, fd)))
            except OSError:
                continue
    return found


def _on_network_file_system(path: str) -> bool:
    """Whether ``path`` lies on a network file system (by ``/proc/mounts``' longest mount)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return False
    for point, fs_type in mounts:
        point = point.replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fs_type
    return kind.split(".")[-1] in NETWORK_FILE_SYSTEMS
