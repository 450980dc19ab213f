"""The checks of a run's shared flags, done once before any model is built (``validate_run``);
a model family adds its own (``models/*/task.py``). Each error names the flags, their values and
the fix; derived defaults (the global batch, the run's length in samples) are filled here."""

from __future__ import annotations

import importlib.util
import math
import os

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError, latest_tag
from megatron_tempnet.trainer.config import (
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    CheckpointConfig,
    LoggingConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from megatron_tempnet.trainer.errors import ConfigError
from megatron_tempnet.trainer.schedule import (
    validate_schedule,
)
from megatron_tempnet.utils.logging import warn_rank0


def validate_run(config: RunConfig, world_size: int) -> None:
    """The checks of the layout, batch, precision, optimizer and checkpoint flags; fills the
    derived defaults (global batch size, decay length, warmup)."""
    p, t, o = config.parallel, config.training, config.optimizer
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage ({p.zero_stage}) must be 0, 1, 2 or 3")
    if p.zero_stage >= 2 and pp > 1:
        raise ConfigError(
            f"--zero-stage {p.zero_stage} cannot shard gradients across pipeline stages "
            f"(--pipeline-model-parallel-size {pp}): use --zero-stage 0 or 1 with PP > 1"
        )
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ConfigError(
            f"the world size ({world_size}) must be a multiple of --tensor-model-parallel-size "
            f"({tp}) x --pipeline-model-parallel-size ({pp})"
        )
    if p.sequence_parallel and tp == 1:
        # as Megatron-LM: the numbers of a TP-1 run do not change with the flag
        _warn_once("--sequence-parallel is off: it needs --tensor-model-parallel-size > 1")
        p.sequence_parallel = False
    dp = world_size // (tp * pp)
    if t.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size ({t.micro_batch_size}) must be >= 1")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size ({t.global_batch_size}) must be a multiple of "
            f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size ({dp})"
        )
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive")
    _check_loss_scaling(t)
    if t.num_workers < 0:
        raise ConfigError(f"--num-workers ({t.num_workers}) must be >= 0")
    validate_schedule(o, t, dp)
    _validate_recompute(t)
    _validate_checkpointing(config.checkpoint)
    _validate_logging(config.logging)
    _validate_communication(p, t)
    _validate_profiling(config.logging, world_size)


def _validate_recompute(t: TrainingConfig) -> None:
    """Megatron-LM's rules: --recompute-activations is selective; full needs a method and a
    number of layers; selective takes neither."""
    if t.recompute_activations:
        if t.recompute_granularity not in (None, "selective"):
            raise ConfigError(
                "--recompute-activations is --recompute-granularity selective: it contradicts "
                f"--recompute-granularity {t.recompute_granularity}"
            )
        t.recompute_granularity = "selective"
    granularity, method, layers = (
        t.recompute_granularity,
        t.recompute_method,
        t.recompute_num_layers,
    )
    if granularity not in (None, *RECOMPUTE_GRANULARITIES):
        raise ConfigError(f"--recompute-granularity {granularity!r}: expected full or selective")
    if method not in (None, *RECOMPUTE_METHODS):
        raise ConfigError(f"--recompute-method {method!r}: expected uniform or block")
    if granularity is None and (method is not None or layers is not None):
        raise ConfigError(
            "--recompute-method and --recompute-num-layers need --recompute-granularity full"
        )
    if granularity == "full" and (method is None or layers is None):
        raise ConfigError(
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers"
        )
    if granularity == "full" and layers < 1:
        raise ConfigError(f"--recompute-num-layers ({layers}) must be >= 1")
    if granularity == "selective" and (method is not None or layers is not None):
        raise ConfigError(
            "--recompute-granularity selective recomputes the core attention of every layer: "
            "--recompute-method and --recompute-num-layers are for --recompute-granularity full"
        )


def _warn_once(message: str) -> None:
    """A warning from the launcher's rank 0 (the flags are checked before torch.distributed
    starts)."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        warn_rank0("%s", message)


def _validate_checkpointing(ckpt: CheckpointConfig) -> None:
    if ckpt.exit_interval and not ckpt.save:
        raise ConfigError("--exit-interval saves a checkpoint before exiting: give --save")
    if ckpt.exit_duration_in_mins < 0:
        raise ConfigError(f"--exit-duration-in-mins ({ckpt.exit_duration_in_mins:g}) must be >= 0")
    if ckpt.exit_duration_in_mins and not ckpt.save:
        raise ConfigError("--exit-duration-in-mins saves a checkpoint before exiting: give --save")
    if not ckpt.checkpoint_timeout_minutes > 0:
        minutes = ckpt.checkpoint_timeout_minutes
        raise ConfigError(f"--checkpoint-timeout-minutes ({minutes:g}) must be > 0")
    if ckpt.pretrained_checkpoint and ckpt.finetune:
        raise ConfigError(
            "--pretrained-checkpoint and --finetune both choose the starting weights: "
            "use --pretrained-checkpoint DIR with --load/--save RUN_DIR (resumes when requeued)"
        )
    for flag, given in (
        ("--exit-on-missing-checkpoint", ckpt.exit_on_missing_checkpoint),
        ("--use-checkpoint-args", ckpt.use_checkpoint_args),
        ("--no-load-rng", ckpt.no_load_rng),
    ):
        if given and not ckpt.load:
            raise ConfigError(f"{flag} is about the checkpoint in --load: give --load")
    if ckpt.exit_on_missing_checkpoint and latest_tag(ckpt.load) is None:
        raise CheckpointError(
            f"--load {ckpt.load}: no checkpoint there (no 'latest'), and "
            "--exit-on-missing-checkpoint stops the run instead of starting from scratch"
        )
    if ckpt.pretrained_checkpoint and not ckpt.load:
        raise ConfigError(
            f"--pretrained-checkpoint {ckpt.pretrained_checkpoint} is used only while --load "
            "holds no checkpoint: give --load (usually the same directory as --save)"
        )


def _validate_communication(p: ParallelConfig, t: TrainingConfig) -> None:
    """The overlap, timeout and garbage-collection flags; --bf16 at ZeRO 0 becomes ZeRO 1
    (float32 gradient accumulation needs DeepSpeed's bf16 optimizer, see --grad-reduce-in-bf16)."""
    if p.distributed_timeout_minutes < 1:
        raise ConfigError(
            f"--distributed-timeout-minutes ({p.distributed_timeout_minutes}) must be >= 1"
        )
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce")
    if p.overlap_param_gather and p.zero_stage == 0:
        raise ConfigError(
            "--overlap-param-gather overlaps the gather of sharded parameters: it needs a "
            "sharded optimizer (--zero-stage 1, 2 or 3, or --use-distributed-optimizer)"
        )
    if t.bf16 and not t.grad_reduce_in_bf16 and p.zero_stage == 0:
        _warn_once(
            "--bf16 at --zero-stage 0 runs at ZeRO 1: DeepSpeed accumulates and reduces the "
            "gradients in float32 with its bf16 optimizer only (--grad-reduce-in-bf16 keeps "
            "ZeRO 0, in bfloat16)"
        )
        p.zero_stage = 1
    if t.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval ({t.manual_gc_interval}) must be >= 0")


def _validate_profiling(log: LoggingConfig, world_size: int) -> None:
    if log.use_pytorch_profiler and not log.profile:
        raise ConfigError(
            "--use-pytorch-profiler chooses the profiler of --profile: give --profile"
        )
    if not log.profile:
        return
    if not 0 <= log.profile_step_start < log.profile_step_end:
        raise ConfigError(
            f"--profile-step-start ({log.profile_step_start}) must be >= 0 and < "
            f"--profile-step-end ({log.profile_step_end})"
        )
    outside = [r for r in log.profile_ranks if not 0 <= r < world_size]
    if outside:
        raise ConfigError(
            f"--profile-ranks {' '.join(map(str, log.profile_ranks))}: rank(s) {outside} are not "
            f"among the {world_size} ranks of this run"
        )
    if log.use_pytorch_profiler and not log.tensorboard_dir:
        raise ConfigError(
            "--use-pytorch-profiler writes its trace to --tensorboard-dir: give --tensorboard-dir"
        )


def _validate_logging(log: LoggingConfig) -> None:
    if log.log_interval < 1:
        raise ConfigError(f"--log-interval ({log.log_interval}) must be >= 1")
    wandb_only = {
        "--wandb-exp-name": log.wandb_exp_name,
        "--wandb-save-dir": log.wandb_save_dir,
        "--wandb-entity": log.wandb_entity,
    }
    given = [flag for flag, value in wandb_only.items() if value]
    if given and not log.wandb_project:
        raise ConfigError(f"{', '.join(given)} without --wandb-project: give the W&B project")
    if log.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"--wandb-project {log.wandb_project} needs the wandb package: "
            "pip install 'megatron-tempnet[wandb]' (or pip install wandb)"
        )


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _check_loss_scaling(t) -> None:
    """fp16's loss-scale flags as DeepSpeed takes them (powers of 2 for the scales)."""
    if t.loss_scale is not None and not _is_power_of_two(t.loss_scale):
        raise ConfigError(f"--loss-scale ({t.loss_scale:g}) must be a positive power of 2")
    if not _is_power_of_two(t.initial_loss_scale):
        raise ConfigError(
            f"--initial-loss-scale ({t.initial_loss_scale:g}) must be a positive power of 2"
        )
    for flag, value in (
        ("--min-loss-scale", t.min_loss_scale),  # DeepSpeed's scaler takes whole numbers
        ("--loss-scale-window", t.loss_scale_window),
        ("--hysteresis", t.hysteresis),
    ):
        if value < 1 or value != int(value):
            raise ConfigError(f"{flag} ({value:g}) must be a whole number >= 1")
