"""--profile --use-pytorch-profiler: one torch.profiler trace of iterations start ... end - 1 in
--tensorboard-dir, on --profile-ranks only; --manual-gc: no automatic collection during the
run, collections at the iterations and validation runs it names, the collector back after."""

from __future__ import annotations

import gc
import glob
import json
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_tempnet.trainer.profiling import IterationProfiler, ManualGC


def _profile(tmp_path, start: int, end: int, first: int, last: int = 7, rank: int = 0):
    config = SimpleNamespace(
        profile=True,
        profile_ranks=[0, 2],
        profile_step_start=start,
        profile_step_end=end,
        use_pytorch_profiler=True,
        tensorboard_dir=str(tmp_path),
    )
    profiler = IterationProfiler(config, rank)
    x = torch.randn(8, 8)
    for iteration in range(first, last + 1):  # a run resumed at ``first``
        profiler.begin(iteration)
        with torch.profiler.record_function(f"iteration_{iteration}"):
            x = (x @ x).tanh()
        profiler.end(iteration)
    profiler.close()
    traces = glob.glob(os.path.join(tmp_path, "*.pt.trace.json"))
    recorded = []
    for path in traces:
        assert f"_rank{rank}." in os.path.basename(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        recorded.append(sorted({e["name"] for e in events if e["name"].startswith("iteration_")}))
    return recorded


@pytest.mark.parametrize(
    "start,end,first,recorded",
    [
        (3, 5, 1, [3, 4]),  # iteration 2 is the profiler's warm-up: not recorded
        (0, 2, 1, [1]),  # 0 (Megatron-LM allows it) is the first iteration
        (3, 6, 4, [4, 5]),  # resumed inside the window: what is left of it
        (3, 20, 1, [3, 4, 5, 6, 7]),  # the run ends inside the window: written at the end
    ],
)
def test_the_profiled_iterations(tmp_path, start, end, first, recorded):
    assert _profile(tmp_path, start, end, first) == [[f"iteration_{i}" for i in recorded]]


def test_other_ranks_and_runs_resumed_past_the_window_write_nothing(tmp_path):
    assert _profile(tmp_path, 3, 5, 1, rank=1) == []
    assert _profile(tmp_path, 3, 5, 6, rank=2) == []
    assert _profile(tmp_path, 3, 5, 1, rank=2) == [["iteration_3", "iteration_4"]]


@pytest.fixture
def collections():
    """The collections that happen, as (``now[0]``, generation); ``now`` is the test's clock."""
    seen: list[tuple[float, int]] = []
    now = [0.0]

    def record(phase, info):
        if phase == "start":
            seen.append((now[0], info["generation"]))

    gc.callbacks.append(record)
    yield seen, now
    gc.callbacks.remove(record)
    gc.enable()


def _garbage() -> None:
    """Enough cyclic objects to trigger an automatic collection."""
    garbage = [[] for _ in range(5000)]
    for a, b in zip(garbage, garbage[1:]):
        a.append(b)
        b.append(a)


def test_manual_gc_collects_where_it_is_told(collections):
    seen, now = collections
    assert gc.isenabled()
    manual = ManualGC(SimpleNamespace(manual_gc=True, manual_gc_interval=3, manual_gc_eval=True))
    manual.start()
    assert not gc.isenabled() and seen == [(0, 2)]  # off, after one full collection
    for iteration in range(1, 8):
        now[0] = iteration
        _garbage()
        manual.after_iteration(iteration)
        if iteration == 4:
            with manual.validation():
                now[0] = 4.5
    manual.stop()
    assert gc.isenabled()
    # every 3rd iteration a full collection, one before validation, a young one after it
    assert seen == [(0, 2), (3, 2), (4, 2), (4.5, 0), (6, 2)]


def test_manual_gc_without_interval_or_validation_collections(collections):
    seen, now = collections
    manual = ManualGC(SimpleNamespace(manual_gc=True, manual_gc_interval=0, manual_gc_eval=False))
    manual.start()
    now[0] = 1
    for iteration in range(1, 4):
        _garbage()
        manual.after_iteration(iteration)
        with manual.validation():
            _garbage()
    manual.stop()
    assert seen == [(0, 2)] and gc.isenabled()
    off = ManualGC(SimpleNamespace(manual_gc=False, manual_gc_interval=3, manual_gc_eval=True))
    off.start()
    assert gc.isenabled()


@pytest.mark.parametrize(
    "level,after_iterations,after_validation", [(0, 0, 0), (1, 3, 0), (2, 3, 1)]
)
def test_empty_unused_memory_level_releases_the_cache_where_megatron_lm_does(
    monkeypatch, level, after_iterations, after_validation
):
    """1: after every iteration; 2: also after every validation run (on a GPU)."""
    from megatron_tempnet.trainer.profiling import RunHooks

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    logging = SimpleNamespace(
        profile=False,
        profile_ranks=[0],
        log_throughput=False,
        profile_step_start=10,
        profile_step_end=12,
        use_pytorch_profiler=False,
        tensorboard_dir=None,
    )
    training = SimpleNamespace(
        manual_gc=False, manual_gc_interval=0, manual_gc_eval=True, empty_unused_memory_level=level
    )
    hooks = RunHooks(SimpleNamespace(logging=logging, training=training), None, 1, 0)
    hooks.start()
    for iteration in range(1, 4):
        hooks.before(iteration)
        hooks.after(iteration)
    assert len(calls) == after_iterations
    with hooks.validation():
        pass
    assert len(calls) == after_iterations + after_validation
    hooks.close()
