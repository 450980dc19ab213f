"""The pretraining run, top to bottom: set up, resume, iterate, evaluate, log, save.

One loop for every model: what differs between GPT/LLaMA and CLIP (data, module, step,
validation, per-rank state) is a *task* (``GPTTask`` here, ``CLIPTask`` in ``clip_task``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist

from megatron_tempnet.data.gpt_data import (
    DataState,
    ResumableLoader,
    build_gpt_datasets,
    dataset_fingerprint,
    num_samples,
)
from megatron_tempnet.data.tokenizers import build_tokenizer
from megatron_tempnet.distributed.launch import launch_environment
from megatron_tempnet.training.checkpoint import latest_tag, load_checkpoint, save_checkpoint
from megatron_tempnet.training.config import RunConfig, validate
from megatron_tempnet.training.engine import (
    build_engine,
    build_module,
    deepspeed_clips,
    init_process_groups,
    set_learning_rates,
)
from megatron_tempnet.training.metrics import RunLogger, memory_mb
from megatron_tempnet.training.preemption import EXIT_REQUEUE, StopRequests
from megatron_tempnet.training.step import check_finite, compute_device, evaluate, train_step
from megatron_tempnet.utils.logging import log_rank0


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


class GPTTask:
    """GPT/LLaMA pretraining: indexed token datasets, the LM (+ TempNet), token losses."""

    def prepare(self, config: RunConfig, world_size: int) -> None:
        """Fill what the data decides (the vocabulary) and check every flag."""
        self.tokenizer = build_tokenizer(**config.tokenizer)
        if config.model.vocab_size is None:
            config.model.vocab_size = self.tokenizer.vocab_size
        validate(config, world_size)

    def build_data(self, config: RunConfig):
        t = config.training
        sizes = num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)
        train_ds, valid_ds, _ = build_gpt_datasets(config.data, self.tokenizer, sizes)
        return train_ds, valid_ds

    def build_module(self, config: RunConfig, train_ds):
        return build_module(config)

    def step_function(self, engine, optimizer, config: RunConfig, dp_group):
        return _step_function(engine, optimizer, config, dp_group)

    def validate(self, engine, valid_ds, config: RunConfig, world_size: int, dp_group) -> dict:
        return _validate(engine, valid_ds, config, world_size, dp_group)

    def rank_state(self) -> dict | None:
        """What this rank saves beside its RNG state (none for GPT)."""
        return None

    def load_rank_state(self, state: dict | None) -> None:
        pass


def pretrain(config, task=None) -> RunResult:
    """Train as configured, or until a stop request (a checkpoint is written, then it returns)."""
    task = task or GPTTask()
    requests = StopRequests(config.checkpoint.exit_duration_in_mins)
    os.environ.update(launch_environment(os.environ))  # torchrun, srun, or a lone process
    world_size = int(os.environ["WORLD_SIZE"])
    task.prepare(config, world_size)  # every flag checked before anything is built

    init_process_groups(config)
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp = (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )
    t = config.training
    train_ds, valid_ds = task.build_data(config)

    engine, optimizer = build_engine(task.build_module(config, train_ds), config, world_size)
    start, data_state = _resume(engine, config, train_ds, task)
    ckpt = config.checkpoint
    _save_config(config)
    loader = ResumableLoader(train_ds, data_state, t.micro_batch_size, dp_rank, dp)
    gas = config.gradient_accumulation_steps(world_size)
    run_log = RunLogger(config.logging)
    step = task.step_function(engine, optimizer, config, dp_group)
    if ckpt.save:  # without somewhere to save, a signal keeps its usual meaning
        requests.install()
    result = RunResult({}, start)
    tic, counted = time.perf_counter(), 0.0
    for iteration in range(start + 1, t.train_iters + 1):
        result.iteration = iteration
        lr = set_learning_rates(optimizer, iteration - 1, config.optimizer)
        batches = [next(loader) for _ in range(gas)]
        stats, grad_norm = step(batches)
        check_finite(stats, grad_norm, iteration)
        counted += stats.count
        if iteration % config.logging.log_interval == 0 or iteration == t.train_iters:
            throughput = counted / max(time.perf_counter() - tic, 1e-9)
            result.metrics = {**stats.metrics(), "lr": lr, "grad_norm": grad_norm,
                              f"{stats.unit}_per_sec": throughput, "memory_mb": memory_mb(),
                              "consumed_samples": loader.state().consumed_samples}  # fmt: skip
            run_log.log(iteration, result.metrics, stats.tau_sample)
            tic, counted = time.perf_counter(), 0.0
        if valid_ds is not None and _should_validate(iteration, config):
            run_log.log(iteration, task.validate(engine, valid_ds, config, world_size, dp_group))
        if ckpt.save and iteration < t.train_iters:  # collective: all ranks stop together
            result.stopped = requests.agreed(compute_device())
        if ckpt.save and (result.stopped or _should_save(iteration, config)):
            save_checkpoint(engine, ckpt.save, iteration, _client_state(config, loader),
                            ckpt.keep_last, exclude_frozen=_frozen_lm_excluded(config),
                            rank_state=task.rank_state())  # fmt: skip
        if result.stopped:
            log_rank0("%s: stopped after iteration %d at a checkpoint; exit status %d asks for "
                      "a requeue", result.stopped, iteration, EXIT_REQUEUE)  # fmt: skip
            break
        if ckpt.exit_interval and iteration == ckpt.exit_interval:
            log_rank0("--exit-interval %d reached: exiting", iteration)
            break
    if not result.stopped:
        # a stopped run keeps ignoring SIGTERM until it exits: srun --kill-on-bad-exit sends it
        # to the ranks still shutting down when the first one exits with EXIT_REQUEUE
        requests.restore()
    run_log.close()
    dist.barrier()
    return result


def _should_validate(iteration: int, config) -> bool:
    t = config.training
    if getattr(config, "eval_at_end", False) and iteration == t.train_iters:
        return True
    return bool(t.eval_interval and iteration % t.eval_interval == 0)


def _step_function(engine, optimizer, config: RunConfig, dp_group):
    """``step(batches) -> (stats, grad_norm)`` for this layout (one process or a pipeline)."""
    from megatron.core import parallel_state

    own_clip = None if deepspeed_clips(config) else config.optimizer.clip_grad
    if config.parallel.pipeline_model_parallel_size == 1:
        return partial(train_step, engine, dp_group=dp_group, clip_grad=own_clip)
    from megatron_tempnet.training.pipeline import NormRecorder, pipeline_train_step

    norm = None if own_clip is None else NormRecorder(optimizer, own_clip)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    return partial(pipeline_train_step, engine, dp_group=dp_group, pp_group=pp_group, norm=norm)


def _resume(engine, config, train_ds, task) -> tuple[int, DataState]:
    """The iteration and data position to start from (0 and the start without --load)."""
    ckpt = config.checkpoint
    start, data_state = 0, DataState(0, dataset_fingerprint(train_ds))
    fresh = ckpt.load and latest_tag(ckpt.load) is None
    if ckpt.pretrained_checkpoint and (fresh or _frozen_lm_excluded(config)):
        # a fresh run starts from these weights; a frozen-LM run re-reads its LM every time
        log_rank0("%s: loading --pretrained-checkpoint %s",
                  "no checkpoint in --load yet" if fresh else "the frozen LM",
                  ckpt.pretrained_checkpoint)  # fmt: skip
        load_checkpoint(engine, ckpt.pretrained_checkpoint, weights_only=True,
                        load_optimizer=False, flag="--pretrained-checkpoint")  # fmt: skip
    if ckpt.load and not (fresh and ckpt.pretrained_checkpoint):
        client = load_checkpoint(engine, ckpt.load, weights_only=ckpt.finetune,
                                 load_optimizer=not ckpt.no_load_optim,
                                 lm_loaded=_frozen_lm_excluded(config))  # fmt: skip
        if client is not None:
            start = int(client["iteration"])
            data_state = DataState.from_state_dict(client["data"], train_ds)
            task.load_rank_state(client.get("rank_state"))
    return start, data_state


def _frozen_lm_excluded(config) -> bool:
    """Checkpoints leave out the frozen LM: it can always be read from --pretrained-checkpoint.
    (ZeRO-3 keeps every parameter in its partitions: those checkpoints stay whole.)"""
    ckpt = config.checkpoint
    return bool(config.training.freeze_lm and ckpt.pretrained_checkpoint
                and config.parallel.zero_stage < 3)  # fmt: skip


def _should_save(iteration: int, config) -> bool:
    ckpt, end = config.checkpoint, config.training.train_iters
    periodic = ckpt.save_interval and iteration % ckpt.save_interval == 0
    return bool(periodic or iteration == end or iteration == ckpt.exit_interval)


def _client_state(config, loader: ResumableLoader) -> dict:
    return {"data": loader.state().state_dict(), "config": json.loads(config.to_json())}


def _validate(engine, valid_ds, config: RunConfig, world_size: int, dp_group) -> dict:
    """The first --eval-iters global batches of the validation split, every time."""
    from megatron.core import parallel_state

    t = config.training
    state = DataState(0, dataset_fingerprint(valid_ds))
    loader = ResumableLoader(valid_ds, state, t.micro_batch_size,
                             parallel_state.get_data_parallel_rank(),
                             parallel_state.get_data_parallel_world_size())  # fmt: skip
    gas = config.gradient_accumulation_steps(world_size)
    batches = [next(loader) for _ in range(t.eval_iters * gas)]
    if config.parallel.pipeline_model_parallel_size > 1:
        from megatron_tempnet.training.pipeline import pipeline_evaluate

        pp_group = parallel_state.get_pipeline_model_parallel_group()
        return pipeline_evaluate(engine, batches, dp_group=dp_group, pp_group=pp_group)
    return evaluate(engine, batches, dp_group=dp_group)


def _save_config(config) -> None:
    """The resolved config beside the checkpoints (and inside each of them)."""
    if config.checkpoint.save and dist.get_rank() == 0:
        os.makedirs(config.checkpoint.save, exist_ok=True)
        with open(os.path.join(config.checkpoint.save, "config.json"), "w") as f:
            f.write(config.to_json())
