"""What every run is configured with: layout, optimizer, training, checkpoints, logging.

One dataclass per concern; each field is also its command-line flag (Megatron-LM's name) and its
docstring the flag's help (``utils.flags``). A model family's run config (``GPTRunConfig``,
``CLIPRunConfig``) adds its model, objective and data configs to ``RunConfig``. Defaults follow
the paper's Table 5 (AdamW betas 0.9/0.95, eps 1e-8, weight decay 0.1, 1% warmup, cosine decay).
Everything is checked once, before any model is built (``validate_run`` here, then the family's
own checks).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field

import torch

from megatron_tempnet.utils.cli import UserError
from megatron_tempnet.utils.flags import option

DEFAULT_WARMUP_FRACTION = 0.01
"""Warmup as a fraction of the decay when neither warmup flag is given (the paper's Table 5)."""


class ConfigError(UserError, ValueError):
    """Flags that cannot work together; the message names them, their values and the fix."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Ranks that split every layer (attention heads, MLP columns, the vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (DeepSpeed's pipeline engine); the layers are divided evenly."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage over the data-parallel ranks (0-1 with pipeline parallelism)."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON file as the base of the engine's config; the flags given here win."""


@dataclass
class OptimizerConfig:
    lr: float = 6e-4
    """Peak learning rate of the model (linear warmup, then cosine decay)."""
    min_lr: float = 0.0
    """Floor of the cosine decay."""
    lr_warmup_fraction: float | None = None
    """Warmup as a fraction of --lr-decay-iters (default: 0.01, the paper's, unless
    --lr-warmup-iters is given)."""
    lr_warmup_iters: int = 0
    """Warmup iterations (used when --lr-warmup-fraction is not given)."""
    lr_decay_iters: int | None = None
    """Length of the cosine decay (default: --train-iters)."""
    weight_decay: float = 0.1
    """AdamW weight decay of the weights (biases and norms have none)."""
    adam_beta1: float = 0.9
    """AdamW's beta1."""
    adam_beta2: float = 0.95
    """AdamW's beta2."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    clip_grad: float = 1.0
    """Scale the gradients down to this global norm when it is larger (0 = no clipping)."""


@dataclass
class TrainingConfig:
    train_iters: int
    """Iterations (optimizer steps) of the run."""
    micro_batch_size: int = 1
    """Samples per data-parallel rank per forward pass."""
    global_batch_size: int | None = None
    """Samples per iteration (default: micro batch x data-parallel size); the number of
    accumulated micro-batches follows."""
    eval_interval: int = 1000
    """Iterations between validation runs (0 = never)."""
    eval_iters: int = 10
    """Validation iterations (global batches) per run."""
    seed: int = 1234
    """Seeds the initial weights, dropout and the data order (the same whatever the layout)."""
    bf16: bool = False
    """Train in bfloat16 (DeepSpeed's bf16 optimizer keeps float32 master weights)."""
    fp16: bool = False
    """Train in float16 with loss scaling (GPU only)."""
    recompute_activations: bool = False
    """Recompute every layer's activations in the backward pass (less memory, more compute)."""
    num_workers: int = 2
    """Data-loader worker processes per rank reading (and for CLIP decoding and augmenting) the
    training samples ahead of the step; 0 reads them in the training process. The batches are
    the same either way."""

    @property
    def params_dtype(self) -> torch.dtype:
        """The model's parameter dtype for --bf16 / --fp16 (float32 otherwise)."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32


@dataclass
class CheckpointConfig:
    save: str | None = None
    """Checkpoint directory; a checkpoint is written at --save-interval, at the end and on a stop
    request (SIGTERM, SIGUSR1, --exit-duration-in-mins)."""
    save_interval: int = 0
    """Iterations between checkpoints (0 = only at the end and on exit)."""
    load: str | None = None
    """Resume from this directory's latest checkpoint (if it has one)."""
    finetune: bool = False
    """Load the weights of --load only: a fresh optimizer, schedule and data position."""
    no_load_optim: bool = False
    """Do not restore the optimizer state from --load."""
    exit_interval: int = 0
    """Save a checkpoint and exit after this iteration (0 = never)."""
    exit_duration_in_mins: float = 0.0
    """After this many minutes, save a checkpoint and exit with status 75 (requeue; 0 = never)."""
    pretrained_checkpoint: str | None = None
    """Weights to start from while --load holds no checkpoint yet; once it does, the run resumes
    from --load (one command line for the first start and every requeue)."""
    keep_last: int = 0
    """Delete older checkpoints, keeping the newest N complete ones (0 = keep all); the older
    ones go only once the new one is complete."""
    load_fallback: bool = False
    """When the newest checkpoint of --load (or --pretrained-checkpoint) is damaged (a file
    missing, truncated or altered since its save), load the newest older one that is valid
    instead of stopping."""


@dataclass
class LoggingConfig:
    log_interval: int = 10
    """Iterations between log lines (console, TensorBoard, metrics file)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars and tau histograms here."""
    metrics_file: str | None = None
    """Append one JSON object per logged iteration (and per validation) to this file; a resumed
    run first drops the rows past the iteration it resumes from."""
    wandb_project: str | None = None
    """Log to this Weights & Biases project too (what TensorBoard gets, and the resolved config);
    needs the ``wandb`` package. WANDB_MODE=offline keeps the run in --wandb-save-dir."""
    wandb_exp_name: str | None = None
    """The W&B run's name (default: W&B's generated one)."""
    wandb_save_dir: str | None = None
    """Where W&B writes its run directory (default: W&B's, ./wandb)."""
    wandb_entity: str | None = None
    """The W&B team or user the project belongs to (default: the logged-in user's)."""


@dataclass(kw_only=True)
class RunConfig:
    """The configs every family's run has; a family adds its own (model, objective, data)."""

    training: TrainingConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    preset: str | None = option(None, name="--model")
    """The ``--model`` preset the architecture started from (the model's flags override it)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    def gradient_accumulation_steps(self, world_size: int) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.data_parallel_size(world_size))


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
    if t.num_workers < 0:
        raise ConfigError(f"--num-workers ({t.num_workers}) must be >= 0")
    if t.train_iters < 1:
        raise ConfigError(f"--train-iters ({t.train_iters}) must be >= 1")
    _validate_schedule(o, t)
    _validate_checkpointing(config.checkpoint)
    _validate_logging(config.logging)


def _validate_schedule(o: OptimizerConfig, t: TrainingConfig) -> None:
    if o.lr_decay_iters is None:
        o.lr_decay_iters = t.train_iters
    if o.lr_warmup_fraction is None and not o.lr_warmup_iters:
        o.lr_warmup_fraction = DEFAULT_WARMUP_FRACTION
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr ({o.min_lr}) must be <= --lr ({o.lr})")
    if o.lr_warmup_fraction is not None and not 0 <= o.lr_warmup_fraction <= 1:
        raise ConfigError(f"--lr-warmup-fraction ({o.lr_warmup_fraction}) must be in [0, 1]")


def _validate_checkpointing(ckpt: CheckpointConfig) -> None:
    if ckpt.exit_interval and not ckpt.save:
        raise ConfigError("--exit-interval saves a checkpoint before exiting: give --save")
    if ckpt.exit_duration_in_mins < 0:
        raise ConfigError(f"--exit-duration-in-mins ({ckpt.exit_duration_in_mins:g}) must be >= 0")
    if ckpt.exit_duration_in_mins and not ckpt.save:
        raise ConfigError("--exit-duration-in-mins saves a checkpoint before exiting: give --save")
    if ckpt.pretrained_checkpoint and ckpt.finetune:
        raise ConfigError(
            "--pretrained-checkpoint and --finetune both choose the starting weights: "
            "use --pretrained-checkpoint DIR with --load/--save RUN_DIR (resumes when requeued)"
        )
    if ckpt.pretrained_checkpoint and not ckpt.load:
        raise ConfigError(
            f"--pretrained-checkpoint {ckpt.pretrained_checkpoint} is used only while --load "
            "holds no checkpoint: give --load (usually the same directory as --save)"
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
