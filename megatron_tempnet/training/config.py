"""Run configuration: one dataclass per concern, checked together once before any model is built.

Defaults follow the paper's Table 5 (AdamW betas 0.9/0.95, eps 1e-8, weight decay 0.1, 1% warmup,
cosine decay) and Megatron-LM's flag names.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from megatron_tempnet.data.gpt_data import GPTDataConfig
from megatron_tempnet.models.gpt import ModelConfig
from megatron_tempnet.training.loss import LossConfig


class ConfigError(ValueError):
    """Flags that cannot work together; the message names them, their values and the fix."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size"""
    pipeline_model_parallel_size: int = 1
    """--pipeline-model-parallel-size"""
    zero_stage: int = 0
    """--zero-stage: DeepSpeed ZeRO stage 0-3 over the data-parallel ranks."""
    deepspeed_config: str | None = None
    """--deepspeed-config: a DeepSpeed JSON; flags given here override what it sets."""


@dataclass
class OptimizerConfig:
    lr: float = 6e-4
    """--lr: peak learning rate of the language model."""
    min_lr: float = 0.0
    """--min-lr: floor of the cosine decay."""
    lr_warmup_fraction: float | None = 0.01
    """--lr-warmup-fraction: warmup as a fraction of --lr-decay-iters (paper: 1%)."""
    lr_warmup_iters: int = 0
    """--lr-warmup-iters: warmup iterations (used when --lr-warmup-fraction is not given)."""
    lr_decay_iters: int | None = None
    """--lr-decay-iters: length of the cosine decay (default: --train-iters)."""
    weight_decay: float = 0.1
    """--weight-decay"""
    adam_beta1: float = 0.9
    """--adam-beta1"""
    adam_beta2: float = 0.95
    """--adam-beta2"""
    adam_eps: float = 1e-8
    """--adam-eps"""
    clip_grad: float = 1.0
    """--clip-grad: global gradient-norm clipping (0 = off)."""
    tempnet_lr: float | None = None
    """--tempnet-lr: TempNet's peak learning rate (default: --lr); same schedule shape."""
    tempnet_weight_decay: float | None = None
    """--tempnet-weight-decay (default: --weight-decay)."""


@dataclass
class TrainingConfig:
    train_iters: int = 100
    """--train-iters"""
    micro_batch_size: int = 1
    """--micro-batch-size: samples per data-parallel rank per forward pass."""
    global_batch_size: int | None = None
    """--global-batch-size (default: micro batch x data-parallel size); accumulation derived."""
    eval_interval: int = 1000
    """--eval-interval: iterations between validation runs (0 = never)."""
    eval_iters: int = 10
    """--eval-iters: validation iterations per run."""
    seed: int = 1234
    """--seed"""
    bf16: bool = False
    """--bf16"""
    fp16: bool = False
    """--fp16"""
    recompute_activations: bool = False
    """--recompute-activations: recompute every layer's activations in the backward pass."""
    freeze_lm: bool = False
    """--freeze-lm: setting (iii): the LM runs without gradients and only TempNet learns."""
    tempnet_hidden_size: int = 256
    """--tempnet-hidden-size: d1."""
    tempnet_proj_size: int = 256
    """--tempnet-proj-size: d2."""


@dataclass
class CheckpointConfig:
    save: str | None = None
    """--save: checkpoint directory."""
    save_interval: int = 0
    """--save-interval: iterations between checkpoints (0 = only at the end / on exit)."""
    load: str | None = None
    """--load: resume from this directory's latest checkpoint (if any)."""
    finetune: bool = False
    """--finetune: load weights only (new optimizer, schedule and data position)."""
    no_load_optim: bool = False
    """--no-load-optim: do not restore the optimizer state."""
    exit_interval: int = 0
    """--exit-interval N: save and exit cleanly after iteration N."""
    exit_duration_in_mins: float = 0.0
    """--exit-duration-in-mins: after this many minutes, save and exit with status 75 (requeue)."""
    pretrained_checkpoint: str | None = None
    """--pretrained-checkpoint: weights to start from when --load holds no checkpoint yet."""
    keep_last: int = 0
    """--keep-last N: delete older checkpoints, keeping the newest N (0 = keep all)."""


@dataclass
class LoggingConfig:
    log_interval: int = 10
    """--log-interval: iterations between log lines."""
    tensorboard_dir: str | None = None
    """--tensorboard-dir"""
    metrics_file: str | None = None
    """--metrics-file: one JSON object per logged iteration is appended here."""


class RunShape:
    """What every run's config answers (GPT's ``RunConfig``, CLIP's ``CLIPRunConfig``)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    def gradient_accumulation_steps(self, world_size: int) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.data_parallel_size(world_size))


@dataclass
class RunConfig(RunShape):
    model: ModelConfig
    loss: LossConfig
    data: GPTDataConfig
    tokenizer: dict
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def validate(config: RunConfig, world_size: int) -> None:
    """All cross-flag checks, before anything is built; fills derived defaults."""
    t, pp = config.training, config.parallel.pipeline_model_parallel_size
    if pp > 1 and config.model.num_layers % pp:
        raise ConfigError(
            f"--num-layers ({config.model.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp})"
        )
    validate_common(config, world_size)
    if t.freeze_lm and not config.loss.uses_tempnet:
        raise ConfigError(
            "--freeze-lm trains TempNet only: it needs --tau-source tempnet (nothing else learns)"
        )
    if t.freeze_lm and not config.loss.stop_grad:
        raise ConfigError("--freeze-lm and --no-tempnet-stop-grad contradict each other")
    config.loss.validate()
    config.model.validate(config.parallel.tensor_model_parallel_size)
    if config.model.seq_length != config.data.seq_length:
        raise ConfigError(
            f"the model's --seq-length ({config.model.seq_length}) and the data's "
            f"({config.data.seq_length}) differ"
        )


def validate_common(config: RunShape, world_size: int) -> None:
    """The checks of the parallel layout, batch, precision, optimizer and checkpoint flags."""
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
    if t.train_iters < 1:
        raise ConfigError(f"--train-iters ({t.train_iters}) must be >= 1")
    if o.lr_decay_iters is None:
        o.lr_decay_iters = t.train_iters
    if o.min_lr > o.lr:
        raise ConfigError(f"--min-lr ({o.min_lr}) must be <= --lr ({o.lr})")
    if o.lr_warmup_fraction is not None and not 0 <= o.lr_warmup_fraction <= 1:
        raise ConfigError(f"--lr-warmup-fraction ({o.lr_warmup_fraction}) must be in [0, 1]")
    if o.tempnet_lr is None:
        o.tempnet_lr = o.lr
    if o.tempnet_weight_decay is None:
        o.tempnet_weight_decay = o.weight_decay
    _validate_checkpointing(config.checkpoint)


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
