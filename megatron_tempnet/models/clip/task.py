"""CLIP pretraining as a trainer task: image-text data, the towers, the contrastive losses.

The trainer (``trainer.loop``) is GPT's: engine, checkpoints, resume, logging, preemption. This
task brings the data (``ImageTextDataset`` in shuffled epochs), ``CLIPTrainModule`` (or with
pipeline parallelism this rank's stage, ``pipeline``), the step with the sharded per-sample state
(saved with each rank's checkpoint files) and the zero-shot evaluation. Each micro-batch,
gathered over the data-parallel ranks, is one contrastive batch; the micro-batches of an
iteration accumulate their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core import parallel_state

from megatron_tempnet.data.tokenizers import TokenizerConfig
from megatron_tempnet.distributed.sharding import TensorLayout
from megatron_tempnet.models.clip.config import CLIPLossConfig, CLIPModelConfig
from megatron_tempnet.models.clip.data.captions import tokenize_captions
from megatron_tempnet.models.clip.data.image_text import ImageTextDataConfig, ImageTextDataset
from megatron_tempnet.models.clip.data.shuffled_epochs import EpochShuffledDataset
from megatron_tempnet.models.clip.evaluation import evaluate_clip
from megatron_tempnet.models.clip.objective import CLIPTrainModule
from megatron_tempnet.models.clip.sample_state import SampleStateError, ShardedSampleState
from megatron_tempnet.models.clip.step import train_step, unpack_batch
from megatron_tempnet.models.clip.towers import CLIPModel
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.models.transformer import seed_rngs
from megatron_tempnet.tempnet.clip import TempNetCLIP
from megatron_tempnet.trainer.config import ConfigError, ParallelConfig, RunConfig, TrainingConfig
from megatron_tempnet.trainer.engine import model_and_own_groups
from megatron_tempnet.trainer.step import compute_device, step_max_grad_norm
from megatron_tempnet.trainer.task import ParamGroup, TaskData, TrainModel
from megatron_tempnet.trainer.validation import validate_run
from megatron_tempnet.utils.flags import derived, option
from megatron_tempnet.utils.logging import log_rank0
from megatron_tempnet.utils.precision import to_training_dtype

# what a pretrained-towers checkpoint (tools/checkpoint/convert_clip_to_megatron.py) may lack
OPTIONAL = {"tempnets.": "TempNet", "tau_heads.": "TaU's heads", "log_tau": "CLIP's global tau"}


@dataclass
class CLIPEvalConfig:
    valid_data: list[str] | None = option(None, metavar="PATH")
    """Held-out image-text pairs for zero-shot retrieval (and classification), evaluated every
    --eval-interval and after the last iteration."""
    ood_data: list[str] | None = option(None, metavar="PATH")
    """Out-of-distribution pairs: the temperature's OOD AUROC against --valid-data."""
    zeroshot_templates: list[str] | None = option(None, metavar="TEMPLATE")
    """Prompts with {} for the class name (the --label-key values), e.g. 'a photo of a {}.'."""
    eval_batch_size: int = 64
    """Samples per forward pass in evaluation."""


@dataclass
class CLIPParallelConfig(ParallelConfig):
    sequence_parallel: bool = derived(False)
    """No flag: CLIP's towers keep whole sequences (``megatron_flags.CLIP_REFUSED``)."""


@dataclass
class CLIPTrainingConfig(TrainingConfig):
    rampup_batch_size: tuple[int, ...] | None = derived(None)
    """No flag: an epoch is cut into whole global batches (``megatron_flags.CLIP_REFUSED``)."""
    eval_iters: int = derived(0)
    """No flag: CLIP evaluates on the whole --valid-data (``CLIPEvalConfig``)."""


@dataclass(kw_only=True)
class CLIPRunConfig(RunConfig):
    model: CLIPModelConfig
    parallel: CLIPParallelConfig = field(default_factory=CLIPParallelConfig)
    loss: CLIPLossConfig = field(default_factory=CLIPLossConfig)
    data: ImageTextDataConfig
    tokenizer: TokenizerConfig
    evaluation: CLIPEvalConfig = field(default_factory=CLIPEvalConfig)


def validate_clip(config: CLIPRunConfig, world_size: int) -> None:
    p, t, m = config.parallel, config.training, config.model
    layers = m.vision_layers + m.text_layers
    if p.pipeline_model_parallel_size > layers:
        raise ConfigError(
            f"--pipeline-model-parallel-size ({p.pipeline_model_parallel_size}) must be at most "
            f"the towers' layers (--vision-layers + --text-layers = {layers})"
        )
    validate_run(config, world_size)
    contrastive = t.micro_batch_size * config.data_parallel_size(world_size)
    if contrastive < 2:
        raise ConfigError(
            f"--micro-batch-size ({t.micro_batch_size}) x data-parallel size is the contrastive "
            "batch (each micro-batch gathered over DP): it needs >= 2 pairs"
        )
    config.loss.validate()
    config.loss.tempnet.resolve_optimizer(config.optimizer.lr, config.optimizer.weight_decay)
    config.model.validate(p.tensor_model_parallel_size)


@dataclass
class CLIPData(TaskData):
    """The training pairs (``train`` walks them in shuffled epochs), evaluation sets, tokenizer."""

    pairs: ImageTextDataset | None = None
    ood: ImageTextDataset | None = None
    tokenizer: object = None


class PerSampleState:
    """This rank's shard of the per-sample state as the rank state of its checkpoint files."""

    def __init__(self, state: ShardedSampleState):
        self.state = state

    def state_dict(self) -> dict:
        return {"sample_state": self.state.state_dict()}

    def load_state_dict(self, saved: dict | None) -> None:
        if not saved or "sample_state" not in saved:
            raise SampleStateError(
                f"the checkpoint has no per-sample state {self.state.fields}: it was saved by a "
                "run with another --clip-loss (resume with the same one)"
            )
        self.state.load_state_dict(saved["sample_state"])

    def load_state_dicts(self, saved: list[dict]) -> None:
        shards = [s["sample_state"] for s in saved if s and "sample_state" in s]
        if not shards:
            self.load_state_dict(None)  # the error above
        self.state.load_state_dicts(shards)


class CLIPTask:
    """The CLIP family's part of a run (``trainer.task.Task``)."""

    evaluate_at_end = True

    def prepare(self, config: CLIPRunConfig, world_size: int):
        """The tokenizer; the data follows the model's input shapes; every flag checked."""
        tokenizer = config.tokenizer.build()
        m, d = config.model, config.data
        if m.vocab_size is None:
            m.vocab_size = tokenizer.vocab_size
        config.loss.tempnet.tempnet_hidden_size = m.embed_dim
        d.image_size, d.image_channels, d.context_length = (
            m.image_size,
            m.image_channels,
            m.context_length,
        )
        validate_clip(config, world_size)
        d.validate()  # normalisation defaults and ranges, before any model is built
        return tokenizer

    def build_data(self, config: CLIPRunConfig, tokenizer) -> CLIPData:
        t, e = config.training, config.evaluation
        # rank 0 first: it scans each tar shard once and caches the index the others then read
        pairs = _rank0_first(lambda: ImageTextDataset(config.data, tokenizer))
        train = EpochShuffledDataset(
            pairs,
            global_batch_size=t.global_batch_size,
            num_positions=t.train_samples_needed(),
            seed=t.seed,
        )
        rank_state = None
        fields = config.loss.state_fields
        if fields and parallel_state.is_pipeline_last_stage():
            # sharded over the (last stage's) data-parallel ranks, keyed by the pair's index
            rank_state = PerSampleState(
                ShardedSampleState(
                    len(pairs), fields, group=parallel_state.get_data_parallel_group()
                )
            )
        return CLIPData(
            train=train,
            valid=_rank0_first(lambda: _eval_set(config, tokenizer, e.valid_data)),
            rank_state=rank_state,
            pairs=pairs,
            ood=_rank0_first(lambda: _eval_set(config, tokenizer, e.ood_data)),
            tokenizer=tokenizer,
        )

    def build_model(self, config: CLIPRunConfig, data: CLIPData) -> TrainModel:
        if config.parallel.pipeline_model_parallel_size > 1:
            return self._pipeline_stage(config, data)
        t = config.training
        dtype = t.params_dtype
        clip = CLIPModel(
            config.model,
            tensor_parallel_size=config.parallel.tensor_model_parallel_size,
            params_dtype=dtype,
            recompute=Recompute.from_training(t),
            seed=t.seed,
        )
        seed_rngs(t.seed + clip.num_pieces)
        module = CLIPTrainModule(
            clip, config.loss, dp_group=parallel_state.get_data_parallel_group()
        )
        # as DeepSpeed casts it; the temperature and the loss compute in float32
        to_training_dtype(module, dtype)
        # whole on the device first: megatron-core put the linear layers there already
        module = module.to(compute_device())
        if config.loss.uses_tempnet:
            _init_prototypes(module, data.pairs, config.loss.tempnet.tempnet_proj_size, t.seed)
        seed_rngs(t.seed)
        m, tp = config.model, config.parallel.tensor_model_parallel_size
        layout = TensorLayout(m.vocab_size, m.padded_vocab_size(tp))
        return TrainModel(
            module, _param_groups(module, config), optional=OPTIONAL, tensor_layout=layout
        )

    def _pipeline_stage(self, config: CLIPRunConfig, data: CLIPData) -> TrainModel:
        from megatron_tempnet.models.clip import pipeline

        t, p, m = config.training, config.parallel, config.model
        module = pipeline.build_pipeline(
            m,
            config.loss,
            tensor_parallel=p.tensor_model_parallel_size,
            pipeline_parallel=p.pipeline_model_parallel_size,
            dtype=t.params_dtype,
            recompute=Recompute.from_training(t),
            seed=t.seed,
            dp_group=parallel_state.get_data_parallel_group(),
            sample_state=None if data.rank_state is None else data.rank_state.state,
        )
        if config.loss.uses_tempnet:
            batch = _prototype_pairs(data.pairs, config.loss.tempnet.tempnet_proj_size, t.seed)
            pipeline.init_prototypes(
                module, batch, parallel_state.get_pipeline_model_parallel_group()
            )
            log_rank0("TempNet prototypes initialised from %d training pairs (the other "
                      "modality)", config.loss.tempnet.tempnet_proj_size)  # fmt: skip
        layout = TensorLayout(m.vocab_size, m.padded_vocab_size(p.tensor_model_parallel_size))
        return TrainModel(
            module,
            _param_groups(module, config),
            tensor_layout=layout,
            # the two towers' streams travel whole between stages (DeepSpeed would cut the
            # first over TP and require the others to carry no gradient)
            engine_config={"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}},
        )

    def build_step(self, engine, optimizer, config: CLIPRunConfig, data: CLIPData):
        if config.parallel.pipeline_model_parallel_size > 1:
            from megatron_tempnet.models.clip.pipeline import pipeline_train_step
            from megatron_tempnet.trainer.pipeline import NormRecorder

            max_norm = step_max_grad_norm(config)
            return partial(
                pipeline_train_step,
                engine,
                dp_group=parallel_state.get_data_parallel_group(),
                pp_group=parallel_state.get_pipeline_model_parallel_group(),
                norm=None if max_norm is None else NormRecorder(optimizer, max_norm),
            )
        sample_state = None if data.rank_state is None else data.rank_state.state
        return partial(
            train_step,
            engine,
            dp_group=parallel_state.get_data_parallel_group(),
            max_grad_norm=step_max_grad_norm(config),
            sample_state=sample_state,
        )

    def validate(self, engine, config: CLIPRunConfig, data: CLIPData) -> dict:
        e = config.evaluation
        if config.parallel.pipeline_model_parallel_size > 1:
            from megatron_tempnet.models.clip.pipeline import PipelineEncoder

            engine = PipelineEncoder(engine, parallel_state.get_pipeline_model_parallel_group())

        def encode_texts(texts: list[str]) -> torch.Tensor:
            tokens, lengths = tokenize_captions(data.tokenizer, texts, config.model.context_length)
            tokens, lengths = tokens.to(compute_device()), lengths.to(compute_device())
            engine.eval()
            out = engine(None, tokens, lengths, encode=True)["text"].float().cpu()
            engine.train()
            return out

        return evaluate_clip(
            engine,
            data.valid,
            batch_size=e.eval_batch_size,
            dp_group=parallel_state.get_data_parallel_group(),
            encode_texts=encode_texts,
            templates=e.zeroshot_templates,
            ood_ds=data.ood,
        )


def _rank0_first(build):
    """``build()`` on global rank 0, then on the other ranks (what it caches, they read); they
    wait in the host group, with its longer timeout (a scan of many tar shards)."""
    import torch.distributed as dist

    from megatron_tempnet.distributed.groups import host_group

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build()
    out = build() if dist.get_rank() == 0 else None
    dist.barrier(group=host_group())
    return out if dist.get_rank() == 0 else build()


def _eval_set(config: CLIPRunConfig, tokenizer, paths: list[str] | None):
    """An evaluation set (no caption noise, no augmentation), or None."""
    if not paths:
        return None
    d = config.data
    evaluation = ImageTextDataConfig(
        **{**d.__dict__, "paths": list(paths), "caption_noise": 0.0, "augment": False}
    )
    return ImageTextDataset(evaluation, tokenizer)


def _param_groups(module: CLIPTrainModule, config: CLIPRunConfig) -> list[ParamGroup]:
    """The towers and the temperature's head or global tau (``model``), TempNet's (``tempnet``)."""
    t = config.loss
    tempnets = [m for m in module.modules() if isinstance(m, TempNetCLIP)]
    tempnet_params = [p for m in tempnets for p in m.parameters()]
    if t.uses_tempnet and not tempnet_params:  # a pipeline stage before the last
        tempnet_params = [module.group_placeholder("tempnet")]
    own = {"tempnet": (tempnet_params, t.tempnet.tempnet_lr, t.tempnet.tempnet_weight_decay)}
    if config.parallel.pipeline_model_parallel_size > 1 and t.clip_loss in ("clip", "tau"):
        # every stage needs every group: the temperature (last stage) has its own
        o, found = config.optimizer, [p for n, p in module.named_parameters() if _temperature(n)]
        own["temperature"] = (found or [module.group_placeholder("temperature")], o.lr, 0.0)
    constant = frozenset({"tempnet"} if t.tempnet.tempnet_constant_lr else ())
    return model_and_own_groups(module, config.optimizer, "model", own, constant)


def _temperature(name: str) -> bool:
    """CLIP's global tau and TaU's heads (a pipeline stage's names)."""
    return name.split(".")[1:2] in (["log_tau"], ["tau_heads"])


def _prototype_pairs(pairs: ImageTextDataset, count: int, seed: int) -> dict:
    """``count`` pairs drawn with ``seed`` (the same on every rank), as one batch."""
    if len(pairs) < count:
        raise ConfigError(
            f"TempNet's {count} prototypes are initialised from as many training pairs, but "
            f"--train-data has {len(pairs)}: lower --tempnet-proj-size"
        )
    chosen = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))[:count]
    return torch.utils.data.default_collate([pairs[int(i)] for i in chosen])


def _init_prototypes(module: CLIPTrainModule, pairs: ImageTextDataset, count: int, seed: int):
    """From ``count`` pairs drawn with ``seed``; a resumed run then loads the trained prototypes
    over them."""
    batch = _prototype_pairs(pairs, count, seed)
    images, tokens, lengths, _ = unpack_batch(batch)
    module.eval()
    module.init_prototypes(images, tokens, lengths)
    module.train()
    log_rank0("TempNet prototypes initialised from %d training pairs (the other modality)", count)
