"""Process groups, the models, the optimizer and the DeepSpeed engine for a run.

The language model and TempNet sit in one module that DeepSpeed wraps (so ZeRO shards both and
checkpoints hold both). The optimizer is AdamW with separate parameter groups: the LM's weights
(with weight decay), the LM's biases and norms (without), and TempNet's (its own learning rate and
weight decay, --tempnet-lr/--tempnet-weight-decay). With --freeze-lm the LM is not in the
optimizer at all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import torch
import torch.distributed as dist

from megatron_tempnet.distributed import apply_cpu_support
from megatron_tempnet.distributed.mpu import MegatronMPU
from megatron_tempnet.models.gpt_layers import build_gpt_model, seed_rngs
from megatron_tempnet.tempnet import TempNetLM
from megatron_tempnet.tempnet.clip import TempNetCLIP
from megatron_tempnet.training.config import ConfigError, OptimizerConfig, RunConfig
from megatron_tempnet.training.loss import LossConfig, TokenLosses, token_losses


class TrainModule(torch.nn.Module):
    """The LM and (when tau comes from it) TempNet, as one module for the engine.

    Its forward is the whole objective, so that every pass goes through the DeepSpeed engine
    (ZeRO's per-micro-batch bookkeeping happens in the engine's forward).
    """

    def __init__(self, lm: torch.nn.Module, tempnet: TempNetLM | None, loss: LossConfig,
                 vocab_size: int, freeze_lm: bool):  # fmt: skip
        super().__init__()
        self.lm = lm
        self.tempnet = tempnet
        self.loss_config, self.vocab_size, self.freeze_lm = loss, vocab_size, freeze_lm

    def forward(self, tokens, position_ids, labels) -> TokenLosses:
        """``[b, s]`` token ids, positions and labels -> per-token loss, CE and tau."""
        with torch.no_grad() if self.freeze_lm else contextlib.nullcontext():
            logits = self.lm(tokens, position_ids)  # [b, s, V_pad/tp]
        return token_losses(logits, labels, self.loss_config, vocab_size=self.vocab_size,
                            tempnet=self.tempnet)  # fmt: skip


def init_process_groups(config: RunConfig) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU) and megatron-core's TP/PP/DP groups."""
    import deepspeed
    from megatron.core import parallel_state

    apply_cpu_support()
    if torch.cuda.is_available():  # before NCCL's first use
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    p = config.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
    )


def build_module(config: RunConfig) -> TrainModule | torch.nn.Module:
    """The LM (and TempNet) with the same initial weights whatever the parallel layout.

    PP = 1: a ``TrainModule``; PP > 1: this rank's pipeline stage (``GPTPipeline``).
    """
    t, tp = config.training, config.parallel.tensor_model_parallel_size
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    if config.parallel.pipeline_model_parallel_size > 1:
        from megatron_tempnet.training.pipeline import build_pipeline

        return build_pipeline(config, dtype)
    lm = build_gpt_model(
        config.model,
        tensor_parallel_size=tp,
        params_dtype=dtype,
        recompute_activations=t.recompute_activations,
        seed=t.seed,
    )
    tempnet = None
    if config.loss.uses_tempnet:
        seed_rngs(t.seed + lm.num_specs)  # where a pipeline's last stage builds it
        tempnet = TempNetLM(**tempnet_kwargs(config)).to(dtype)
    seed_rngs(t.seed)
    if t.freeze_lm:
        lm.requires_grad_(False)
    if torch.cuda.is_available():
        lm.cuda()
        if tempnet is not None:
            tempnet.cuda()
    return TrainModule(lm, tempnet, config.loss, config.model.vocab_size, t.freeze_lm)


def tempnet_kwargs(config) -> dict:
    """``TempNetLM``'s arguments for this run."""
    t, loss = config.training, config.loss
    return dict(
        vocab_size=config.model.vocab_size, hidden_size=t.tempnet_hidden_size,
        proj_size=t.tempnet_proj_size, tau_min=loss.tau_min, tau_max=loss.tau_max,
        padded_vocab_size=config.model.padded_vocab_size(config.parallel.tensor_model_parallel_size),
        stop_grad=loss.stop_grad,
    )  # fmt: skip


def param_groups(module: torch.nn.Module, opt: OptimizerConfig) -> list[dict]:
    """AdamW groups; ``max_lr``/``min_lr`` drive the schedule of each group."""
    groups = []

    def add(name, params, lr, weight_decay, min_lr):
        params = [p for p in params if p.requires_grad]
        if params:
            groups.append(
                {"name": name, "params": params, "lr": lr, "max_lr": lr, "min_lr": min_lr,
                 "weight_decay": weight_decay}
            )  # fmt: skip

    lm_params, tempnet_params = split_parameters(module)
    add("lm", [p for p in lm_params if p.ndim >= 2], opt.lr, opt.weight_decay, opt.min_lr)
    add("lm_no_decay", [p for p in lm_params if p.ndim < 2], opt.lr, 0.0, opt.min_lr)
    if tempnet_params:
        scale = opt.min_lr / opt.lr if opt.lr > 0 else 0.0
        add("tempnet", tempnet_params, opt.tempnet_lr, opt.tempnet_weight_decay,
            opt.tempnet_lr * scale)  # fmt: skip
    if not groups:
        raise ConfigError("nothing to train: every parameter is frozen")
    return groups


def split_parameters(module: torch.nn.Module) -> tuple[list, list]:
    """(model parameters, TempNet parameters) of a ``TrainModule``, a pipeline stage or CLIP's
    module (its image and text TempNets)."""
    tempnets = [m for m in module.modules() if isinstance(m, (TempNetLM, TempNetCLIP))]
    tempnet = {id(p) for m in tempnets for p in m.parameters()}
    placeholder = getattr(module, "tempnet_group_placeholder", None)
    if placeholder is not None:
        tempnet.add(id(placeholder))
    params = list(module.parameters())
    return [p for p in params if id(p) not in tempnet], [p for p in params if id(p) in tempnet]


def deepspeed_config(config: RunConfig, world_size: int) -> dict:
    """The DeepSpeed JSON for this run; a --deepspeed-config file is the base, flags win."""
    base: dict = {}
    if config.parallel.deepspeed_config:
        try:
            with open(config.parallel.deepspeed_config) as f:
                base = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"--deepspeed-config {config.parallel.deepspeed_config!r}: {e}"
            ) from None
    t = config.training
    zero = dict(base.get("zero_optimization", {}), stage=config.parallel.zero_stage)
    base.update(
        train_micro_batch_size_per_gpu=t.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps(world_size),
        train_batch_size=t.global_batch_size,
        zero_optimization=zero,
        # without ZeRO the training step clips (and measures the norm) itself
        gradient_clipping=config.optimizer.clip_grad if deepspeed_clips(config) else 0.0,
        zero_allow_untested_optimizer=True,  # our AdamW, with its parameter groups
        steps_per_print=base.get("steps_per_print", 10**9),  # we log ourselves
    )
    if t.bf16:
        base["bf16"] = {"enabled": True}
    if t.fp16:
        if not torch.cuda.is_available():
            raise ConfigError("--fp16 needs a GPU (DeepSpeed has no fp16 on CPU): use --bf16")
        base["fp16"] = dict(base.get("fp16", {}), enabled=True)
    return base


def deepspeed_clips(config: RunConfig) -> bool:
    """DeepSpeed clips (and reports the norm) under ZeRO, and for a mixed-precision pipeline
    (its optimizer holds the float32 gradients); otherwise the training step does."""
    t, p = config.training, config.parallel
    return p.zero_stage > 0 or (p.pipeline_model_parallel_size > 1 and (t.bf16 or t.fp16))


def build_engine(module: TrainModule, config: RunConfig, world_size: int):
    """``deepspeed.initialize`` over megatron-core's groups; returns (engine, optimizer)."""
    import deepspeed

    opt = config.optimizer
    optimizer = torch.optim.AdamW(
        param_groups(module, opt), betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps
    )
    if config.parallel.pipeline_model_parallel_size > 1:
        from megatron_tempnet.training.pipeline import initialize_pipeline_engine

        # a pipeline brings DeepSpeed's own grid (the same groups as megatron-core's)
        return initialize_pipeline_engine(module, optimizer, deepspeed_config(config, world_size))
    engine, optimizer, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        config=deepspeed_config(config, world_size),
        mpu=MegatronMPU(),
    )
    tied = isinstance(module, TrainModule) and not config.model.untie_embeddings_and_output_weights
    if config.parallel.zero_stage == 3 and tied:
        # the output layer multiplies by the embedding's (ZeRO-3-partitioned) weight outside
        # the embedding's own forward: tell ZeRO-3 to gather it for the output layer too
        embedding = module.lm.embedding
        deepspeed.zero.register_external_parameter(
            embedding.output_layer, embedding.word_embeddings.weight
        )
    return engine, optimizer


def learning_rate(iteration: int, max_lr: float, min_lr: float, opt: OptimizerConfig) -> float:
    """Linear warmup then cosine decay to ``min_lr`` over ``lr_decay_iters`` (then flat)."""
    decay = opt.lr_decay_iters
    warmup = (
        round(opt.lr_warmup_fraction * decay)
        if opt.lr_warmup_fraction is not None
        else opt.lr_warmup_iters
    )
    if warmup and iteration < warmup:
        return max_lr * (iteration + 1) / warmup
    if iteration >= decay:
        return min_lr
    progress = (iteration - warmup) / max(decay - warmup, 1)
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_learning_rates(optimizer, iteration: int, opt: OptimizerConfig) -> float:
    """Set every group's lr for ``iteration`` (0-based); returns the LM's (or TempNet's)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(iteration, group["max_lr"], group["min_lr"], opt)
    return optimizer.param_groups[0]["lr"]
