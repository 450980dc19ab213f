"""CLIP's two towers from megatron-core transformer layers: a ViT and a text transformer.

Image tower (ViT): ``[b, C, S, S]`` pixels are cut into ``(S / p)^2`` patches, each embedded by
a linear map (CLIP's patch convolution without bias), a class token is prepended, learned
positions added, a pre-norm applied; then bidirectional megatron-core ``TransformerLayer``s,
the class token's final norm and a projection to the shared embedding.

Text tower: vocabulary-parallel token embeddings plus learned positions, causal
``TransformerLayer``s, a final norm, the hidden state at each caption's end-of-text token
(position ``length - 1``) and a projection to the shared embedding.

Both towers are tensor parallel exactly like the GPT model (attention heads, MLP columns and the
vocabulary split over the TP group); patch, class and position embeddings, norms and the
projections are replicated. Every piece is built right after ``seed_rngs(seed + its index)``,
so the weights do not depend on the parallel layout (on CPU). The model returns the L2-normalised
embeddings ``[b, d]``, identical on every TP rank.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_tempnet.models.attention import layer_spec
from megatron_tempnet.models.clip.config import CLIPModelConfig
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.models.transformer import (
    FinalNorm,
    TransformerPiece,
    seed_rngs,
    transformer_config,
    vocab_parallel_embedding,
)


class VisionEmbedding(nn.Module):
    """``[b, C, S, S]`` -> ``[s = 1 + patches, b, h]``: patches, class token, positions, norm."""

    def __init__(self, model: CLIPModelConfig, config):
        super().__init__()
        h, p = config.hidden_size, model.patch_size
        self.patch_size = p
        self.patch_embedding = nn.Linear(model.image_channels * p * p, h, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(h) * h**-0.5)
        self.position_embeddings = nn.Parameter(torch.randn(model.num_patches + 1, h) * h**-0.5)
        self.norm_pre = FinalNorm(config, layer_spec("LayerNorm", "unfused", causal=False))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, _, _ = images.shape
        p = self.patch_size
        patches = images.unfold(2, p, p).unfold(3, p, p)  # [b, C, S/p, S/p, p, p]
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)  # [b, P, C p p]
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))  # [b, P, h]
        cls = self.class_embedding.to(x.dtype).expand(b, 1, -1)
        x = torch.cat([cls, x], dim=1) + self.position_embeddings.to(x.dtype)
        return self.norm_pre(x.transpose(0, 1).contiguous())  # [s, b, h]


class TextEmbedding(nn.Module):
    """``[b, L]`` token ids -> ``[L, b, h]``: vocabulary-parallel embedding plus positions."""

    def __init__(self, model: CLIPModelConfig, config, padded_vocab: int):
        super().__init__()
        self.word_embeddings = vocab_parallel_embedding(config, padded_vocab)
        self.position_embeddings = nn.Embedding(model.context_length, config.hidden_size)
        config.embedding_init_method(self.position_embeddings.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)  # [b, L, h]
        return x.transpose(0, 1).contiguous()


class Projection(nn.Module):
    """``[b, h]`` -> ``[b, d]`` (no bias, replicated over TP)."""

    def __init__(self, hidden: int, embed_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(embed_dim, hidden) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def image_pooled(norm: nn.Module, projection: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The ViT's last hidden states ``[s, b, h]`` -> ``[b, d]``: the class token, normalised and
    projected."""
    return projection(norm(x)[0])


def text_pooled(
    norm: nn.Module, projection: nn.Module, x: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The text tower's last hidden states ``[L, b, h]`` -> ``[b, d]`` at each caption's
    end-of-text token (position ``length - 1``), normalised and projected."""
    eot = (lengths.long() - 1).clamp(0, x.shape[0] - 1)  # [b]
    return projection(norm(x)[eot, torch.arange(x.shape[1], device=x.device)])


def piece_builders(
    model: CLIPModelConfig,
    *,
    tensor_parallel_size: int,
    params_dtype: torch.dtype,
    recompute: Recompute | None = None,
) -> list[tuple[str, object]]:
    """``(name, build)`` of every piece in the order (and so with the seed ``seed + index``)
    both the one-process model and the pipeline stages build them."""
    model.validate(tensor_parallel_size)
    vision, text = model.vision_tower(), model.text_tower()
    selective = recompute is not None and recompute.selective
    kw = dict(
        tensor_parallel_size=tensor_parallel_size,
        params_dtype=params_dtype,
        selective_recompute=selective,
    )
    vconfig, tconfig = transformer_config(vision, **kw), transformer_config(text, **kw)
    vspec = layer_spec("LayerNorm", model.attention_backend, causal=False)
    tspec = layer_spec("LayerNorm", model.attention_backend)
    padded_vocab = model.padded_vocab_size(tensor_parallel_size)

    def layers(prefix: str, count: int, config, spec) -> list:
        def build(i: int):
            return lambda: TransformerPiece(config, spec, i + 1, None)

        return [(f"{prefix}_layer{i}", build(i)) for i in range(count)]

    return [
        ("vision_embedding", lambda: VisionEmbedding(model, vconfig)),
        *layers("vision", model.vision_layers, vconfig, vspec),
        ("vision_norm", lambda: FinalNorm(vconfig, vspec)),
        ("vision_projection", lambda: Projection(vision.hidden_size, model.embed_dim)),
        ("text_embedding", lambda: TextEmbedding(model, tconfig, padded_vocab)),
        *layers("text", model.text_layers, tconfig, tspec),
        ("text_norm", lambda: FinalNorm(tconfig, tspec)),
        ("text_projection", lambda: Projection(text.hidden_size, model.embed_dim)),
    ]


def build_piece(builders: list, name: str, seed: int, dtype: torch.dtype) -> nn.Module:
    """Piece ``name`` with the weights the one-process model gives it (``seed + its index``);
    in ``dtype`` (the embeddings and projections megatron-core does not build)."""
    index = [n for n, _ in builders].index(name)
    seed_rngs(seed + index)
    return dict(builders)[name]().to(dtype)


class CLIPModel(nn.Module):
    """The two towers; ``encode_image``/``encode_text`` return normalised ``[b, d]`` embeddings.

    ``forward(images [b, C, S, S], tokens [b, L], lengths [b])`` returns
    ``(image_features [b, d], text_features [b, d])`` before normalisation (TaU reads them).
    megatron-core's ``parallel_state`` (TP group) must be initialised first.
    """

    def __init__(
        self,
        model: CLIPModelConfig,
        *,
        tensor_parallel_size: int = 1,
        params_dtype: torch.dtype = torch.float32,
        recompute: Recompute | None = None,
        seed: int = 1234,
    ):
        super().__init__()
        self.config = model
        builders = piece_builders(
            model,
            tensor_parallel_size=tensor_parallel_size,
            params_dtype=params_dtype,
            recompute=recompute,
        )
        self.pieces = nn.ModuleDict(
            {name: build_piece(builders, name, seed, params_dtype) for name, _ in builders}
        )
        self.num_pieces = len(builders)
        if recompute is not None:  # each tower's layers (one stage: the whole model)
            recompute.apply([self.pieces[f"vision_layer{i}"] for i in range(model.vision_layers)])
            recompute.apply([self.pieces[f"text_layer{i}"] for i in range(model.text_layers)])

    def _layers(self, prefix: str, x: torch.Tensor, layers: int) -> torch.Tensor:
        for i in range(layers):
            x = self.pieces[f"{prefix}_layer{i}"](x)
        return x

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """``[b, C, S, S]`` -> ``[b, d]`` (not normalised): the class token, projected."""
        p = self.pieces
        x = self._layers("vision", p["vision_embedding"](images), self.config.vision_layers)
        return image_pooled(p["vision_norm"], p["vision_projection"], x)

    def text_features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[b, L]`` tokens, ``[b]`` lengths -> ``[b, d]`` at each end-of-text token."""
        p = self.pieces
        x = self._layers("text", p["text_embedding"](tokens), self.config.text_layers)
        return text_pooled(p["text_norm"], p["text_projection"], x, lengths)

    def forward(self, images, tokens, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image_features(images), self.text_features(tokens, lengths)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.image_features(images).float(), dim=-1)

    def encode_text(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.text_features(tokens, lengths).float(), dim=-1)
