"""The GPT/LLaMA language model as a sequence of pieces, for one process or a pipeline.

The model is composed from megatron-core's layers (``VocabParallelEmbedding``, ``TransformerLayer``
on the local spec with the ``--attention-backend``'s core attention, its norm,
``ColumnParallelLinear``, ``RotaryEmbedding``; the shared pieces are ``models.transformer``'s) as a
flat list:

    WordEmbedding     (tokens, position_ids) -> (word embeddings [b, s, h], position_ids)
    EmbeddingOutput   + learned positions, [b, s, h] -> [s, b, h], dropout
    TransformerPiece  x num_layers, [s, b, h] -> [s, b, h] (RoPE, scaled or not, computed in
                      each layer)
    FinalNorm         [s, b, h]
    output layer      [s, b, h] -> logits [b, s, V_pad/tp] (tied: the WordEmbedding's weight)

With sequence parallelism (``--sequence-parallel``) everything from ``EmbeddingOutput``'s output
to the output layer's input is this TP rank's sequence shard ``[s/tp, b, h]`` (also what pipeline
stages pass on): ``EmbeddingOutput`` keeps its shard of the sequence, the layers' column-parallel
linears all-gather it and the row-parallel ones reduce-scatter back to it, and the output layer
all-gathers it (the fused output stage gathers one chunk of tokens at a time instead). The
gradients of the parameters applied to a shard (norms, row-parallel biases) are summed over the
TP group in the backward pass (``distributed.sequence_parallel``).

``gpt_layer_specs`` gives the list as DeepSpeed ``LayerSpec``s: ``GPTStack`` builds and runs them
in one process, and a DeepSpeed ``PipelineModule`` cuts the same list into stages. Every piece is
built right after ``seed_rngs(base_seed + its index)``, so a pipeline stage builds exactly the
weights the one-process model has at the same index, whatever the layout. ``PieceIndex`` says
which index each piece has; ``piece_key`` names a parameter of a piece as ``GPTStack``'s
state dict does (``pieces.{index}.…``, the same in every layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from megatron.core import parallel_state
from torch import nn

from megatron_tempnet.distributed.sequence_parallel import sum_sequence_parallel_grads
from megatron_tempnet.models.attention import layer_spec as attention_layer_spec
from megatron_tempnet.models.gpt.config import ModelConfig
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.models.transformer import (
    FinalNorm,
    TransformerPiece,
    seed_rngs,
    transformer_config,
    vocab_parallel_embedding,
)


@dataclass(frozen=True)
class PieceIndex:
    """The index of each piece in ``gpt_layer_specs``' list, for a model of ``num_layers``
    layers: its ``i`` in ``GPTStack``'s state-dict keys (``pieces.{i}.…``) and its seed
    (``base_seed + i``)::

        0            WordEmbedding (tied: also the output layer)
        1            EmbeddingOutput (GPT-2's learned positions)
        2 .. L+1     TransformerPiece, layer 0 .. L-1
        L+2          FinalNorm
        L+3          the output layer (OutputLayer; tied: WordEmbedding again)
        L+4          TempNet, when the run trains one (a pipeline's last piece)
    """

    num_layers: int
    embedding: ClassVar[int] = 0
    embedding_output: ClassVar[int] = 1

    def layer(self, i: int) -> int:
        """Transformer layer ``i`` (0-based)."""
        return 2 + i

    @property
    def final_norm(self) -> int:
        return self.num_layers + 2

    @property
    def output(self) -> int:
        return self.num_layers + 3

    @property
    def tempnet(self) -> int:
        return self.num_layers + 4


def piece_key(index: int, name: str) -> str:
    """``GPTStack``'s state-dict key of ``name`` in the piece at ``index``
    (``piece_key(PieceIndex.embedding, "word_embeddings.weight")``)."""
    return f"pieces.{index}.{name}"


class FinalHidden(NamedTuple):
    """What the output layer would multiply: the fused output stage's input
    (``losses.output_stage``), passed on instead of the logits (``--fused-output-stage``).

    A tuple of tensors, so that DeepSpeed's pipeline finds them in the last stage's outputs: it
    starts its backward pass (clearing the last micro-batch's 16-bit gradients) in a hook on the
    first of them that the backward pass reaches. On a pipeline stage the weight and TempNet's
    parameters are therefore views made in the forward pass (``stage_view``): their gradients
    pass those hooks before they accumulate.
    """

    hidden: torch.Tensor
    """``[s, b, h]`` the final norm's output; ``[s/tp, b, h]`` with ``sequence_parallel``."""
    weight: torch.Tensor
    """``[V_pad/tp, h]`` this rank's slice of the output layer (tied: the word embeddings)."""
    tempnet: nn.Module | None = None
    """TempNet, added by a pipeline's last piece."""
    tempnet_params: tuple[torch.Tensor, ...] | None = None
    """Views of TempNet's ``weight1`` and ``projection_parameters()`` (pipeline)."""
    sequence_parallel: bool = False
    """``hidden`` is this TP rank's sequence shard (``--sequence-parallel``)."""


def stage_view(param: torch.Tensor) -> torch.Tensor:
    """A parameter as a tensor of this forward pass (see ``FinalHidden``)."""
    return param.view_as(param)


EMBEDDING_OR_OUTPUT = "is_embedding_or_output_parameter"
"""The attribute megatron-core sets on the word embeddings' and the output layer's weights (the
weights --decoupled-lr applies to)."""


class WordEmbedding(nn.Module):
    """Vocabulary-parallel word embeddings; with tied weights also the output layer.

    ``forward`` embeds; ``project`` is the tied output layer (logits from the same weight),
    used by the last piece of the model (DeepSpeed's ``TiedLayerSpec`` keeps the copies on the
    first and last pipeline stages equal).
    """

    def __init__(self, config, vocab_size: int, tied: bool):
        super().__init__()
        self.word_embeddings = vocab_parallel_embedding(config, vocab_size)
        setattr(self.word_embeddings.weight, EMBEDDING_OR_OUTPUT, True)
        self.output_layer = _output_layer(config, vocab_size, shared_weight=True) if tied else None
        self.sequence_parallel = config.sequence_parallel

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]):
        tokens, position_ids = inputs  # [b, s] each
        return self.word_embeddings(tokens), position_ids  # [b, s, h]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s, b, h] (sequence parallel: [s/tp, b, h], all-gathered by the layer) -> logits
        [b, s, V_pad/tp] with the embedding's weight."""
        logits, _ = self.output_layer(hidden, weight=self.word_embeddings.weight)
        return logits.transpose(0, 1).contiguous()

    def final_hidden(self, hidden: torch.Tensor) -> FinalHidden:
        """The tied output layer's input instead of its logits (the fused output stage)."""
        weight = stage_view(self.word_embeddings.weight)
        return FinalHidden(hidden, weight, sequence_parallel=self.sequence_parallel)


class EmbeddingOutput(nn.Module):
    """Learned absolute positions (GPT-2; nothing for RoPE), the [s, b, h] layout, dropout.

    With sequence parallelism the output is this TP rank's shard ``[s/tp, b, h]`` (its backward
    pass all-gathers the gradient), its dropout drawn in megatron-core's model-parallel RNG
    stream (each shard its own), as megatron-core's embedding does.
    """

    def __init__(self, config, max_position_embeddings: int, learned_positions: bool):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.position_embeddings = None
        if learned_positions:
            self.position_embeddings = nn.Embedding(max_position_embeddings, config.hidden_size)
            if config.perform_initialization:
                config.embedding_init_method(self.position_embeddings.weight)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        embeddings, position_ids = inputs  # [b, s, h], [b, s]
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
        if not self.sequence_parallel:
            return self.dropout(embeddings)
        from megatron.core import tensor_parallel

        shard = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)  # [s/tp, b, h]
        # the shard is a view of the whole sequence: a copy lets the whole be freed
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.dropout(shard.clone())


class OutputLayer(nn.Module):
    """Untied output layer: [s, b, h] -> vocabulary-parallel logits [b, s, V_pad/tp]."""

    def __init__(self, config, vocab_size: int, fused: bool = False):
        super().__init__()
        self.output_layer = _output_layer(config, vocab_size, shared_weight=False)
        setattr(self.output_layer.weight, EMBEDDING_OR_OUTPUT, True)
        self.fused = fused
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | FinalHidden:
        if self.fused:
            return self.final_hidden(hidden)
        logits, _ = self.output_layer(hidden)
        return logits.transpose(0, 1).contiguous()

    def final_hidden(self, hidden: torch.Tensor) -> FinalHidden:
        """The output layer's input instead of its logits (the fused output stage)."""
        weight = stage_view(self.output_layer.weight)
        return FinalHidden(hidden, weight, sequence_parallel=self.sequence_parallel)


def _output_layer(config, vocab_size: int, shared_weight: bool):
    from megatron.core import tensor_parallel

    return tensor_parallel.ColumnParallelLinear(
        config.hidden_size,
        vocab_size,
        config=config,
        init_method=config.init_method,
        bias=False,
        gather_output=False,
        skip_weight_param_allocation=shared_weight,
    )


EMBEDDING_KEY = "embedding"


def gpt_layer_specs(
    model: ModelConfig,
    *,
    tensor_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    recompute: Recompute | None = None,
    fused_output_stage: bool = False,
    sequence_parallel: bool = False,
) -> list:
    """The model as DeepSpeed layer specs (built lazily, on the stage that owns them).

    Tied embeddings (GPT-2) are a ``TiedLayerSpec`` at both ends of the list. With
    ``fused_output_stage`` the last piece returns ``FinalHidden`` instead of the logits. With
    ``sequence_parallel`` (TP > 1) the pieces pass ``[s/tp, b, h]`` shards (module docstring);
    the builder then calls ``sum_sequence_parallel_grads`` on what it built. ``recompute``:
    selective recomputation is the layers' config; full recomputation is set up on the built
    layers of each stage (``Recompute.apply``).
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    config = transformer_config(
        model,
        tensor_parallel_size=tensor_parallel_size,
        params_dtype=params_dtype,
        sequence_parallel=sequence_parallel,
        selective_recompute=recompute is not None and recompute.selective,
    )
    own_norm = config.sequence_parallel or config.layernorm_zero_centered_gamma
    layer_spec = attention_layer_spec(
        model.normalization, model.attention_backend, own_norm=own_norm
    )
    vocab = model.padded_vocab_size(tensor_parallel_size)
    tied = not model.untie_embeddings_and_output_weights
    rope = model.rope()
    if tied:
        tied_weight = {"tied_weight_attr": ["word_embeddings.weight"]}
        embedding = TiedLayerSpec(EMBEDDING_KEY, WordEmbedding, config, vocab, True, **tied_weight)
        output = TiedLayerSpec(
            EMBEDDING_KEY,
            WordEmbedding,
            config,
            vocab,
            True,
            forward_fn=WordEmbedding.final_hidden if fused_output_stage else WordEmbedding.project,
            **tied_weight,
        )
    else:
        embedding = LayerSpec(WordEmbedding, config, vocab, False)
        output = LayerSpec(OutputLayer, config, vocab, fused_output_stage)
    layers = [
        LayerSpec(TransformerPiece, config, layer_spec, i + 1, rope)
        for i in range(model.num_layers)
    ]
    learned = model.position_embedding_type == "learned_absolute"
    return [  # in PieceIndex's order
        embedding,
        LayerSpec(EmbeddingOutput, config, model.max_position_embeddings, learned),
        *layers,
        LayerSpec(FinalNorm, config, layer_spec),
        output,
    ]


class GPTStack(nn.Module):
    """The pieces of ``gpt_layer_specs`` built and run in one process (no pipeline).

    ``forward(tokens [b, s], position_ids [b, s])`` -> logits ``[b, s, V_pad/tp]``.
    """

    def __init__(self, specs: list, base_seed: int, recompute: Recompute | None = None):
        super().__init__()
        from deepspeed.pipe import TiedLayerSpec

        self.pieces = nn.ModuleList()
        self.num_specs = len(specs)  # the next piece (TempNet) is seeded with base + this
        self.sequence_parallel_hooks: list = []
        self._calls: list = []
        tied: dict[str, nn.Module] = {}
        for index, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec) and spec.key in tied:
                module = tied[spec.key]
                self._calls.append(lambda x, m=module, fn=spec.forward_fn: fn(m, x))
                continue
            seed_rngs(base_seed + index)
            module = spec.build()
            if isinstance(spec, TiedLayerSpec):
                tied[spec.key] = module
            self.pieces.append(module)
            self._calls.append(module)
        if recompute is not None:
            recompute.apply([p for p in self.pieces if isinstance(p, TransformerPiece)])

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = (tokens, position_ids)
        for call in self._calls:
            x = call(x)
        return x

    def final_hidden(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> FinalHidden:
        """The output layer's input and weight instead of the logits (the fused output stage)."""
        x = (tokens, position_ids)
        for call in self._calls[:-1]:
            x = call(x)
        return FinalHidden(x, self.output_weight, sequence_parallel=self.sequence_parallel)

    def generation_forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        last: torch.Tensor,
    ) -> torch.Tensor:
        """One pass of generation with a ``models.attention.KVCache``: ``tokens`` and
        ``position_ids`` ``[b, s]`` (``cache.at`` set for them) -> the logits ``[b, V_pad/tp]``
        of position ``last[i]`` of each sequence (the output layer runs on those rows only)."""
        x = (tokens, position_ids)
        rotary = None
        for call in self._calls[:-1]:
            if isinstance(call, TransformerPiece):
                if rotary is None:
                    rotary = call.rotary_at(position_ids, cache.length)
                x = call.generation_forward(x, rotary, cache)
            else:
                x = call(x)
        rows = x[last, torch.arange(x.shape[1], device=x.device)]  # [b, h]
        return self._calls[-1](rows[None])[:, 0]  # [b, V_pad/tp]

    @property
    def embedding(self) -> WordEmbedding:
        return self.pieces[PieceIndex.embedding]

    def sum_sequence_parallel_grads(self, tp_group) -> None:
        """Sum the gradients of the parameters applied to sequence shards over ``tp_group``
        (``distributed.sequence_parallel``); the hooks' handles stay in
        ``sequence_parallel_hooks``."""
        self.sequence_parallel_hooks = sum_sequence_parallel_grads(self, tp_group)

    @property
    def sequence_parallel(self) -> bool:
        """The pieces pass ``[s/tp, b, h]`` sequence shards (``--sequence-parallel``)."""
        return self.embedding.sequence_parallel

    @property
    def output_weight(self) -> nn.Parameter:
        """The output layer's ``[V_pad/tp, h]`` weight (tied: the word embeddings')."""
        last = self.pieces[-1]
        if isinstance(last, OutputLayer):
            return last.output_layer.weight
        return self.embedding.word_embeddings.weight

    @property
    def final_norm(self) -> FinalNorm:
        return self.pieces[-2] if isinstance(self.pieces[-1], OutputLayer) else self.pieces[-1]


def build_gpt_model(
    model: ModelConfig,
    *,
    tensor_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    recompute: Recompute | None = None,
    seed: int = 1234,
    sequence_parallel: bool = False,
) -> GPTStack:
    """The one-process language model; its forward returns logits ``[b, s, V_pad/tp]``.

    megatron-core's ``parallel_state`` must be initialised (TP group) before the call. The
    weights depend on ``seed`` only, not on the parallel layout (on CPU). With
    ``sequence_parallel`` (TP > 1) the pieces pass sequence shards and the shard-applied
    parameters' gradients are summed over the TP group (the hooks' handles are the stack's
    ``sequence_parallel_hooks``).
    """
    specs = gpt_layer_specs(
        model,
        tensor_parallel_size=tensor_parallel_size,
        params_dtype=params_dtype,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
    )
    stack = GPTStack(specs, seed, recompute)
    if stack.sequence_parallel:
        stack.sum_sequence_parallel_grads(parallel_state.get_tensor_model_parallel_group())
    return stack
