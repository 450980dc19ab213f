"""A lock file left by a killed build of a DeepSpeed op (PyTorch's extension builder) is found and
removed at start-up, instead of every later start waiting for it forever; a lock a live builder
holds, or a young one on a network file system (another host may be building), is left alone."""

from __future__ import annotations

import os
import time

import pytest

from megatron_tempnet.compat import build_locks


def _lock(root, op: str = "deepspeed_shm_comm", age: float = 0.0) -> str:
    os.makedirs(root / op, exist_ok=True)
    path = str(root / op / "lock")
    os.close(os.open(path, os.O_CREAT | os.O_EXCL))  # what torch's FileBaton does
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_the_root_is_pytorchs(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    torch_dir = cpp_extension._get_build_directory("deepspeed_shm_comm", verbose=False)
    assert build_locks.extensions_root() == os.path.dirname(torch_dir)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert build_locks.extensions_root() == str(tmp_path / "mine")


def test_a_left_over_lock_is_removed_and_a_held_one_kept(tmp_path):
    stale = _lock(tmp_path, "deepspeed_shm_comm", age=5)
    held = _lock(tmp_path, "other_op")
    fd = os.open(held, os.O_RDONLY)  # a live builder keeps its lock open
    try:
        [found] = build_locks.unheld_build_locks(str(tmp_path))
        assert found.path == os.path.realpath(stale) and 4 < found.age < 60
        assert not found.shared and found.left_over  # this host's disk: certain
        [removed] = build_locks.remove_stale_build_locks(str(tmp_path))
        assert removed.path == found.path
        assert not os.path.exists(stale) and os.path.exists(held)
    finally:
        os.close(fd)


@pytest.mark.parametrize("age, removed", [(30.0, False), (build_locks.SHARED_GRACE + 1, True)])
def test_on_a_network_file_system_only_an_old_lock_is_stale(tmp_path, monkeypatch, age, removed):
    monkeypatch.setattr(build_locks, "_on_network_file_system", lambda path: True)
    path = _lock(tmp_path, age=age)
    assert [lock.shared for lock in build_locks.unheld_build_locks(str(tmp_path))] == [True]
    assert bool(build_locks.remove_stale_build_locks(str(tmp_path))) == removed
    assert os.path.exists(path) != removed


def test_network_file_systems_are_told_by_their_mount(tmp_path, monkeypatch):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        "server:/home /home nfs4 rw 0 0\n"
        "fs@tcp:/scratch /home/me/scratch lustre rw 0 0\n"
        "/dev/sdb1 /home/me/local ext4 rw 0 0\n"
    )
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: real_open(mounts if path == "/proc/mounts" else path, *a, **k),
    )
    shared = build_locks._on_network_file_system
    assert shared("/home/me/.cache/torch_extensions/py311_cpu/x/lock")
    assert shared("/home/me/scratch/x/lock")
    assert not shared("/home/me/local/x/lock") and not shared("/tmp/x/lock")
