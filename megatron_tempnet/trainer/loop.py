"""The pretraining run, top to bottom: set up, resume, iterate, evaluate, log, save.

One loop for every model family: what differs (data, module, step, validation, per-rank state)
comes from a ``Task`` (``trainer.task``), and everything it builds is returned to the loop.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.checkpoint.checkpoint_format import CONFIG, CONFIG_YAML, CheckpointError
from megatron_tempnet.checkpoint.checkpointer import Checkpointer
from megatron_tempnet.checkpoint.run_lock import RunLock
from megatron_tempnet.data.loader import DataState, ResumableLoader, dataset_fingerprint
from megatron_tempnet.distributed.launch import launch_environment
from megatron_tempnet.trainer.config import RunConfig
from megatron_tempnet.trainer.engine import build_engine, init_process_groups
from megatron_tempnet.trainer.preemption import EXIT_REQUEUE, StopRequests
from megatron_tempnet.trainer.profiling import RunHooks
from megatron_tempnet.trainer.run_logger import RunLogger, memory_mb
from megatron_tempnet.trainer.schedule import LRSchedule, TrainSchedule, resumed_settings
from megatron_tempnet.trainer.stats import StepReport, read_step
from megatron_tempnet.trainer.step import check_finite, compute_device
from megatron_tempnet.trainer.task import Task, TaskData
from megatron_tempnet.utils.logging import log_rank0
from megatron_tempnet.utils.yaml_cfg import config_yaml


@dataclass
class RunResult:
    metrics: dict
    """The last logged metrics."""
    iteration: int
    """The last iteration run."""
    stopped: str | None = None
    """Why the run stopped early at a checkpoint (a signal, the time budget), else None."""

    @property
    def exit_code(self) -> int:
        return EXIT_REQUEUE if self.stopped else 0


def pretrain(config: RunConfig, task: Task) -> RunResult:
    """Train as configured, or until a stop request (a checkpoint is written, then it returns)."""
    requests = StopRequests(config.checkpoint.exit_duration_in_mins)
    os.environ.update(launch_environment(os.environ))  # torchrun, srun, or a lone process
    world_size = int(os.environ["WORLD_SIZE"])
    inputs = task.prepare(config, world_size)  # every flag checked before anything is built

    init_process_groups(config)
    lock = _lock_save_dir(config)
    try:
        return _train(config, task, inputs, world_size, requests)
    finally:
        if lock is not None:
            lock.release()


def _train(
    config: RunConfig, task: Task, inputs, world_size: int, requests: StopRequests
) -> RunResult:
    """Build, resume and run the iterations (``pretrain``'s body, under the --save lock)."""
    run = _build(config, task, inputs, world_size)
    if config.checkpoint.save:  # without somewhere to save, a signal keeps its usual meaning
        requests.install()
    result = _iterate(run, requests)
    if not result.stopped:
        # a stopped run keeps ignoring SIGTERM until it exits: srun --kill-on-bad-exit sends it
        # to the ranks still shutting down when the first one exits with EXIT_REQUEUE
        requests.restore()
    run.checkpointer.wait()  # a background save finishes before the run exits (a stop request too)
    run.hooks.close()
    run.run_log.close()
    dist.barrier()
    return result


@dataclass
class _Run:
    """What the iterations use, built once by ``_build``."""

    config: RunConfig
    task: Task
    data: TaskData
    engine: object
    optimizer: object
    checkpointer: Checkpointer
    schedule: TrainSchedule
    loader: ResumableLoader
    step: Callable
    hooks: RunHooks
    run_log: RunLogger
    start: int
    """The iteration the run resumed after (0: a fresh start)."""


@dataclass
class _Iteration:
    """One iteration's outcome on the host."""

    batch: int
    """The global batch size it ran (--rampup-batch-size)."""
    rates: dict
    stats: object
    report: StepReport


def _build(config: RunConfig, task: Task, inputs, world_size: int) -> _Run:
    """The task's data, model and step, DeepSpeed's engine, the resumed state, the schedule,
    the data loader, the logger and the hooks."""
    data = task.build_data(config, inputs)
    model = task.build_model(config, data)
    engine, optimizer = build_engine(model, config, world_size)
    checkpointer = Checkpointer(engine, model, config)
    start, data_state, schedule_state = _resume(checkpointer, data)
    t, ckpt = config.training, config.checkpoint
    schedule = TrainSchedule(t.batch_schedule(), LRSchedule.from_config(config.optimizer, t))
    schedule.load_state_dict(schedule_state, data_state.consumed_samples)
    saved = (schedule_state or {}).get("settings")
    resumed_settings(schedule, optimizer, saved, config.optimizer, f"--load {ckpt.load}")
    _save_config(config)
    loader = ResumableLoader(
        data.train,
        data_state,
        t.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        num_workers=t.num_workers,
    )
    run_log = RunLogger(config.logging, start, json.loads(config.to_json()))
    step = task.build_step(engine, optimizer, config, data)
    hooks = RunHooks(config, model.flops_per_sample, world_size, data_state.consumed_samples)
    hooks.start()
    return _Run(config, task, data, engine, optimizer, checkpointer, schedule, loader, step,
                hooks, run_log, start)  # fmt: skip


def _iterate(run: _Run, requests: StopRequests) -> RunResult:
    """The iterations from ``run.start + 1``: each one's step, then logging, validation, saving
    and stopping as the flags say."""
    t, ckpt = run.config.training, run.config.checkpoint
    result = RunResult({}, run.start)
    tic, counted = time.perf_counter(), 0.0  # what the throughput is measured over
    for iteration in range(run.start + 1, t.iterations + 1):
        result.iteration = iteration
        done = _one_iteration(run, iteration, requests)
        counted += done.report.count
        if iteration % run.config.logging.log_interval == 0 or iteration == t.iterations:
            result.metrics = _metrics(run, done, counted / max(time.perf_counter() - tic, 1e-9),
                                      time.perf_counter() - tic)  # fmt: skip
            tau_sample = done.stats.tau_sample() if done.stats.tau_sample is not None else None
            run.run_log.log(iteration, result.metrics, tau_sample)
            tic, counted = time.perf_counter(), 0.0
        if run.data.valid is not None and _should_validate(iteration, run.config, run.task):
            with run.hooks.validation():
                run.run_log.log(iteration, run.task.validate(run.engine, run.config, run.data))
        if done.report.stop_flags is not None:
            result.stopped = requests.decide(done.report.stop_flags)
        # Megatron-LM's rule: a checkpoint before the ramp changes the number of micro-batches
        consumed = run.loader.state().consumed_samples
        ramps = run.schedule.batches.batch_size(consumed) != done.batch
        if ckpt.save and (result.stopped or _should_save(iteration, run.config) or ramps):
            _save(run, iteration)
        if _ends(result, iteration, ckpt):
            break
    return result


def _one_iteration(run: _Run, iteration: int, requests: StopRequests) -> _Iteration:
    """The step on this iteration's micro-batches, the schedule around it, and its statistics
    and the ranks' stop requests read in the iteration's one wait for the device."""
    t, ckpt = run.config.training, run.config.checkpoint
    run.hooks.before(iteration)
    batch = run.schedule.begin(iteration, run.loader.state().consumed_samples)
    run.engine.set_train_batch_size(batch)  # the number of micro-batches (--rampup-batch-size)
    rates = run.schedule.set_learning_rates(run.optimizer)
    per_micro_batch = t.micro_batch_size * parallel_state.get_data_parallel_world_size()
    stats = run.step([next(run.loader) for _ in range(batch // per_micro_batch)])
    if iteration == run.start + 1:
        run.checkpointer.prepare_async()  # --async-save's host copies, once every value exists
    # collective: all ranks stop together
    stop = requests.flags(compute_device()) if ckpt.save and iteration < t.iterations else None
    report = read_step(stats, stop)
    overflow = t.fp16 and not stats.applied  # the loss scale is lowered, the step skipped
    check_finite(report.metrics, report.grad_norm, iteration, overflow)
    run.hooks.after(iteration)
    run.schedule.end(applied=not overflow)  # a skipped step does not advance the schedule
    if overflow:
        log_rank0("iteration %d: fp16 overflow, the optimizer step was skipped", iteration)
    return _Iteration(batch, rates, stats, report)


def _metrics(run: _Run, done: _Iteration, throughput: float, seconds: float) -> dict:
    """The logged metrics of an iteration: the step's, the learning rates, the gradient norm,
    throughput (``done.stats.unit`` per second since the last log line), the hooks' (MFU), memory
    and the data position."""
    consumed = run.loader.state().consumed_samples
    return {
        **done.report.metrics,
        **done.rates,
        "grad_norm": done.report.grad_norm,
        f"{done.stats.unit}_per_sec": throughput,
        **run.hooks.metrics(consumed, seconds),
        "memory_mb": memory_mb(),
        "consumed_samples": consumed,
        "global_batch_size": done.batch,
    }


def _ends(result: RunResult, iteration: int, ckpt) -> bool:
    """Whether the run ends after ``iteration``: a stop request (at its checkpoint) or
    --exit-interval."""
    if result.stopped:
        log_rank0(
            "%s: stopped after iteration %d at a checkpoint; exit status %d asks for a requeue",
            result.stopped,
            iteration,
            EXIT_REQUEUE,
        )
        return True
    if ckpt.exit_interval and iteration == ckpt.exit_interval:
        log_rank0("--exit-interval %d reached: exiting", iteration)
        return True
    return False


def _lock_save_dir(config: RunConfig) -> RunLock | None:
    """Rank 0 takes ``--save``'s lock; every rank stops when another run holds it."""
    if not config.checkpoint.save:
        return None
    lock, error = None, [None]
    if dist.get_rank() == 0:
        try:
            lock = RunLock(config.checkpoint.save).acquire()
        except CheckpointError as e:
            error = [str(e)]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(error[0])
    return lock


def _should_validate(iteration: int, config: RunConfig, task: Task) -> bool:
    t = config.training
    if task.evaluate_at_end and iteration == t.iterations:
        return True
    return bool(t.eval_interval and iteration % t.eval_interval == 0)


def _should_save(iteration: int, config: RunConfig) -> bool:
    ckpt, end = config.checkpoint, config.training.iterations
    periodic = ckpt.save_interval and iteration % ckpt.save_interval == 0
    return bool(periodic or iteration == end or iteration == ckpt.exit_interval)


def _resume(checkpointer: Checkpointer, data: TaskData) -> tuple[int, DataState, dict | None]:
    """The iteration, data position and schedule state to start from (0, the start and None
    without a checkpoint to resume)."""
    start, data_state = 0, DataState(0, dataset_fingerprint(data.train))
    client = checkpointer.resume()
    if client is None:
        return start, data_state, None
    data_state = DataState.from_state_dict(client["data"], data.train)
    if data.rank_state is not None and "rank_states" in client:  # another layout
        data.rank_state.load_state_dicts(client["rank_states"])
    elif data.rank_state is not None:
        data.rank_state.load_state_dict(client.get("rank_state"))
    return int(client["iteration"]), data_state, client.get("schedule")


def _save(run: _Run, iteration: int) -> None:
    client = {
        "data": run.loader.state().state_dict(),
        "schedule": run.schedule.state_dict(run.optimizer),
        "config": json.loads(run.config.to_json()),
    }
    rank_state = None if run.data.rank_state is None else run.data.rank_state.state_dict()
    run.checkpointer.save(iteration, client, rank_state)


def _save_config(config: RunConfig) -> None:
    """The resolved config beside the checkpoints (and inside each of them), also as flag values
    that ``--yaml-cfg`` reads back."""
    if config.checkpoint.save and dist.get_rank() == 0:
        os.makedirs(config.checkpoint.save, exist_ok=True)
        with open(os.path.join(config.checkpoint.save, CONFIG), "w") as f:
            f.write(config.to_json())
        header = "The resolved flags of this run: rerun it with --yaml-cfg FILE (flags win)."
        with open(os.path.join(config.checkpoint.save, CONFIG_YAML), "w") as f:
            f.write(config_yaml(config, header))
