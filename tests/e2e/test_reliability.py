"""Faults a long run meets, through pretrain_gpt.py: a rank killed anywhere in a save, a full
disk, damaged checkpoints, a planted pickle, two runs in one directory, and a soak of random
kills and restarts that must end exactly where an uninterrupted run does."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import tempfile
import time

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_tempnet.checkpoint.checkpoint_format import (
    COMPLETE,
    check_checkpoint,
    file_digest,
    latest_tag,
    write_complete,
)
from megatron_tempnet.checkpoint.run_lock import LOCK, Owner
from tests.helpers import faults
from tests.helpers.checkpoints import global_tensors
from tests.helpers.corpus import data_flags
from tests.helpers.entry_points import Running, cli_flags, run_entry_point
from tests.helpers.run_flags import ONE_LAYER, tempnet_flags

TIMING = ("tokens_per_sec", "memory_mb")  # what legitimately differs between two runs


def _args(corpus, tmp, **flags) -> list[str]:
    base = {
        "model": "tiny",
        **data_flags(corpus["spec"], corpus["prefix"]["A"], 16),
        "micro-batch-size": 2,
        "global-batch-size": 4,
        **ONE_LAYER,
        "log-interval": 1,
        "eval-interval": 0,
        **tempnet_flags(16),
        "lr": 1e-3,
        "zero-stage": 1,
        "seed": 7,
        "data-cache-path": str(tmp / "cache"),
        "num-workers": 0,
        "save-interval": 5,
        # dropout on: a resume must restore the RNGs too
        "hidden-dropout": 0.1,
        "attention-dropout": 0.1,
    }
    return cli_flags(base, **flags)


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def _state(save_dir) -> dict[str, torch.Tensor]:
    """Every tensor of ``save_dir``'s newest checkpoint: the LM's and TempNet's weights and
    AdamW's moments, whole."""
    return global_tensors(save_dir)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _refused(corpus, tmp, **flags) -> set[str]:
    """The error lines of a 2-rank run that must stop, without a traceback."""
    r = run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp, **flags), check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return set(_error_lines(r.stderr))


def _start(corpus, tmp, setup=None, **flags) -> Running:
    out = tempfile.mkdtemp(dir=tmp)
    return Running("pretrain_gpt.py", _args(corpus, tmp, **flags), 2, out).start(setup)


def _kill_all(running: Running) -> None:
    for p in running.procs:
        with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
            os.kill(p.pid, signal.SIGKILL)


def _last_iteration(metrics) -> int:
    if not os.path.exists(metrics):
        return 0
    with open(metrics) as f:
        rows = [line for line in f.read().splitlines() if line.endswith("}")]
    return json.loads(rows[-1])["iteration"] if rows else 0


def _finish(running: Running, timeout: float = 300) -> subprocess.CompletedProcess:
    """Wait for the ranks; once one has died (killed), the others are killed at once (the
    launcher's part: a lost node takes its job down)."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in running.procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0, 75) for p in running.procs):
            _kill_all(running)
        time.sleep(0.02)
    return running.wait(timeout=30, grace=0)


def test_soak_random_kills_and_restarts_end_as_the_uninterrupted_run(corpus, tmp_path):
    """300 iterations, a checkpoint every 5; 18 faults: a rank SIGKILLed at each point of a
    save (twice for the rank's tensor file, its state file and the exchange), three times in a
    background write (--async-save: in its tensor file, at the exchange, at the marker), SIGKILL
    of all ranks and SIGTERM (preemption, once with --async-save: the stop waits for the write)
    at random iterations; each time the run restarts from `latest`. The metrics file,
    TensorBoard's steps, TempNet's and the LM's weights and moments equal an uninterrupted
    run's."""
    iters, rng = 300, random.Random(24)
    common = {"train-iters": iters, "keep-last": 2}
    reference = tmp_path / "reference"
    reference_flags = {**common, "save": reference, "metrics-file": reference / "m.jsonl"}
    run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp_path, **reference_flags))
    soak = tmp_path / "soak"
    metrics = soak / "m.jsonl"
    logs = {"metrics-file": metrics, "tensorboard-dir": soak / "tb"}
    flags = {**common, "save": soak, "load": soak, **logs}
    plan = [("save", point) for point in faults.SAVE_POINTS]
    plan += [("save", p) for p in ("shard", "rank_state", "between_ranks")]
    plan += [("async", p) for p in ("shard", "between_ranks", "marker")]
    plan += [("SIGKILL", None)] * 2 + [("SIGTERM", None), ("SIGTERM-async", None)]
    rng.shuffle(plan)
    log = []
    for kind, point in plan:
        start = int((latest_tag(soak) or "iter_0")[5:])
        background = {"async-save": True} if kind.endswith("async") else {}
        if kind in ("save", "async"):
            rank, nth = rng.randrange(2), rng.randint(1, 5)
            if point in faults.RANK0_POINTS:
                rank = 0
            nth = max(nth, 3) if point == "prune" else nth  # two older ones to prune first
            setup = (faults.kill_in_save, point, rank, nth)
            running = _start(corpus, tmp_path, setup, **flags, **background)
            at = f"{point} (rank {rank}, save {nth} of this start{', async' * bool(background)})"
        else:
            target = min(start + rng.randint(3, 30), iters - 5)
            running = _start(corpus, tmp_path, **flags, **background)
            while _last_iteration(metrics) < target and all(p.is_alive() for p in running.procs):
                time.sleep(0.01)
            for p in running.procs:
                with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                    os.kill(p.pid, getattr(signal, kind.removesuffix("-async")))
            at = f"{kind} after iteration {_last_iteration(metrics)}"
        result = _finish(running)
        tag = latest_tag(soak)
        assert result.returncode != 0, at  # it was stopped
        if kind.startswith("SIGTERM"):  # a checkpoint of the iteration it stopped at, published
            assert "Traceback" not in result.stderr, result.stderr[-3000:]
            assert int(tag[5:]) == _last_iteration(metrics), (at, tag)
        check_checkpoint(os.path.join(soak, tag), "soak")  # `latest` is complete and intact
        log.append((at, start, int(tag[5:])))
    final = run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp_path, **flags))
    assert "taking over the stale lock" in final.stderr + final.stdout
    assert sum(1 for _, before, after in log if after > before) >= 12, log  # progress was made
    assert _rows(metrics) == _rows(reference / "m.jsonl")
    assert [r["iteration"] for r in _rows(metrics)] == list(range(1, iters + 1))
    events = EventAccumulator(str(soak / "tb"))  # each restart purged the steps it redid
    events.Reload()
    assert [e.step for e in events.Scalars("loss/loss")] == list(range(1, iters + 1))
    got, want = _state(soak), _state(reference)
    assert got.keys() == want.keys() and any(k.startswith("exp_avg/tempnet.") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got)
    print("soak:", *log, sep="\n  ")


def test_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(corpus, tmp_path):
    """Rank 1's tensor file meets ENOSPC in the second save (--keep-last 1): both ranks stop
    with the same one-line error naming the file and the cause; iteration 5's checkpoint is
    `latest`, whole, and a resume from it completes."""
    save = tmp_path / "ckpt"
    flags = {"train-iters": 10, "save": save, "load": save, "keep-last": 1}
    setup = (faults.full_disk, "*shards/rank00001.bin", 1, 2)
    running = _start(corpus, tmp_path, setup, **flags)
    result = running.wait(timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = _error_lines(result.stderr)
    assert len(errors) == 2 and errors[0] == errors[1], result.stderr[-3000:]
    shard = save / "iter_0000010" / "shards" / "rank00001.bin"
    assert errors[0] == (
        f"error: saving {save / 'iter_0000010'} failed: {shard}: No space left on device "
        "(ENOSPC); 'latest' still names iter_0000005 and the incomplete directory was removed"
    )
    assert latest_tag(save) == "iter_0000005" and not (save / "iter_0000010").exists()
    check_checkpoint(str(save / "iter_0000005"), "test")
    resumed = run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp_path, **flags))
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert latest_tag(save) == "iter_0000010" and not (save / "iter_0000005").exists()


def test_damaged_checkpoints_are_named_and_fallback_is_asked_for(corpus, tmp_path):
    """A truncated file of the newest checkpoint stops the resume naming the file (no
    traceback); --load-fallback resumes from the older one and says so. A planted pickle in a
    checkpoint is refused and never runs; a second run on a live run's --save is refused."""
    save = tmp_path / "ckpt"
    flags = {"train-iters": 10, "save": save, "load": save}
    run_entry_point("pretrain_gpt.py", 2, _args(corpus, tmp_path, **flags))
    damaged = save / "iter_0000010" / "shards" / "rank00000.bin"
    os.truncate(damaged, os.path.getsize(damaged) - 100)
    # a longer run: a longer decay, kept (Megatron-LM's rule needs the flag to change it)
    more = {**flags, "train-iters": 12, "save-interval": 0, "override-opt-param-scheduler": True}
    assert _refused(corpus, tmp_path, **more) == {
        f"error: --load {save}: {damaged} is truncated or altered: "
        f"{os.path.getsize(damaged)} bytes, {os.path.getsize(damaged) + 100} when saved; add "
        "--load-fallback to load the newest older checkpoint that is valid"
    }
    fallback_args = _args(corpus, tmp_path, **more, **{"load-fallback": True})
    fell_back = run_entry_point("pretrain_gpt.py", 2, fallback_args)
    output = fell_back.stderr + fell_back.stdout
    assert "--load-fallback: loading iter_0000005, the newest complete and valid" in output
    assert "resumed from" in output and "at iteration 5" in output
    assert latest_tag(save) == "iter_0000012"

    # a checkpoint whose files were replaced, records and all: its pickle is refused unrun
    planted, marker = save / "iter_0000012", tmp_path / "code-ran"
    rank_file = planted / "rng_rank0.pt"
    torch.save({"torch": faults.PlantedPickle(str(marker))}, rank_file)
    files = {f: file_digest(str(planted / f)) for f in json.load(open(planted / COMPLETE))["files"]}
    write_complete(str(planted), files)
    more["train-iters"] = 14
    assert _refused(corpus, tmp_path, **more) == {
        f"error: --load {save}: {rank_file}: refused: loading it would run code (it calls "
        f"{open.__module__}.open); only files of tensors are loaded (torch.load "
        "weights_only=True); add --load-fallback to load the newest older checkpoint that is valid"
    }
    assert not marker.exists()

    # a live run holds the lock: this test's own process, as the other run
    with open(save / LOCK, "w") as f:
        json.dump(Owner.this_process().__dict__, f)
    lines = _refused(corpus, tmp_path, **more)
    assert len(lines) == 1 and f"is in use by another run: pid {os.getpid()} on" in lines.pop()
    assert os.path.exists(save / LOCK) and latest_tag(save) == "iter_0000012"
