"""What the loop does around its iterations for Megatron-LM's profiling and logging flags.

- ``IterationProfiler`` (--profile, --profile-step-start/-end, --profile-ranks,
  --use-pytorch-profiler): iterations ``start ... end - 1`` (1-based, as logged) on the chosen
  ranks, recorded by torch.profiler into one TensorBoard trace (``tensorboard_trace_handler``,
  ``{host}_rank{r}.{time}.pt.trace.json`` in --tensorboard-dir, each iteration a
  ``ProfilerStep#{iteration}``), or bracketed for nsys by the CUDA profiler's start and stop and
  NVTX ranges of the autograd operations.
- ``ManualGC`` (--manual-gc, --manual-gc-interval, --no-manual-gc-eval): Python's automatic
  collector off for the run, collections at fixed iterations (the same on every rank, so that no
  rank stalls a collective while it collects), around validation, and the collector back on at
  the end.
- ``tflops_per_gpu`` (--log-throughput): the model's training FLOPs over a logging interval per
  second and GPU, from the samples the loader handed out (no device synchronisation).

None of them reads the device: profiling waits for nothing, and the loop's one host
synchronisation per iteration (``stats.read_step``) stays the only one.
"""

from __future__ import annotations

import contextlib
import gc
import socket

import torch

from megatron_tempnet.trainer.config import ConfigError, LoggingConfig, RunConfig, TrainingConfig
from megatron_tempnet.utils.logging import log_rank0


class IterationProfiler:
    """Profiles the configured iterations on this rank (a no-op where nothing is asked)."""

    def __init__(self, config: LoggingConfig, rank: int):
        self.on = config.profile and rank in config.profile_ranks
        self.first, self.last = max(config.profile_step_start, 1), config.profile_step_end - 1
        self.pytorch = config.use_pytorch_profiler
        self.directory, self.rank = config.tensorboard_dir, rank
        self._prof = self._nvtx = None
        self._started = False

    def begin(self, iteration: int) -> None:
        """Call before iteration ``iteration`` (1-based) runs. torch.profiler starts one
        iteration early, a warm-up it does not record (as Megatron-LM's schedule does); a run
        resumed inside the profiled iterations profiles those left, one resumed past them
        nothing."""
        early = self.pytorch and self.first > 1
        if not self.on or self._started or not self.first - early <= iteration <= self.last:
            return
        self._started = True
        if self.pytorch:
            self._prof = self._pytorch_profiler(iteration)
            self._prof.start()
        elif torch.cuda.is_available():
            torch.cuda.profiler.start()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()
        else:
            log_rank0("--profile without --use-pytorch-profiler marks iterations for nsys on a GPU")

    def end(self, iteration: int) -> None:
        """Call after iteration ``iteration`` ran (its statistics read)."""
        if self._prof is not None:
            self._prof.step()  # after the last recorded iteration, the schedule saves the trace
        if iteration >= self.last:
            self.close()

    def close(self) -> None:
        """Stop a profile still running (the run ended inside the profiled iterations)."""
        if self._prof is not None:
            self._prof.stop()  # writes the trace
            log_rank0("--profile: torch.profiler trace written to %s", self.directory)
            self._prof = None
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            torch.cuda.profiler.stop()
            self._nvtx = None

    def _pytorch_profiler(self, iteration: int):
        """A profiler whose step ``iteration`` is this iteration: a warm-up step before
        ``first``, then the recorded ones up to ``last``."""
        warmup = max(self.first - iteration, 0)
        active = self.last - max(iteration, self.first) + 1
        schedule = torch.profiler.schedule(
            skip_first=iteration, wait=0, warmup=warmup, active=active, repeat=1
        )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(
            self.directory, worker_name=f"{socket.gethostname()}_rank{self.rank}"
        )
        prof = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=handler,
            record_shapes=True,
            with_stack=True,
        )
        # each iteration's step (ProfilerStep#) is its number, and so is the schedule's
        prof.step_num, prof.current_action = iteration, schedule(iteration)
        return prof


class ManualGC:
    """Python's garbage collection at fixed points of the run (--manual-gc)."""

    def __init__(self, config: TrainingConfig):
        self.on, self.interval = config.manual_gc, config.manual_gc_interval
        self.around_eval = config.manual_gc_eval
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.on:
            gc.disable()
            gc.collect()

    def after_iteration(self, iteration: int) -> None:
        if self.on and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def validation(self):
        """Collect everything before a validation run and its own young objects after it."""
        if self.on and self.around_eval:
            gc.collect()
        yield
        if self.on and self.around_eval:
            gc.collect(generation=0)

    def stop(self) -> None:
        if self.on and self._was_enabled:
            gc.enable()


class RunHooks:
    """The loop's calls for the flags above, in one object: ``start`` before the first iteration,
    ``before``/``after`` around each, ``metrics`` at each log line, ``validation`` around each
    validation run, ``close`` at the end."""

    def __init__(
        self, config: RunConfig, flops_per_sample: float | None, world_size: int, samples: int
    ):
        """``flops_per_sample``: the model's training FLOPs per sample (None: no count, and
        --log-throughput is refused); ``samples``: the data position the run starts from."""
        import torch.distributed as dist

        if config.logging.log_throughput and flops_per_sample is None:
            raise ConfigError("--log-throughput: this model has no FLOP count (GPT models only)")
        self.profiler = IterationProfiler(config.logging, dist.get_rank())
        self.gc = ManualGC(config.training)
        self.empty_cache_level = config.training.empty_unused_memory_level
        self.flops = flops_per_sample if config.logging.log_throughput else None
        self.world_size, self.samples = world_size, samples

    def start(self) -> None:
        self.gc.start()

    def before(self, iteration: int) -> None:
        self.profiler.begin(iteration)

    def after(self, iteration: int) -> None:
        self.profiler.end(iteration)
        self.gc.after_iteration(iteration)
        self._empty_cache(1)

    def metrics(self, samples: int, seconds: float) -> dict[str, float]:
        """``tflops_per_gpu`` since the previous log line (``samples``: the data position now,
        ``seconds`` since that line), with --log-throughput."""
        done, self.samples = samples - self.samples, samples
        if self.flops is None:
            return {}
        return {"tflops_per_gpu": tflops_per_gpu(self.flops, done, seconds, self.world_size)}

    @contextlib.contextmanager
    def validation(self):
        with self.gc.validation():
            yield
        self._empty_cache(2)

    def _empty_cache(self, level: int) -> None:
        """--empty-unused-memory-level: give the caching allocator's free blocks back."""
        if self.empty_cache_level >= level and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.profiler.close()
        self.gc.stop()


def tflops_per_gpu(flops_per_sample: float, samples: int, seconds: float, world_size: int) -> float:
    """Training TFLOP/s per GPU: ``samples`` samples of ``flops_per_sample`` FLOPs each (forward
    and backward) in ``seconds`` on ``world_size`` GPUs (Megatron-LM's throughput)."""
    return flops_per_sample * samples / (max(seconds, 1e-9) * 1e12 * world_size)
