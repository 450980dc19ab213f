"""What every run is configured with: layout, optimizer, training, checkpoints, logging.

One dataclass per concern; each field is also its command-line flag (Megatron-LM's name) and its
docstring the flag's help (``utils.flags``). A model family's run config (``GPTRunConfig``,
``CLIPRunConfig``) adds its model, objective and data configs to ``RunConfig``. Defaults are
Megatron-LM's (AdamW betas 0.9/0.999, eps 1e-8, weight decay 0.01, gradient clipping at 1.0, no
warm-up, linear decay; no default learning rate). Everything is checked once, before any model is
built (``trainer.validation.validate_run``, then the family's own checks).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from megatron_tempnet.checkpoint.checkpoint_format import DIGESTS, TEMPNET_DIST

# the error every config check raises, importable from here as before
from megatron_tempnet.trainer.errors import ConfigError as ConfigError
from megatron_tempnet.trainer.schedule import (
    LR_DECAY_STYLES,
    WSD_DECAY_STYLES,
    BatchSchedule,
)
from megatron_tempnet.utils.flags import option


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Ranks that split every layer (attention heads, MLP columns, the vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (DeepSpeed's pipeline engine); the layers are divided evenly."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage over the data-parallel ranks (0-1 with pipeline parallelism)."""
    deepspeed_config: str | None = option(None, aliases=("--deepspeed_config",))
    """A DeepSpeed JSON file as the base of the engine's config; the flags given here win
    (also spelled --deepspeed_config, Megatron-DeepSpeed's)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass: DeepSpeed's
    zero_optimization.overlap_comm at ZeRO 1-3 (without this flag it is off unless
    --deepspeed-config sets it; no effect at ZeRO 0 or with pipeline parallelism, where DeepSpeed
    reduces after the backward pass)."""
    overlap_param_gather: bool = False
    """Overlap the all-gather of the sharded parameters with the forward pass (needs
    --overlap-grad-reduce and a sharded optimizer, --zero-stage >= 1): ZeRO-3's parameter
    prefetch (without this flag its stage3_prefetch_bucket_size is 0 unless --deepspeed-config
    sets it); no effect at ZeRO 1-2, whose optimizer step gathers the updated parameters."""
    distributed_timeout_minutes: int = 10
    """Timeout of torch.distributed's collectives: the default process group's and
    megatron-core's tensor-, pipeline- and data-parallel groups' (DeepSpeed's own pipeline groups
    keep torch's default)."""
    sequence_parallel: bool = False
    """The layers' norm, dropout and residual regions run on sequence shards over the
    tensor-parallel ranks, [s/tp, b, h]: all-gather before the column-parallel linears,
    reduce-scatter after the row-parallel ones (activation memory of those regions / TP; the
    same model and numbers). Off at TP 1."""


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass
class OptimizerConfig:
    """AdamW and the learning-rate schedule (Megatron-LM's flags; the schedule counts samples,
    ``trainer.schedule``)."""

    lr: float | None = None
    """Peak learning rate (required: Megatron-LM has no default); reached after the warm-up,
    then decayed by --lr-decay-style."""
    min_lr: float = 0.0
    """Floor of the decay; the learning rate after the decay ends."""
    lr_decay_style: str = option("linear", choices=LR_DECAY_STYLES)
    """How the learning rate falls from --lr to --min-lr after the warm-up: constant (stays at
    --lr), linear, cosine, inverse-square-root (--lr x sqrt(warm-up / samples)) or WSD (warm-up,
    stable, decay: --lr until the last --lr-wsd-decay-iters/-samples of the decay)."""
    lr_wsd_decay_style: str = option("exponential", choices=WSD_DECAY_STYLES)
    """The shape of WSD's final decay."""
    lr_wsd_decay_iters: int | None = None
    """Iterations of WSD's final decay (with --train-iters)."""
    lr_wsd_decay_samples: int | None = None
    """Samples of WSD's final decay (with --train-samples)."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of the linear warm-up."""
    lr_warmup_fraction: float | None = None
    """Warm-up as a fraction of the decay length (instead of --lr-warmup-iters/-samples)."""
    lr_warmup_iters: int = 0
    """Warm-up iterations (with --train-iters)."""
    lr_warmup_samples: int = 0
    """Warm-up samples (with --train-samples)."""
    lr_decay_iters: int | None = None
    """Iterations over which the learning rate decays, warm-up included (default:
    --train-iters); --min-lr after them."""
    lr_decay_samples: int | None = None
    """Samples over which the learning rate decays, warm-up included (default:
    --train-samples; with --train-samples only)."""
    weight_decay: float = 0.01
    """AdamW weight decay of the weights (biases and norms have none)."""
    adam_beta1: float = 0.9
    """AdamW's beta1."""
    adam_beta2: float = 0.999
    """AdamW's beta2."""
    adam_eps: float = 1e-8
    """AdamW's epsilon."""
    clip_grad: float = 1.0
    """Scale the gradients down to this global norm when it is larger (0 = no clipping)."""
    override_opt_param_scheduler: bool = option(False, aliases=("--override-opt_param-scheduler",))
    """On resume, keep this run's learning-rate schedule (its peak, floor, warm-up, decay,
    style and weight decay) where the checkpoint's differs. Without it or
    --use-checkpoint-opt-param-scheduler a difference stops the run (Megatron-LM's rule)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, take the learning-rate schedule (peak, floor, warm-up, decay, style and
    weight decay) from the checkpoint instead of the command line."""


@dataclass
class TrainingConfig:
    train_iters: int | None = None
    """Iterations (optimizer steps) of the run; or give --train-samples."""
    train_samples: int | None = None
    """The run's length in samples instead of iterations (the schedule's flags are then the
    --lr-*-samples ones)."""
    micro_batch_size: int = 1
    """Samples per data-parallel rank per forward pass."""
    global_batch_size: int | None = None
    """Samples per iteration (default: micro batch x data-parallel size); the number of
    accumulated micro-batches follows."""
    rampup_batch_size: tuple[int, ...] | None = option(None, metavar="N")
    """START INCREMENT SAMPLES: the global batch grows from START by INCREMENT up to
    --global-batch-size, evenly over the first SAMPLES samples (the micro-batch size stays, the
    number of micro-batches grows)."""
    eval_interval: int = 0
    """Iterations between validation runs (0 = never, Megatron-LM's default)."""
    eval_iters: int = 100
    """Validation iterations (global batches) per run."""
    seed: int = 1234
    """Seeds the initial weights, dropout and the data order (the same whatever the layout)."""
    bf16: bool = False
    """Train in bfloat16 (DeepSpeed's bf16 optimizer keeps float32 master weights)."""
    fp16: bool = False
    """Train in float16 with loss scaling (GPU only)."""
    loss_scale: float | None = None
    """With --fp16: a static loss scale (a positive power of 2) instead of the dynamic one."""
    initial_loss_scale: float = 2.0**32
    """With --fp16: the dynamic loss scale's first value (a power of 2)."""
    min_loss_scale: float = 1.0
    """With --fp16: the dynamic loss scale's floor."""
    loss_scale_window: float = 1000
    """With --fp16: steps without an overflow after which the dynamic loss scale doubles."""
    hysteresis: int = 2
    """With --fp16: overflows the dynamic loss scale takes before it halves."""
    grad_reduce_in_bf16: bool = False
    """Under --bf16, accumulate the micro-batches' gradients and reduce them over the
    data-parallel ranks in bfloat16 (DeepSpeed's data_types.grad_accum_dtype and
    communication_data_type bf16). Without it both are float32, which DeepSpeed's bf16 optimizer
    does at ZeRO 1 and more: --bf16 with --zero-stage 0 runs at ZeRO 1 (optimizer states
    sharded over the data-parallel ranks). No effect without --bf16."""
    manual_gc: bool = False
    """Turn Python's automatic garbage collection off for the run and collect at fixed points
    (every --manual-gc-interval iterations, around validation), at the same time on every rank."""
    manual_gc_interval: int = 0
    """With --manual-gc: collect every this many iterations (0 = never during training)."""
    manual_gc_eval: bool = option(True, name="--no-manual-gc-eval")
    """With --manual-gc: do not collect before and after each validation run."""
    empty_unused_memory_level: int = option(0, choices=(0, 1, 2))
    """Release the CUDA caching allocator's unused blocks (torch.cuda.empty_cache) after each
    iteration (1), and also after each validation run (2); 0: never. Nothing to release on
    CPU."""
    recompute_granularity: str | None = option(None, choices=RECOMPUTE_GRANULARITIES)
    """Recompute activations in the backward pass instead of keeping them: full (whole
    transformer layers, as --recompute-method says) or selective (the core attention only: its
    [b, heads, s, s] softmax with --attention-backend unfused)."""
    recompute_method: str | None = option(None, choices=RECOMPUTE_METHODS)
    """With --recompute-granularity full: uniform (the layers in chunks of
    --recompute-num-layers, only each chunk's input kept) or block (the first
    --recompute-num-layers layers of each pipeline stage recomputed, the others not)."""
    recompute_num_layers: int | None = None
    """Layers per recomputed chunk (uniform) or recomputed layers per pipeline stage (block)."""
    recompute_activations: bool = False
    """Selective recomputation: --recompute-granularity selective."""
    num_workers: int = 2
    """Data-loader worker processes per rank reading (and for CLIP decoding and augmenting) the
    training samples ahead of the step; 0 reads them in the training process. The batches are
    the same either way."""

    @property
    def iterations(self) -> int:
        """The run's iterations: --train-iters, or what --train-samples makes (with the global
        batch ``validate_run`` fills)."""
        if self.train_iters is not None:
            return self.train_iters
        return self.batch_schedule().iterations(self.train_samples)

    @property
    def params_dtype(self) -> torch.dtype:
        """The model's parameter dtype for --bf16 / --fp16 (float32 otherwise)."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    def batch_schedule(self) -> BatchSchedule:
        """The global batch of each iteration (--global-batch-size, --rampup-batch-size)."""
        ramp = tuple(self.rampup_batch_size) if self.rampup_batch_size else None
        return BatchSchedule(self.global_batch_size, ramp)

    def train_samples_needed(self) -> int:
        """The training samples the run reads: --train-samples, or what its iterations take
        when more (a ramp's last iteration may pass --train-samples)."""
        return max(self.train_samples or 0, self.batch_schedule().consumed(self.iterations))


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
    no_load_rng: bool = False
    """Do not restore the RNG states from --load: the run continues with the streams its --seed
    gives (dropout draws differ from the run that saved; everything else is exact)."""
    exit_on_missing_checkpoint: bool = False
    """With --load: stop with an error when it holds no checkpoint, instead of starting from
    scratch."""
    ckpt_format: str = option(TEMPNET_DIST, choices=(TEMPNET_DIST, "torch_dist", "torch"))
    """The format of the checkpoints this run saves: tempnet_dist, this project's (each rank
    writing its own share of the weights, float32 masters and AdamW moments on
    torch.distributed.checkpoint, with TempNet, per-sample state, RNG and data position),
    loadable at any layout. Megatron-LM's torch_dist and torch are accepted for its scripts:
    the run saves tempnet_dist and says so at start-up; Megatron-LM's checkpoints of both
    formats are read by --load, --finetune and --pretrained-checkpoint whatever this flag says,
    and tools/checkpoint/export_megatron_lm.py writes torch_dist."""
    async_save: bool = False
    """Write checkpoints in the background: the state is copied to host memory (pinned on
    CUDA) and training goes on while every rank writes its share; the checkpoint becomes
    'latest' only once every rank's write is done. A stop request or the end of the run waits
    for a running write."""
    checkpoint_timeout_minutes: float = 60.0
    """Timeout of the gloo group the ranks wait in while others work on files: a checkpoint's
    saves and loads (the background writes of --async-save too), and rank 0's scan of the data
    at start-up. Training's collectives keep --distributed-timeout-minutes; a synchronous save
    to a slow file system can take longer than those."""
    ckpt_digest: str = option("xxh3_128", choices=DIGESTS)
    """The digest recorded for every checkpoint file (each rank digests what it writes, as it
    writes it) and checked before a file is read: xxh3_128 (tens of GB/s) or sha256."""
    use_checkpoint_args: bool = False
    """Take the model's architecture from the newest checkpoint in --load (the config saved with
    it): its structure always, its sizes where the command line gives none; with no checkpoint
    there, the command line's."""


@dataclass
class LoggingConfig:
    log_interval: int = 100
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
    log_throughput: bool = False
    """Add the model's training TFLOP/s per GPU to the log lines (``tflops_per_gpu``: Megatron-LM's
    FLOP count of a GPT, TempNet's products included)."""
    profile: bool = False
    """Profile the iterations --profile-step-start to --profile-step-end - 1 on --profile-ranks:
    with --use-pytorch-profiler a torch.profiler trace in --tensorboard-dir; otherwise (for
    ``nsys profile --capture-range=cudaProfilerApi``) the CUDA profiler's capture range and NVTX
    ranges of the autograd operations (nothing to capture on CPU)."""
    use_pytorch_profiler: bool = False
    """With --profile: record with torch.profiler, written as a TensorBoard trace (PyTorch's
    tensorboard_trace_handler) to --tensorboard-dir."""
    profile_step_start: int = 10
    """With --profile: the first iteration profiled."""
    profile_step_end: int = 12
    """With --profile: the iteration after the last one profiled."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """With --profile: the global ranks that profile."""


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
