"""GPT pipeline parallelism (--pipeline-model-parallel-size > 1) on DeepSpeed's pipeline engine.

The model's pieces (``gpt_layer_specs``) are cut into stages with an equal number of transformer
layers; the first stage also holds the embeddings, the last the final norm, the output layer,
TempNet and the loss. DeepSpeed's schedule runs the micro-batches; the last stage's ``loss_fn``
(``PipelineObjective``) computes the same per-token losses, masking and global-token-count
normalisation as the one-process step, and collects the same statistics.
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

from megatron_tempnet import compat
from megatron_tempnet.distributed.sequence_parallel import sum_sequence_parallel_grads
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.gpt.layers import (
    EMBEDDING_KEY,
    FinalHidden,
    gpt_layer_specs,
    stage_view,
)
from megatron_tempnet.models.gpt.objective import (
    LossConfig,
    masked_mean,
    token_losses_from_logits,
    token_losses_fused,
)
from megatron_tempnet.models.gpt.step import (
    VALID_STATS,
    TokenStatistics,
    add_validation,
    global_token_count,
    unpack_batch,
    validation_metrics,
)
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.models.transformer import TransformerPiece, seed_rngs
from megatron_tempnet.tempnet import TempNetLM
from megatron_tempnet.trainer.pipeline import NormRecorder, Pipeline, train_through_schedule
from megatron_tempnet.trainer.stats import Statistics, StepStats
from megatron_tempnet.trainer.step import compute_device


class TempNetPiece(nn.Module):
    """The last piece: logits ``[b, s, V_pad/tp]`` -> (logits, tau ``[b, s]``); with the fused
    output stage, the ``FinalHidden`` with TempNet added (the loss function runs it)."""

    def __init__(self, **tempnet_kwargs):
        super().__init__()
        self.tempnet = TempNetLM(**tempnet_kwargs)  # float32 under --bf16 too

    def forward(self, logits: torch.Tensor | FinalHidden):
        if isinstance(logits, FinalHidden):
            params = [self.tempnet.weight1, *self.tempnet.projection_parameters()]
            views = tuple(stage_view(p) for p in params)
            return logits._replace(tempnet=self.tempnet, tempnet_params=views)
        return logits, self.tempnet(logits)


class PipelineObjective:
    """``loss_fn(outputs, (labels, loss_mask))`` on the last stage.

    In training it returns this micro-batch's share of the global mean, scaled by the data-parallel
    size x accumulation steps (DeepSpeed divides by both); in evaluation it adds the validation
    sums. ``start_step`` and ``start_validation`` reset it.
    """

    def __init__(self, loss: LossConfig, vocab_size: int, tp_group):
        self.loss = loss
        self.vocab_size, self.tp_group = vocab_size, tp_group
        self.num_tokens, self.scale = 1.0, 1.0
        self.train_stats = TokenStatistics()
        self.valid_stats = Statistics(VALID_STATS, compute_device())

    def start_step(self, num_tokens: torch.Tensor, scale: float) -> None:
        """A new iteration: ``num_tokens`` unmasked tokens in the global batch (on the device)."""
        self.num_tokens, self.scale = num_tokens, scale
        self.train_stats = TokenStatistics()

    def start_validation(self) -> None:
        self.valid_stats = Statistics(VALID_STATS, compute_device())

    def __call__(self, outputs, labels):
        labels, mask = labels
        common = {"vocab_size": self.vocab_size, "tp_group": self.tp_group}
        if isinstance(outputs, FinalHidden):  # the fused output stage (TempNet rides along)
            out = token_losses_fused(outputs, labels, self.loss, loss_mask=mask, **common)
        else:  # the logits, with TempNet's tau when TempNet is the last piece
            logits, tau = outputs if isinstance(outputs, tuple) else (outputs, None)
            out = token_losses_from_logits(logits, labels, self.loss, tau=tau, **common)
        if torch.is_grad_enabled():
            self.train_stats.add(out, mask)
            return masked_mean(out.loss, mask, self.num_tokens) * self.scale
        add_validation(self.valid_stats, out, mask)
        return masked_mean(out.ce, mask, mask.sum().clamp(min=1))


class GPTPipeline(Pipeline):
    """This rank's stage; TempNet, the last piece, may start fresh from an LM-only checkpoint."""

    name_prefix = "lm.pieces."  # ``TrainModule``'s names
    tied_pieces = {EMBEDDING_KEY: 0}  # the tied output layer is the word embeddings


def build_pipeline(
    model: ModelConfig,
    loss: LossConfig,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    dtype: torch.dtype,
    recompute: Recompute,
    freeze_lm: bool,
    seed: int,
    tempnet_kwargs: dict,
    tp_group,
    sequence_parallel: bool = False,
) -> GPTPipeline:
    """This rank's stage of the model; the same weights as the one-process model (on CPU).
    With ``sequence_parallel`` the stages pass ``[s/tp, b, h]`` shards to each other."""
    specs = gpt_layer_specs(
        model,
        tensor_parallel_size=tensor_parallel,
        params_dtype=dtype,
        recompute=recompute,
        fused_output_stage=loss.fused_output_stage,
        sequence_parallel=sequence_parallel,
    )
    if loss.uses_tempnet:
        specs.append(LayerSpec(TempNetPiece, **tempnet_kwargs))
    world = torch.distributed.get_world_size()
    data_parallel = world // (tensor_parallel * pipeline_parallel)
    module = GPTPipeline(
        layers=specs,
        topology=PipeModelDataParallelTopology(
            num_pp=pipeline_parallel, num_mp=tensor_parallel, num_dp=data_parallel
        ),
        loss_fn=PipelineObjective(loss, model.vocab_size, tp_group),
        seed_layers=True,
        seed_fn=seed_rngs,
        base_seed=seed,
        partition_method="type:TransformerPiece",
        optional={"tempnet.": "TempNet"},
        forward_only=freeze_lm,
    )
    sum_sequence_parallel_grads(module, tp_group)  # the marked parameters, if any
    pieces = compat.pipeline_pieces(module)
    recompute.apply([p for p in pieces if isinstance(p, TransformerPiece)])  # this stage's
    if freeze_lm:
        for piece in compat.pipeline_pieces(module):
            if isinstance(piece, nn.Module) and not isinstance(piece, TempNetPiece):
                piece.requires_grad_(False)
        for tied in compat.pipeline_tied_modules(module):
            tied.requires_grad_(False)
    seed_rngs(seed)  # dropout streams do not depend on which pieces this stage built
    return module


def _micro_batches(unpacked: list[tuple]):
    return iter([((tokens, pos), (labels, mask)) for tokens, labels, mask, pos in unpacked])


def pipeline_train_step(
    engine, batches: list[dict], *, dp_group, pp_group, norm: NormRecorder | None
) -> StepStats:
    """One iteration through DeepSpeed's pipeline schedule; same results as ``train_step``."""
    objective: PipelineObjective = engine.module.loss_fn
    unpacked = [unpack_batch(b) for b in batches]
    dp = torch.distributed.get_world_size(group=dp_group)
    objective.start_step(global_token_count(unpacked, dp_group), dp * len(batches))
    return train_through_schedule(
        engine,
        _micro_batches(unpacked),
        objective.train_stats,
        dp_group=dp_group,
        pp_group=pp_group,
        norm=norm,
    )


@torch.no_grad()
def pipeline_evaluate(engine, batches, *, dp_group, pp_group) -> dict:
    objective: PipelineObjective = engine.module.loss_fn
    objective.start_validation()
    unpacked = [unpack_batch(b) for b in batches]
    engine.eval_batch(_micro_batches(unpacked), num_micro_batches=len(unpacked))
    return validation_metrics(objective.valid_stats.reduce(dp_group, pp_group))
