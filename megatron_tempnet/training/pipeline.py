"""Pipeline parallelism (--pipeline-model-parallel-size > 1) on DeepSpeed's pipeline engine.

The model's pieces (``gpt_layer_specs``) are cut into stages with an equal number of transformer
layers; the first stage also holds the embeddings, the last the final norm, the output layer,
TempNet and the loss. DeepSpeed's schedule runs the micro-batches; the last stage's ``loss_fn``
(``PipelineObjective``) computes the same per-token losses, masking and global-token-count
normalisation as the one-process step, and collects the same statistics.
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from megatron_tempnet.models.gpt_layers import gpt_layer_specs, seed_rngs
from megatron_tempnet.tempnet import TempNetLM
from megatron_tempnet.training.engine import tempnet_kwargs
from megatron_tempnet.training.loss import LossConfig, masked_mean, token_losses
from megatron_tempnet.training.step import (
    StepAccumulator,
    StepStats,
    clip_gradients,
    compute_device,
    global_token_count,
    unpack_batch,
    validation_metrics,
)
from megatron_tempnet.utils.logging import get_logger


class TempNetPiece(nn.Module):
    """The last piece: logits [b, s, V_pad/tp] -> (logits, tau [b, s])."""

    def __init__(self, dtype: torch.dtype, **tempnet_kwargs):
        super().__init__()
        self.tempnet = TempNetLM(**tempnet_kwargs).to(dtype)

    def forward(self, logits: torch.Tensor):
        return logits, self.tempnet(logits)


class GPTPipeline(PipelineModule):
    """DeepSpeed's ``PipelineModule`` that can start TempNet fresh from an LM-only checkpoint.

    Stages without TempNet hold ``tempnet_group_placeholder`` (one zero that never gets a
    gradient) so that every stage has a TempNet parameter group: DeepSpeed's ZeRO reduces
    gradient norms over all stages once per group, so the groups must match.
    """

    allow_missing_tempnet = False
    freeze_lm = False  # --freeze-lm: the LM pieces run without a graph (see FrozenLMPipelineEngine)

    def forward(self, forward_input):
        if self.freeze_lm:  # a received activation asks for gradients that nobody will use
            forward_input = _detached(forward_input)
        return super().forward(forward_input)

    def add_tempnet_placeholder(self) -> None:
        if not any(isinstance(f, TempNetPiece) for f in self.forward_funcs):
            device = next(self.parameters()).device
            self.tempnet_group_placeholder = nn.Parameter(torch.zeros(1, device=device))

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        funcs = self.forward_funcs
        last = funcs[-1] if funcs else None
        local = len(funcs) - 1
        if (
            self.allow_missing_tempnet
            and isinstance(last, TempNetPiece)
            and not self.ckpt_layer_path_list(load_dir, local)
        ):
            if self._grid.data_parallel_id == 0 and self._grid.get_slice_parallel_rank() == 0:
                get_logger().info(  # the last stage's first rank: not rank 0
                    "TempNet starts from its initialisation: %s has no TempNet", load_dir
                )
            self.forward_funcs = funcs[:-1]  # the last piece: no index of the others moves
            try:
                return super().load_state_dir(load_dir, checkpoint_engine, strict)
            finally:
                self.forward_funcs = funcs
        return super().load_state_dir(load_dir, checkpoint_engine, strict)


def _detached(x):
    if isinstance(x, tuple):
        return tuple(t.detach() if torch.is_tensor(t) else t for t in x)
    return x.detach()


class FrozenLMPipelineEngine(PipelineEngine):
    """DeepSpeed's pipeline engine for --freeze-lm: forward through every stage, backward on
    the last stage only (TempNet is the only thing that learns, and its input is detached), so
    no gradient is computed or sent through the frozen LM."""

    def _exec_last_stage_backward(self, buffer_id):
        if self.is_last_stage():
            super()._exec_backward_pass(buffer_id)

    def _exec_nothing(self, buffer_id):
        pass

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.BackwardPass: _exec_last_stage_backward,
        schedule.SendGrad: _exec_nothing,
        schedule.RecvGrad: _exec_nothing,
    }


class PipelineObjective:
    """``loss_fn(outputs, (labels, loss_mask))`` on the last stage.

    In training it returns this micro-batch's share of the global mean, scaled by ``scale`` =
    data-parallel size x accumulation steps (DeepSpeed divides by both); in evaluation it adds
    the validation sums. ``num_tokens`` (the global batch's unmasked tokens) is set per step.
    """

    def __init__(self, loss: LossConfig, vocab_size: int):
        self.loss, self.vocab_size = loss, vocab_size
        self.num_tokens, self.scale = 1.0, 1.0
        self.train_acc = StepAccumulator()
        self.eval_sums = torch.zeros(4, dtype=torch.float64, device=compute_device())

    def __call__(self, outputs, labels):
        logits, tau = outputs if isinstance(outputs, tuple) else (outputs, None)
        labels, mask = labels
        out = token_losses(logits, labels, self.loss, vocab_size=self.vocab_size, tau=tau)
        if torch.is_grad_enabled():
            self.train_acc.add(out, mask)
            return masked_mean(out.loss, mask, self.num_tokens) * self.scale
        keep = mask.bool()
        self.eval_sums += torch.stack([
            keep.sum().double(), out.ce.double()[keep].sum(), out.ts_ce.double()[keep].sum(),
            out.tau.double()[keep].sum(),
        ])  # fmt: skip
        return masked_mean(out.ce, mask, max(float(keep.sum()), 1.0))


def initialize_pipeline_engine(module: GPTPipeline, optimizer, ds_config: dict):
    """``deepspeed.initialize`` for a pipeline, with the frozen-LM engine under --freeze-lm."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    if not module.freeze_lm:
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=ds_config
        )
        return engine, optimizer
    mpu = module.mpu()  # what deepspeed.initialize does for a PipelineModule
    engine = FrozenLMPipelineEngine(
        args=None, model=module, optimizer=optimizer, mpu=mpu, config=ds_config,
        config_class=DeepSpeedConfig(ds_config, mpu),
    )  # fmt: skip
    return engine, engine.optimizer


def build_pipeline(config, dtype: torch.dtype) -> GPTPipeline:
    """This rank's stage of the model; the same weights as the one-process model (on CPU)."""
    t, p = config.training, config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    specs = gpt_layer_specs(
        config.model, tensor_parallel_size=tp, params_dtype=dtype,
        recompute_activations=t.recompute_activations,
    )  # fmt: skip
    if config.loss.uses_tempnet:
        specs.append(LayerSpec(TempNetPiece, dtype, **tempnet_kwargs(config)))
    world = torch.distributed.get_world_size()
    module = GPTPipeline(
        layers=specs,
        topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp)),
        loss_fn=PipelineObjective(config.loss, config.model.vocab_size),
        seed_layers=True, seed_fn=seed_rngs, base_seed=t.seed,
        partition_method="type:TransformerPiece",
    )  # fmt: skip
    if t.freeze_lm:
        module.freeze_lm = True
        for piece in module.forward_funcs:
            if isinstance(piece, nn.Module) and not isinstance(piece, TempNetPiece):
                piece.requires_grad_(False)
        for tied in module.tied_modules.values():
            tied.requires_grad_(False)
    if config.loss.uses_tempnet:
        module.add_tempnet_placeholder()
    seed_rngs(t.seed)  # dropout streams do not depend on which pieces this stage built
    return module


class NormRecorder:
    """Clips before every optimizer step (ZeRO 0, float32, where DeepSpeed's pipeline clipping
    would count replicated parameters on the first stage only) and keeps the norm."""

    def __init__(self, optimizer, clip_grad: float):
        self.clip_grad, self.norm = clip_grad, None
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer, args, kwargs):
        self.norm = clip_gradients(self._params, self.clip_grad)


def pipeline_train_step(engine, batches: list[dict], *, dp_group, pp_group,
                        norm: NormRecorder | None) -> tuple[StepStats, float | None]:  # fmt: skip
    """One iteration through DeepSpeed's pipeline schedule; same results as ``train_step``."""
    objective: PipelineObjective = engine.module.loss_fn
    unpacked = [unpack_batch(b) for b in batches]
    objective.num_tokens = global_token_count(unpacked, dp_group)
    objective.scale = torch.distributed.get_world_size(group=dp_group) * len(batches)
    objective.train_acc = StepAccumulator()
    engine.train_batch(
        iter([((tokens, pos), (labels, mask)) for tokens, labels, mask, pos in unpacked])
    )
    stats = objective.train_acc.reduce(dp_group, pp_group)
    grad_norm = norm.norm if norm is not None else engine.get_global_grad_norm()
    return stats, None if grad_norm is None else float(grad_norm)


@torch.no_grad()
def pipeline_evaluate(engine, batches, *, dp_group, pp_group) -> dict:
    objective: PipelineObjective = engine.module.loss_fn
    objective.eval_sums.zero_()
    unpacked = [unpack_batch(b) for b in batches]
    engine.eval_batch(
        iter([((tokens, pos), (labels, mask)) for tokens, labels, mask, pos in unpacked]),
        num_micro_batches=len(unpacked),
    )
    sums = objective.eval_sums.clone()
    torch.distributed.all_reduce(sums, group=dp_group)
    torch.distributed.all_reduce(sums, group=pp_group)
    return validation_metrics(sums)
