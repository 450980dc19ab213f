"""CLIP pretraining on the shared loop: image-text data, the towers and the contrastive losses.

The loop (``loop.pretrain``) is GPT's: engine, checkpoints, resume, logging, preemption. This
task brings the data (``ImageTextDataset`` in shuffled epochs), ``CLIPTrainModule``, the step
with the sharded per-sample state (saved with each rank's checkpoint files) and the zero-shot
evaluation. The contrastive candidates are the global batch, so there is no gradient
accumulation and no pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from megatron_tempnet.data.captions import tokenize_captions
from megatron_tempnet.data.image_text import ImageTextDataConfig, ImageTextDataset
from megatron_tempnet.data.image_text_sampling import EpochShuffledDataset
from megatron_tempnet.data.tokenizers import build_tokenizer
from megatron_tempnet.inference.clip_evaluation import evaluate_clip
from megatron_tempnet.models.clip import CLIPModel, CLIPModelConfig
from megatron_tempnet.models.gpt_layers import seed_rngs
from megatron_tempnet.training.clip_module import CLIPLossConfig, CLIPTrainModule
from megatron_tempnet.training.clip_step import clip_train_step
from megatron_tempnet.training.config import (
    CheckpointConfig,
    ConfigError,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunShape,
    TrainingConfig,
    validate_common,
)
from megatron_tempnet.training.engine import deepspeed_clips
from megatron_tempnet.training.sample_state import ShardedSampleState
from megatron_tempnet.utils.logging import log_rank0


@dataclass
class CLIPEvalConfig:
    valid_data: list[str] | None = None
    """--valid-data: held-out image-text pairs for zero-shot retrieval (and classification)."""
    ood_data: list[str] | None = None
    """--ood-data: out-of-distribution pairs: the temperature's OOD AUROC against --valid-data."""
    zeroshot_templates: list[str] | None = None
    """--zeroshot-templates: prompts with '{}' for the class name (the --label-key values)."""
    eval_batch_size: int = 64
    """--eval-batch-size: samples per forward pass in evaluation."""


@dataclass
class CLIPRunConfig(RunShape):
    model: CLIPModelConfig
    loss: CLIPLossConfig
    data: ImageTextDataConfig
    tokenizer: dict
    evaluation: CLIPEvalConfig = field(default_factory=CLIPEvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval_at_end: bool = True
    """Evaluate after the last iteration too (when --valid-data is given)."""


def validate_clip(config: CLIPRunConfig, world_size: int) -> None:
    p, t = config.parallel, config.training
    if p.pipeline_model_parallel_size != 1:
        raise ConfigError(
            f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size}: CLIP runs with "
            "tensor and data parallelism only (use 1)"
        )
    if t.freeze_lm:
        raise ConfigError("--freeze-lm is for pretrain_gpt.py; CLIP has no frozen-model mode yet")
    validate_common(config, world_size)
    if config.gradient_accumulation_steps(world_size) != 1:
        raise ConfigError(
            f"--global-batch-size ({t.global_batch_size}) must equal --micro-batch-size "
            f"({t.micro_batch_size}) x data-parallel size ({config.data_parallel_size(world_size)})"
            ": the contrastive candidates are the global batch (no gradient accumulation)"
        )
    if t.global_batch_size < 2:
        raise ConfigError("a contrastive loss needs a global batch of >= 2 pairs")
    config.loss.validate()
    config.model.validate(p.tensor_model_parallel_size)


class CLIPTask:
    """The CLIP-specific parts of the run (see ``loop.GPTTask`` for the contract)."""

    def prepare(self, config: CLIPRunConfig, world_size: int) -> None:
        self.tokenizer = build_tokenizer(**config.tokenizer)
        m, d = config.model, config.data
        if m.vocab_size is None:
            m.vocab_size = self.tokenizer.vocab_size
        # the data follows the model's input shapes
        d.image_size, d.image_channels, d.context_length = (
            m.image_size, m.image_channels, m.context_length)  # fmt: skip
        validate_clip(config, world_size)
        d.validate()  # normalisation defaults and ranges, before any model is built
        self.sample_state = None

    def _dataset(self, config: CLIPRunConfig, paths: list[str]) -> ImageTextDataset:
        """An evaluation set: no caption noise, no augmentation."""
        d = config.data
        return ImageTextDataset(
            ImageTextDataConfig(**{**d.__dict__, "paths": list(paths), "caption_noise": 0.0,
                                   "augment": False}), self.tokenizer)  # fmt: skip

    def build_data(self, config: CLIPRunConfig):
        from megatron.core import parallel_state

        t, e = config.training, config.evaluation
        self.train_pairs = ImageTextDataset(config.data, self.tokenizer)
        train = EpochShuffledDataset(
            self.train_pairs, global_batch_size=t.global_batch_size,
            num_positions=t.train_iters * t.global_batch_size, seed=t.seed,
        )  # fmt: skip
        valid = self._dataset(config, e.valid_data) if e.valid_data else None
        self.ood = self._dataset(config, e.ood_data) if e.ood_data else None
        fields = config.loss.state_fields
        if fields:  # sharded over the data-parallel ranks, keyed by the pair's index
            self.sample_state = ShardedSampleState(
                len(self.train_pairs), fields, group=parallel_state.get_data_parallel_group(),
                device="cuda" if torch.cuda.is_available() else None,
            )  # fmt: skip
        return train, valid

    def build_module(self, config: CLIPRunConfig, train_ds) -> CLIPTrainModule:
        from megatron.core import parallel_state

        t = config.training
        dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
        clip = CLIPModel(config.model, tensor_parallel_size=config.parallel.
                         tensor_model_parallel_size, params_dtype=dtype,
                         recompute=t.recompute_activations, seed=t.seed)  # fmt: skip
        seed_rngs(t.seed + clip.num_pieces)
        module = CLIPTrainModule(
            clip, config.loss, dp_group=parallel_state.get_data_parallel_group(),
            tempnet_proj_size=t.tempnet_proj_size,
        )  # fmt: skip
        module.to(dtype)  # as DeepSpeed casts it; the loss itself is computed in float32
        if config.loss.uses_tempnet:
            self._init_prototypes(module, t.tempnet_proj_size, t.seed)
        seed_rngs(t.seed)
        return module.cuda() if torch.cuda.is_available() else module

    def _init_prototypes(self, module: CLIPTrainModule, count: int, seed: int) -> None:
        """From ``count`` pairs drawn with ``seed`` (the same on every rank); a resumed run
        then loads the trained prototypes over them."""
        pairs = self.train_pairs
        if len(pairs) < count:
            raise ConfigError(
                f"TempNet's {count} prototypes are initialised from as many training pairs, but "
                f"--train-data has {len(pairs)}: lower --tempnet-proj-size"
            )
        chosen = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))[:count]
        batch = torch.utils.data.default_collate([pairs[int(i)] for i in chosen])
        module.eval()
        module.init_prototypes(batch["image"], batch["tokens"], batch["length"])
        module.train()
        log_rank0("TempNet prototypes initialised from %d training pairs (the other modality)",
                  count)  # fmt: skip

    def step_function(self, engine, optimizer, config: CLIPRunConfig, dp_group):
        own_clip = None if deepspeed_clips(config) else config.optimizer.clip_grad
        return partial(clip_train_step, engine, dp_group=dp_group, clip_grad=own_clip,
                       sample_state=self.sample_state)  # fmt: skip

    def validate(self, engine, valid_ds, config: CLIPRunConfig, world_size: int, dp_group):
        e = config.evaluation

        def encode_texts(texts: list[str]) -> torch.Tensor:
            tokens, lengths = tokenize_captions(self.tokenizer, texts, config.model.context_length)
            engine.eval()
            out = engine(None, tokens, lengths, encode=True)["text"].float().cpu()
            engine.train()
            return out

        return evaluate_clip(engine, valid_ds, batch_size=e.eval_batch_size, dp_group=dp_group,
                             encode_texts=encode_texts, templates=e.zeroshot_templates,
                             ood_ds=self.ood)  # fmt: skip

    def rank_state(self) -> dict | None:
        if self.sample_state is None:
            return None
        return {"sample_state": self.sample_state.state_dict()}

    def load_rank_state(self, state: dict | None) -> None:
        if self.sample_state is None:
            return
        if not state or "sample_state" not in state:
            raise ConfigError(
                f"the checkpoint has no per-sample state {self.sample_state.fields}: it was "
                "saved by a run with another --clip-loss (resume with the same one)"
            )
        self.sample_state.load_state_dict(state["sample_state"])
