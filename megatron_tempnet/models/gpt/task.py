"""GPT/LLaMA pretraining as a trainer task: indexed token data, the LM and TempNet, token losses.

The LM and TempNet sit in one module the engine wraps (``TrainModule``; with pipeline
parallelism this rank's stage, ``GPTPipeline``), so ZeRO shards both and checkpoints hold both.
The optimizer groups are the LM's weights (with weight decay), the LM's biases and norms
(without), TempNet's (--tempnet-lr, --tempnet-weight-decay, on its own schedule) and, with
--decoupled-lr, the input embedding and output layer's (Megatron-LM's decoupled learning rate);
with --freeze-lm the LM is in no group at all.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core import parallel_state

from megatron_tempnet.checkpoint.checkpoint_format import (
    FROZEN_LM_EXCLUDED,
    TRAIN_STATE,
    CheckpointError,
    has_marker,
    latest_tag,
    read_train_state,
)
from megatron_tempnet.data.gpt_data import (
    GPTDataConfig,
    build_gpt_datasets,
    check_data_source,
    parse_blend,
    split_samples,
)
from megatron_tempnet.data.loader import DataState, ResumableLoader, dataset_fingerprint
from megatron_tempnet.data.tokenizer_sidecar import check_tokenizer
from megatron_tempnet.data.tokenizers import TokenizerConfig
from megatron_tempnet.distributed.groups import host_group, resolve_tp_group
from megatron_tempnet.distributed.sharding import TensorLayout
from megatron_tempnet.models.gpt import megatron_lm
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.flops import flops_per_token
from megatron_tempnet.models.gpt.hidden_cache import FrozenHiddenCache
from megatron_tempnet.models.gpt.layers import EMBEDDING_OR_OUTPUT, build_gpt_model
from megatron_tempnet.models.gpt.objective import LossConfig, TrainModule
from megatron_tempnet.models.gpt.step import evaluate, train_step
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.models.transformer import seed_rngs
from megatron_tempnet.tempnet import TempNetLM
from megatron_tempnet.trainer.config import (
    ConfigError,
    OptimizerConfig,
    RunConfig,
    TrainingConfig,
)
from megatron_tempnet.trainer.engine import model_and_own_groups
from megatron_tempnet.trainer.step import step_max_grad_norm
from megatron_tempnet.trainer.task import ParamGroup, TaskData, TrainModel
from megatron_tempnet.trainer.validation import validate_run
from megatron_tempnet.utils.logging import log_rank0, warn_rank0


@dataclass
class GPTTrainingConfig(TrainingConfig):
    freeze_lm: bool = False
    """Setting (iii): the LM runs without gradients and is in no optimizer group; only TempNet
    learns."""
    frozen_lm_cache: str | None = None
    """With --freeze-lm: a directory where the frozen LM's final hidden states are stored at the
    first pass over each sample and read at every later one (``models.gpt.hidden_cache``), so
    that repeated passes and other runs over the same data run only the output stage."""


@dataclass
class GPTOptimizerConfig(OptimizerConfig):
    decoupled_lr: float | None = None
    """A separate peak learning rate for the input embedding and the output layer (Megatron-LM's
    ``is_embedding_or_output_parameter`` weights: the word embeddings, and the output layer when
    untied), on the same warm-up and decay as --lr."""
    decoupled_min_lr: float | None = None
    """With --decoupled-lr: the floor of the decay for those weights (default: --min-lr)."""


@dataclass(kw_only=True)
class GPTRunConfig(RunConfig):
    model: ModelConfig
    loss: LossConfig = field(default_factory=LossConfig)
    data: GPTDataConfig
    tokenizer: TokenizerConfig
    training: GPTTrainingConfig
    optimizer: GPTOptimizerConfig = field(default_factory=GPTOptimizerConfig)


def _validate_decoupled(config: GPTRunConfig) -> None:
    o = config.optimizer
    if o.decoupled_lr is None:
        if o.decoupled_min_lr is not None:
            warn_rank0("--decoupled-min-lr has no effect without --decoupled-lr (as Megatron-LM)")
        return
    if o.decoupled_lr < 0:
        raise ConfigError(f"--decoupled-lr ({o.decoupled_lr}) must be >= 0")
    floor = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
    if not 0 <= floor <= o.decoupled_lr:
        flag = "--min-lr" if o.decoupled_min_lr is None else "--decoupled-min-lr"
        raise ConfigError(f"{flag} ({floor}) must be in [0, --decoupled-lr ({o.decoupled_lr})]")
    if config.training.freeze_lm:
        warn_rank0("--decoupled-lr has no effect with --freeze-lm (the LM's weights do not learn)")


def _validate_frozen_lm_cache(config: GPTRunConfig) -> None:
    """--frozen-lm-cache stores what the frozen LM computes for a sample: only where that does
    not change from pass to pass and the run's step can start from it."""
    if config.training.frozen_lm_cache is None:
        return
    m, p = config.model, config.parallel
    why = None
    if not config.training.freeze_lm:
        why = "it stores the frozen LM's hidden states: it needs --freeze-lm"
    elif m.hidden_dropout or m.attention_dropout:
        why = (f"the LM's dropout (--hidden-dropout {m.hidden_dropout:g}, --attention-dropout "
               f"{m.attention_dropout:g}) changes its hidden states at every pass: set both "
               "to 0")  # fmt: skip
    elif not config.loss.fused_output_stage:
        why = "it feeds the fused output stage: not with --no-fused-output-stage"
    elif p.pipeline_model_parallel_size > 1:
        why = "not with pipeline parallelism (the last stage's input comes from the others)"
    elif p.zero_stage == 3:
        why = ("not with ZeRO-3 (it would skip the frozen LM's gathers): a frozen LM has no "
               "gradients or optimizer states to partition, use --zero-stage 0-2")  # fmt: skip
    if why:
        raise ConfigError(f"--frozen-lm-cache {config.training.frozen_lm_cache}: {why}")


def validate_gpt(config: GPTRunConfig, world_size: int) -> None:
    """Every check of a pretrain_gpt.py run, before anything is built."""
    pp = config.parallel.pipeline_model_parallel_size
    if pp > 1 and config.model.num_layers % pp:
        raise ConfigError(
            f"--num-layers ({config.model.num_layers}) must be divisible by "
            f"--pipeline-model-parallel-size ({pp})"
        )
    validate_run(config, world_size)
    loss = config.loss
    if config.training.freeze_lm and not loss.uses_tempnet:
        raise ConfigError(
            "--freeze-lm trains TempNet only: it needs --tau-source tempnet (nothing else learns)"
        )
    if config.training.freeze_lm and not loss.tempnet.stop_grad:
        raise ConfigError("--freeze-lm and --no-tempnet-stop-grad contradict each other")
    _validate_frozen_lm_cache(config)
    loss.validate()
    loss.tempnet.resolve_optimizer(config.optimizer.lr, config.optimizer.weight_decay)
    _validate_decoupled(config)
    config.model.validate(config.parallel.tensor_model_parallel_size)
    tp = config.parallel.tensor_model_parallel_size
    if config.parallel.sequence_parallel and config.model.seq_length % tp:
        raise ConfigError(
            f"--sequence-parallel splits the sequence over the tensor-parallel ranks: "
            f"--seq-length ({config.model.seq_length}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )
    if config.model.seq_length != config.data.seq_length:
        raise ConfigError(
            f"the model's --seq-length ({config.model.seq_length}) and the data's "
            f"({config.data.seq_length}) differ"
        )
    _check_frozen_checkpoint(config)
    _check_norm_weights(config)


def _check_frozen_checkpoint(config: GPTRunConfig) -> None:
    """A checkpoint without the frozen LM resumes only as the run that saved it did."""
    ckpt = config.checkpoint
    tag = latest_tag(ckpt.load) if ckpt.load else None
    if tag is None or not has_marker(os.path.join(ckpt.load, tag), FROZEN_LM_EXCLUDED):
        return
    if not _frozen_from_pretrained(config):
        raise CheckpointError(
            f"--load {ckpt.load}: {tag} holds TempNet without the frozen LM: resume it with "
            "--freeze-lm --pretrained-checkpoint <the LM's checkpoint> (as the run that saved it)"
        )


def _check_norm_weights(config: GPTRunConfig) -> None:
    """The checkpoints to load keep their norms' weights as the run does: scales, or offsets from
    1 with --apply-layernorm-1p (the same tensors, so a mismatch would load silently)."""
    ckpt, one_p = config.checkpoint, config.model.apply_layernorm_1p
    sources = {"--load": ckpt.load, "--pretrained-checkpoint": ckpt.pretrained_checkpoint}
    for flag, directory in sources.items():
        tag = latest_tag(directory) if directory else None
        path = os.path.join(directory or "", tag or "")
        if tag is None or not os.path.isfile(os.path.join(path, TRAIN_STATE)):
            continue
        try:
            saved = (read_train_state(path, flag).get("config") or {}).get("model") or {}
        except CheckpointError:  # a damaged file: the load names it (and offers --load-fallback)
            continue
        saved_one_p = saved.get("apply_layernorm_1p", one_p)  # older checkpoints: not recorded
        if saved_one_p != one_p:
            said = "with" if saved_one_p else "without"
            raise ConfigError(
                f"{flag} {directory}: {tag} was saved {said} --apply-layernorm-1p (its norms' "
                f"weights are {'offsets from 1' if saved_one_p else 'the scales'}): run {said} "
                "the flag too"
            )


def _megatron_lm_weights(model: ModelConfig, directory: str, source: str):
    """A Megatron-LM checkpoint in ``directory`` as the LM's starting weights (None: none
    there); its model must be the run's."""
    found = megatron_lm.open_checkpoint(directory, source, model.vocab_size)
    if found is None:
        return None
    megatron_lm.check_same_model(found.model, model, source)
    return megatron_lm.TrainingWeights(found, "lm.")  # TrainModule's LM


def _frozen_from_pretrained(config: GPTRunConfig) -> bool:
    """The frozen LM is read from --pretrained-checkpoint and left out of the checkpoints
    (ZeRO-3 keeps every parameter in its partitions: those checkpoints stay whole)."""
    frozen = config.training.freeze_lm and config.checkpoint.pretrained_checkpoint is not None
    return frozen and config.parallel.zero_stage < 3


def _flops_per_sample(config: GPTRunConfig) -> float:
    """Megatron-LM's training FLOP count of one sample (``models.gpt.flops``)."""
    loss, m = config.loss, config.model
    t = loss.tempnet
    tempnet = (t.tempnet_hidden_size, t.tempnet_proj_size) if loss.uses_tempnet else None
    tp = config.parallel.tensor_model_parallel_size
    frozen = config.training.freeze_lm
    return flops_per_token(m, tempnet, tp, frozen_lm=frozen) * m.seq_length


def _hidden_cache(config: GPTRunConfig, lm, tp_group) -> FrozenHiddenCache:
    """--frozen-lm-cache's store for this rank, with what its hidden states depend on."""
    tp = resolve_tp_group(tp_group)
    settings = {
        "model": json.loads(json.dumps(dataclasses.asdict(config.model), default=str)),
        "params_dtype": str(config.training.params_dtype),
        "tensor_model_parallel_size": config.parallel.tensor_model_parallel_size,
        "sequence_parallel": config.parallel.sequence_parallel,
        # the samples' own attention (the key holds their tokens and positions, not this flag)
        "reset_attention_mask": config.data.reset_attention_mask,
    }
    return FrozenHiddenCache(config.training.frozen_lm_cache, lm, settings, tp.rank, tp.size)


def tempnet_kwargs(config: GPTRunConfig, tp_group) -> dict:
    """``TempNetLM``'s arguments for this run."""
    tp = config.parallel.tensor_model_parallel_size
    t = config.loss.tempnet
    return dict(
        vocab_size=config.model.vocab_size,
        hidden_size=t.tempnet_hidden_size,
        proj_size=t.tempnet_proj_size,
        tau_min=t.tau_min,
        tau_max=t.tau_max,
        padded_vocab_size=config.model.padded_vocab_size(tp),
        dropout=config.loss.tempnet_dropout,
        stop_grad=t.stop_grad,
        tp_group=tp_group,
    )


# Activations travel whole between stages. DeepSpeed's default cuts the first one over TP and
# all-gathers it on the receiving stage (1/TP of the bytes between stages), but reads each
# piece's shape back from the device, a host synchronisation per micro-batch and direction.
PIPELINE_ENGINE = {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}


class GPTTask:
    """The GPT family's part of a run (``trainer.task.Task``)."""

    evaluate_at_end = False

    def prepare(self, config: GPTRunConfig, world_size: int):
        """The tokenizer (which decides the vocabulary size); every flag checked, and every
        dataset's recorded tokenizer (on every rank: a dataset of another tokenizer stops the
        run before anything is built or written)."""
        tokenizer = config.tokenizer.build()
        if config.model.vocab_size is None:
            config.model.vocab_size = tokenizer.vocab_size
        validate_gpt(config, world_size)
        check_data_source(config.data)
        if not config.data.mock_data:
            check_tokenizer(parse_blend(config.data.data_path)[0], tokenizer.identity)
        return tokenizer

    def build_data(self, config: GPTRunConfig, tokenizer) -> TaskData:
        t = config.training
        sizes = split_samples(t)  # --train-samples and --rampup-batch-size included
        # an id the tokenizer cannot produce, or the embedding has no true row for, is wrong data
        vocab = min(tokenizer.vocab_size, config.model.vocab_size)
        # the other ranks wait for rank 0's scan of the data in the host group (its timeout)
        train, valid, _ = build_gpt_datasets(config.data, tokenizer, sizes, vocab, host_group())
        return TaskData(train=train, valid=valid)

    def build_model(self, config: GPTRunConfig, data: TaskData) -> TrainModel:
        """The LM (and TempNet) with the same initial weights whatever the parallel layout."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        recompute = Recompute.from_training(config.training).describe()
        if recompute:
            log_rank0("activation recomputation: %s", recompute)
        if config.parallel.pipeline_model_parallel_size > 1:
            module = self._pipeline_stage(config, tp_group)
        else:
            module = self._one_process_module(config, tp_group)
        m, tp = config.model, config.parallel.tensor_model_parallel_size
        return TrainModel(
            module,
            self._param_groups(module, config),
            optional={"tempnet.": "TempNet"},
            frozen_from_pretrained=_frozen_from_pretrained(config),
            tensor_layout=TensorLayout(m.vocab_size, m.padded_vocab_size(tp), m.swiglu),
            engine_config=PIPELINE_ENGINE
            if config.parallel.pipeline_model_parallel_size > 1
            else {},
            foreign_checkpoint=partial(_megatron_lm_weights, config.model),
            flops_per_sample=_flops_per_sample(config),
        )

    def _one_process_module(self, config: GPTRunConfig, tp_group) -> TrainModule:
        t, tp = config.training, config.parallel.tensor_model_parallel_size
        lm = build_gpt_model(
            config.model,
            tensor_parallel_size=tp,
            params_dtype=config.training.params_dtype,
            recompute=Recompute.from_training(t),
            seed=t.seed,
            sequence_parallel=config.parallel.sequence_parallel,
        )
        tempnet = None
        if config.loss.uses_tempnet:
            seed_rngs(t.seed + lm.num_specs)  # where a pipeline's last stage builds it
            tempnet = TempNetLM(**tempnet_kwargs(config, tp_group))  # float32 under --bf16 too
        seed_rngs(t.seed)
        if t.freeze_lm:
            lm.requires_grad_(False)
        if config.parallel.zero_stage == 3 and not config.model.untie_embeddings_and_output_weights:
            import deepspeed

            # the output layer multiplies by the embedding's (ZeRO-3-partitioned) weight outside
            # the embedding's own forward: ZeRO-3 must gather it for the output layer too
            deepspeed.zero.register_external_parameter(
                lm.embedding.output_layer, lm.embedding.word_embeddings.weight
            )
        vocab = config.model.vocab_size
        module = TrainModule(lm, tempnet, config.loss, vocab, t.freeze_lm, tp_group)
        if t.frozen_lm_cache is not None:
            module.hidden_cache = _hidden_cache(config, lm, tp_group)
        if config.parallel.zero_stage == 3 and module.output_stage is not None:
            import deepspeed

            # the fused output stage reads the output weight and TempNet's parameters outside
            # their modules' forward: ZeRO-3 gathers them for the stage's passes
            for param in module.output_stage.zero3_parameters():
                deepspeed.zero.register_external_parameter(module.output_stage, param)
        return module.cuda() if torch.cuda.is_available() else module

    def _pipeline_stage(self, config: GPTRunConfig, tp_group):
        from megatron_tempnet.models.gpt.pipeline import build_pipeline

        t, p = config.training, config.parallel
        return build_pipeline(
            config.model,
            config.loss,
            tensor_parallel=p.tensor_model_parallel_size,
            pipeline_parallel=p.pipeline_model_parallel_size,
            dtype=config.training.params_dtype,
            recompute=Recompute.from_training(t),
            freeze_lm=t.freeze_lm,
            seed=t.seed,
            tempnet_kwargs=tempnet_kwargs(config, tp_group),
            tp_group=tp_group,
            sequence_parallel=p.sequence_parallel,
        )

    def _param_groups(self, module, config: GPTRunConfig) -> list[ParamGroup]:
        """The LM's groups and TempNet's (every pipeline stage has one: a placeholder where the
        stage holds no TempNet)."""
        t = config.loss.tempnet
        tempnets = [m for m in module.modules() if isinstance(m, TempNetLM)]
        tempnet_params = [p for m in tempnets for p in m.parameters()]
        if config.loss.uses_tempnet and not tempnet_params:
            tempnet_params = [module.group_placeholder("tempnet")]
        own = {"tempnet": (tempnet_params, t.tempnet_lr, t.tempnet_weight_decay)}
        constant = frozenset({"tempnet"} if t.tempnet_constant_lr else ())
        o, floors = config.optimizer, {}
        if o.decoupled_lr is not None and not config.training.freeze_lm:
            ends = [p for p in module.parameters() if getattr(p, EMBEDDING_OR_OUTPUT, False)]
            own["decoupled"] = (ends or [module.group_placeholder("decoupled")],
                                o.decoupled_lr, o.weight_decay)  # fmt: skip
            floors["decoupled"] = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        return model_and_own_groups(module, o, "lm", own, constant, floors)

    def build_step(self, engine, optimizer, config: GPTRunConfig, data: TaskData):
        """``step(batches) -> (stats, grad_norm)`` for this layout (one process or a pipeline)."""
        dp_group = parallel_state.get_data_parallel_group()
        max_norm = step_max_grad_norm(config)
        if config.parallel.pipeline_model_parallel_size == 1:
            return partial(train_step, engine, dp_group=dp_group, max_grad_norm=max_norm)
        from megatron_tempnet.models.gpt.pipeline import NormRecorder, pipeline_train_step

        norm = None if max_norm is None else NormRecorder(optimizer, max_norm)
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        return partial(pipeline_train_step, engine, dp_group=dp_group, pp_group=pp_group, norm=norm)

    def validate(self, engine, config: GPTRunConfig, data: TaskData) -> dict:
        """The first --eval-iters global batches of the validation split, every time."""
        t = config.training
        dp_group = parallel_state.get_data_parallel_group()
        loader = ResumableLoader(
            data.valid,
            DataState(0, dataset_fingerprint(data.valid)),
            t.micro_batch_size,
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )
        world_size = torch.distributed.get_world_size()
        micro_batches = t.eval_iters * config.gradient_accumulation_steps(world_size)
        batches = [next(loader) for _ in range(micro_batches)]
        if config.parallel.pipeline_model_parallel_size > 1:
            from megatron_tempnet.models.gpt.pipeline import pipeline_evaluate

            pp_group = parallel_state.get_pipeline_model_parallel_group()
            return pipeline_evaluate(engine, batches, dp_group=dp_group, pp_group=pp_group)
        return evaluate(engine, batches, dp_group=dp_group)
