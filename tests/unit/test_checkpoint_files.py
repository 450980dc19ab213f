"""The pieces of crash-safe checkpoints in one process: the completion record and its checks,
which checkpoint a load chooses, writes that fail with their cause, loads that never run code,
and the --save lock."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import time

import pytest
import torch
import xxhash

from megatron_tempnet.checkpoint import checkpoint_format
from megatron_tempnet.checkpoint.checkpoint_format import (
    COMPLETE,
    LATEST,
    CheckpointError,
    DigestCache,
    check_checkpoint,
    choose_checkpoint,
    mark_complete,
    publish_latest,
)
from megatron_tempnet.checkpoint.file_io import FileWriter, load_file
from megatron_tempnet.checkpoint.run_lock import LOCK, Owner, RunLock
from tests.helpers.faults import PlantedPickle


def _checkpoint(save_dir, iteration: int, complete: bool = True, digest="xxh3_128") -> str:
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(os.path.join(path, "shards"))
    torch.save({"w": torch.arange(1000.0) * iteration}, os.path.join(path, "model.pt"))
    with open(os.path.join(path, "shards", "index.json"), "w") as f:
        json.dump({"iteration": iteration}, f)
    if complete:
        mark_complete(path, digest)
    return path


@pytest.mark.parametrize("digest", ["xxh3_128", "sha256"])
def test_the_record_catches_truncated_altered_and_missing_files(tmp_path, digest):
    path = _checkpoint(tmp_path, 5, digest=digest)
    model = os.path.join(path, "model.pt")
    marker = json.load(open(os.path.join(path, COMPLETE)))
    record = marker["files"]
    assert marker["digest"] == digest and sorted(record) == ["model.pt", "shards/index.json"]
    reference = xxhash.xxh3_128 if digest == "xxh3_128" else hashlib.sha256
    assert record["model.pt"] == {  # the digest of the bytes themselves, independently taken
        "size": os.path.getsize(model),
        digest: reference(open(model, "rb").read()).hexdigest(),
    }
    cache = DigestCache(str(tmp_path / "cache"))
    check_checkpoint(path, "--load x", cache=cache)
    data = bytearray(open(model, "rb").read())
    data[len(data) // 2] ^= 1  # one bit, same size: the write changes the file's times
    open(model, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=f"--load x: {model} is altered: its {digest}"):
        check_checkpoint(path, "--load x", cache=DigestCache(str(tmp_path / "cache")))
    check_checkpoint(path, "--load x", verify=["shards/index.json"])  # another rank's file: size
    os.truncate(model, 100)
    with pytest.raises(CheckpointError, match=f"{model} is truncated or altered: 100 bytes, "):
        check_checkpoint(path, "--load x", verify=[])
    os.remove(model)
    with pytest.raises(CheckpointError, match=f"{model} is missing"):
        check_checkpoint(path, "--load x")
    os.remove(os.path.join(path, COMPLETE))
    with pytest.raises(CheckpointError, match="is incomplete \\(no COMPLETE marker"):
        check_checkpoint(path, "--load x")


def test_a_load_takes_latest_ignores_newer_saves_and_falls_back_only_when_asked(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    save = str(tmp_path)
    assert choose_checkpoint(save, "--load x", fallback=False) is None  # nothing yet
    _checkpoint(save, 5, complete=False)  # the first save died
    assert choose_checkpoint(save, "--load x", fallback=False) is None
    assert "ignoring iter_0000005: an interrupted save (incomplete" in caplog.text
    for i in (5, 10, 15):
        _checkpoint(save, i) if i != 5 else mark_complete(os.path.join(save, "iter_0000005"))
    with pytest.raises(CheckpointError, match="no 'latest' file, but complete checkpoints"):
        choose_checkpoint(save, "--load x", fallback=False)
    publish_latest(save, "iter_0000010")
    _checkpoint(save, 20, complete=False)
    assert choose_checkpoint(save, "--load x", fallback=False) == "iter_0000010"
    assert "ignoring iter_0000015: an interrupted save (complete, not named" in caplog.text
    assert "ignoring iter_0000020: an interrupted save (incomplete" in caplog.text
    os.truncate(os.path.join(save, "iter_0000010", "model.pt"), 10)
    with pytest.raises(CheckpointError, match="truncated .* add --load-fallback to load"):
        choose_checkpoint(save, "--load x", fallback=False)
    with pytest.raises(CheckpointError, match="truncated or altered: 10 bytes, [0-9]+ when saved$"):
        choose_checkpoint(save, "--load x", fallback=None)  # a reader without the flag
    assert choose_checkpoint(save, "--load x", fallback=True) == "iter_0000005"
    assert "--load-fallback: loading iter_0000005, the newest complete and valid" in caplog.text
    os.truncate(os.path.join(save, "iter_0000005", "model.pt"), 10)
    with pytest.raises(CheckpointError, match="no complete and valid checkpoint .*2 checked"):
        choose_checkpoint(save, "--load x", fallback=True)
    with open(os.path.join(save, LATEST), "w") as f:
        f.write("iter_0000099")
    with pytest.raises(CheckpointError, match="iter_0000099 is missing"):
        choose_checkpoint(save, "--load x", fallback=False)


def test_a_verified_file_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    """The digest cache: a second check of an unchanged file reads nothing (a new process
    too, through the cache directory); any write to the file makes it read again."""
    path = _checkpoint(tmp_path, 5)
    model = os.path.join(path, "model.pt")
    reads = []
    digest = checkpoint_format.file_digest
    monkeypatch.setattr(
        checkpoint_format, "file_digest", lambda p, *a, **k: reads.append(p) or digest(p, *a, **k)
    )
    check_checkpoint(path, "x", verify=["model.pt"], cache=DigestCache(str(tmp_path / "c")))
    check_checkpoint(path, "x", verify=["model.pt"], cache=DigestCache(str(tmp_path / "c")))
    assert reads == [model]
    with open(model, "r+b") as f:  # rewritten in place with the same bytes: read again
        data = f.read()
        f.seek(0)
        f.write(data)
    check_checkpoint(path, "x", verify=["model.pt"], cache=DigestCache(str(tmp_path / "c")))
    assert reads == [model, model]


@pytest.mark.parametrize(
    "code, shown",
    [
        (errno.ENOSPC, "No space left on device (ENOSPC)"),
        (errno.EIO, "Input/output error (EIO)"),
        (errno.EACCES, "Permission denied (EACCES)"),
    ],
)
def test_a_failed_write_names_the_file_and_its_cause(tmp_path, monkeypatch, code, shown):
    from megatron_tempnet.checkpoint import file_io

    path = str(tmp_path / "x.pt")

    def failing_open(name, mode="r", *args, **kwargs):
        raise OSError(code, os.strerror(code), name)

    monkeypatch.setattr(file_io, "open", failing_open, raising=False)
    with pytest.raises(CheckpointError) as e:
        FileWriter().save({"a": torch.ones(3)}, path)
    assert str(e.value) == f"cannot write {path}: {shown}"
    recording = FileWriter(records=True)  # during a save: kept, and nothing more is written
    recording.save({"a": torch.ones(3)}, path)
    monkeypatch.undo()
    recording.save({"a": torch.ones(3)}, str(tmp_path / "y.pt"))
    assert recording.failure == f"{path}: {shown}" and not os.path.exists(tmp_path / "y.pt")


def test_a_write_to_a_full_device_fails_with_the_kernels_enospc(tmp_path):
    with pytest.raises(CheckpointError, match="/dev/full: No space left on device \\(ENOSPC\\)"):
        FileWriter().save({"a": torch.randn(100_000)}, "/dev/full")


def test_loads_refuse_code_and_accept_deepspeeds_values(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    ran = tmp_path / "ran"
    torch.save({"w": torch.ones(2), "x": PlantedPickle(str(ran))}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="bad.pt: refused: loading it would run code"):
        load_file(str(tmp_path / "bad.pt"))
    assert not ran.exists()
    scaler = DynamicLossScaler(8.0, 10, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    values = {"scaler": scaler, "stage": ZeroStageEnum.optimizer_states}
    values["address"] = fragment_address(4, 2)
    torch.save(values, tmp_path / "ds.pt")
    loaded = load_file(str(tmp_path / "ds.pt"))
    assert loaded["scaler"].cur_scale == 8.0 and loaded["scaler"].scale_window == 10
    assert loaded["stage"] is ZeroStageEnum.optimizer_states
    assert (loaded["address"].numel, loaded["address"].start) == (4, 2)
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ds.pt").read_bytes()[:50])
    with pytest.raises(CheckpointError, match="cut.pt: .*the file cannot be read"):
        load_file(str(tmp_path / "cut.pt"))


def test_the_lock_refuses_a_live_run_and_takes_over_a_dead_ones(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    other = subprocess.Popen(["sleep", "60"])
    try:
        live = Owner(**{**Owner.this_process().__dict__, "pid": other.pid})
        live = Owner(**{**live.__dict__, "start_ticks": _ticks(other.pid)})
        (tmp_path / LOCK).write_text(json.dumps(live.__dict__))
        with pytest.raises(CheckpointError, match=f"in use by another run: pid {other.pid} on"):
            RunLock(str(tmp_path)).acquire()
        reused = Owner(**{**live.__dict__, "start_ticks": live.start_ticks - 1})
        assert not reused.is_running()  # the pid is another process's now
    finally:
        other.kill()
        other.wait()
    lock = RunLock(str(tmp_path)).acquire()
    assert f"taking over the stale lock {tmp_path / LOCK} of pid {other.pid}" in caplog.text
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK).exists()
    elsewhere = Owner("another-host", 1, time.time(), None, "77")
    assert elsewhere.is_running()  # cannot be checked from here: left to a person
    os.environ["SLURM_JOB_ID"] = "77"
    try:
        assert not elsewhere.is_running()  # this job's earlier start: a requeue
    finally:
        del os.environ["SLURM_JOB_ID"]


def _ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])
