"""A checkpoint of any saved layout, loaded for inference at this job's tensor-parallel size.

The job is ``tp`` processes (torchrun, srun, or one process for TP = 1); each builds its shard of
the model (``GPTStack``) and reads its slice of every tensor from the checkpoint
(``CheckpointReader``), so a checkpoint saved at TP = 8 x PP = 2 loads at TP = 1 or 2 and back.
TempNet comes from the checkpoint, or from an exported directory (``--tempnet``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.distributed.groups import resolve_tp_group
from megatron_tempnet.distributed.sharding import shard
from megatron_tempnet.inference.checkpoint_io import CheckpointReader, lm_names, open_reader
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.tempnet import TempNetLM
from megatron_tempnet.tempnet.config import saved_loss_settings
from megatron_tempnet.utils.cli import UserError


class InferenceError(UserError, ValueError):
    """Inference flags or inputs that cannot work; names the flag or the input."""


@dataclass
class InferenceModel:
    """The LM shard ``lm`` (``[b, s]`` tokens -> ``[b, s, V_pad/tp]`` logits) and TempNet."""

    lm: torch.nn.Module
    tempnet: TempNetLM | None
    model: ModelConfig
    config: dict
    """The run config saved with the checkpoint (its ``tokenizer`` entry builds the tokenizer)."""
    tp_group: object = None
    """The tensor-parallel group the vocabulary is split over (None: no tensor parallelism)."""

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` -> float32 ``[b, s, V_pad/tp]`` (this rank's vocabulary slice)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        return self.lm(tokens, positions).float()

    @torch.no_grad()
    def last_logits(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded ``[b, s]`` tokens of ``lengths`` -> float32 ``[b, V_pad/tp]`` logits of
        each sequence's last token, recomputing the whole sequences (no cache). Causal
        attention: the padding after a sequence does not change its logits."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return self.logits(tokens)[rows, lengths.to(tokens.device) - 1]

    def new_cache(self, batch: int, length: int):
        """An empty ``KVCache`` for ``batch`` sequences of up to ``length`` positions."""
        from megatron_tempnet.models.attention import KVCache

        if self.model.attention_backend != "auto":
            raise InferenceError(
                f"--attention-backend {self.model.attention_backend}: the KV cache lives in the "
                "fused core attention: use --attention-backend auto, or --no-kv-cache to "
                "recompute the sequences at every step"
            )
        tp = resolve_tp_group(self.tp_group).size
        groups = (self.model.num_query_groups or self.model.num_attention_heads) // tp
        weight = next(self.lm.parameters())
        return KVCache(
            self.model.num_layers,
            batch,
            groups,
            self.model.hidden_size // self.model.num_attention_heads,
            length,
            weight.dtype,
            weight.device,
        )

    @torch.no_grad()
    def cached_logits(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache, last: torch.Tensor
    ) -> torch.Tensor:
        """One pass with ``cache`` (``cache.at`` set): float32 ``[b, V_pad/tp]`` logits of
        position ``last[i]`` of each sequence (``GPTStack.generation_forward``)."""
        device = tokens.device
        return self.lm.generation_forward(tokens, positions, cache, last.to(device)).float()

    @torch.no_grad()
    def final_hidden(self, tokens: torch.Tensor):
        """``[b, s]`` -> the output layer's input ``[s, b, h]`` and weight (``FinalHidden``)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
        return self.lm.final_hidden(tokens, positions)


def init_inference(tensor_parallel: int) -> None:
    """torch.distributed over this job's processes (``tensor_parallel`` of them) and
    megatron-core's groups; a lone process with TP = 1 needs no launcher."""
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.distributed.launch import (
        bind_device,
        init_default_group,
        launch_environment,
    )

    apply_cpu_support()
    if dist.is_initialized():  # the caller set up the processes
        world = dist.get_world_size()
    else:
        os.environ.update(launch_environment(os.environ))
        world = int(os.environ["WORLD_SIZE"])
    if world != tensor_parallel:
        raise InferenceError(
            f"--tensor-model-parallel-size ({tensor_parallel}) must equal the number of "
            f"processes ({world}): launch with torchrun --nproc-per-node {tensor_parallel}"
        )
    if dist.is_initialized():
        bind_device()  # before NCCL's first use
    else:
        init_default_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)


def load_inference_model(
    load_dir: str,
    *,
    pretrained_checkpoint: str | None = None,
    tempnet_dir: str | None = None,
    tau_max_eval: float | None = None,
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
    vocab_size: int | None = None,
) -> InferenceModel:
    """The model of ``load_dir`` at the current TP size (``init_inference`` first), its
    attention on ``attention_backend`` (``--attention-backend``).

    A frozen-LM run's checkpoint holds TempNet only: the LM then comes from
    ``pretrained_checkpoint`` (default: the one that run was started with). A Megatron-LM
    checkpoint (torch_dist or torch) loads too; ``vocab_size``: its tokenizer's (default: the
    one its saved args name).
    """
    from megatron_tempnet.models.gpt.layers import build_gpt_model

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    reader = open_reader(load_dir, vocab_size=vocab_size)
    lm_reader = reader
    if not reader.has_lm():
        saved = reader.config.get("checkpoint", {})
        source = pretrained_checkpoint or saved.get("pretrained_checkpoint")
        if not source:
            raise CheckpointError(
                f"--load {load_dir}: holds TempNet without the LM: add --pretrained-checkpoint"
            )
        lm_reader = open_reader(source, "--pretrained-checkpoint", vocab_size=vocab_size)
    # megatron-core's torch.compile'd bias fusions compute what the plain ops do; at one token
    # per step their guard checks cost more than they save (4.7 ms of 44 per token, 100M LLaMA)
    model = dataclasses.replace(
        lm_reader.model,
        attention_backend=attention_backend,
        bias_dropout_fusion=False,
        bias_swiglu_fusion=False,
        bias_gelu_fusion=False,
    )
    # also the pieces megatron-core does not build (GPT-2's learned positions)
    lm = build_gpt_model(model, tensor_parallel_size=tp, params_dtype=dtype).to(dtype)
    padded = model.padded_vocab_size(tp)
    names = [n for n in lm_names(model) if not n.endswith("_extra_state")]
    state = {
        n: shard(n, lm_reader.full(n), rank, tp, swiglu=model.swiglu, padded_vocab=padded)
        for n in names
    }
    missing, unexpected = lm.load_state_dict(state, strict=False)
    if [k for k in missing if not k.endswith("_extra_state")] or unexpected:
        raise CheckpointError(
            f"--load {load_dir}: does not match the model it describes (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    if torch.cuda.is_available():
        lm.cuda()
    tempnet = _tempnet(reader, tempnet_dir, padded, tau_max_eval, tp_group)
    config = reader.config or lm_reader.config
    return InferenceModel(lm.eval(), tempnet, model, config, tp_group)


def _tempnet(
    reader: CheckpointReader,
    tempnet_dir: str | None,
    padded: int,
    tau_max_eval: float | None,
    tp_group,
) -> TempNetLM | None:
    if tempnet_dir:
        from megatron_tempnet.tempnet.export import load_tempnet

        tempnet = load_tempnet(
            tempnet_dir, padded_vocab_size=padded, tp_group=tp_group, tau_max_eval=tau_max_eval
        )
    elif reader.has_tempnet():
        state = reader.tempnet_state()
        settings = saved_loss_settings(reader.config.get("loss", {}))
        tempnet = TempNetLM(
            reader.model.vocab_size,
            hidden_size=state["weight1"].shape[0],
            proj_size=state["weight2"].shape[0],
            tau_min=settings.get("tau_min", 0.001),
            tau_max=settings.get("tau_max", 2.0),
            padded_vocab_size=padded,
            tp_group=tp_group,
        )
        tempnet.load_state_dict({k: v.float() for k, v in state.items()})
        tempnet.tau_max_eval = tau_max_eval
    else:
        return None
    if torch.cuda.is_available():
        tempnet.cuda()
    return tempnet.eval()
