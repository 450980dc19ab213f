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

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from megatron_tempnet.models.gpt import ModelConfig, ModelConfigError, transformer_config
from megatron_tempnet.models.gpt_layers import FinalNorm, TransformerPiece, seed_rngs

CLIP_PRESETS: dict[str, dict] = {
    # the CPU demo: 16 x 16 grayscale digits, 4 x 4 patches
    "clip-tiny": dict(
        embed_dim=64, image_size=16, patch_size=4, image_channels=1, vision_layers=2,
        vision_hidden_size=64, vision_heads=4, text_layers=2, text_hidden_size=64, text_heads=4,
        context_length=16,
    ),
    # OpenAI CLIP ViT-B/16's shape
    "vit-b-16": dict(
        embed_dim=512, image_size=224, patch_size=16, image_channels=3, vision_layers=12,
        vision_hidden_size=768, vision_heads=12, text_layers=12, text_hidden_size=512,
        text_heads=8, context_length=77,
    ),
}  # fmt: skip


@dataclass
class CLIPModelConfig:
    """Both towers' shapes (``--model`` preset, each field overridable by its flag)."""

    embed_dim: int = 64
    """--embed-dim: size of the shared, normalised embedding."""
    image_size: int = 16
    """--image-size: square input images of this many pixels per side."""
    patch_size: int = 4
    """--patch-size: ViT patches of this many pixels per side (divides --image-size)."""
    image_channels: int = 3
    """--image-channels: 3 (RGB) or 1 (grayscale)."""
    vision_layers: int = 2
    """--vision-layers"""
    vision_hidden_size: int = 64
    """--vision-hidden-size"""
    vision_heads: int = 4
    """--vision-heads"""
    text_layers: int = 2
    """--text-layers"""
    text_hidden_size: int = 64
    """--text-hidden-size"""
    text_heads: int = 4
    """--text-heads"""
    context_length: int = 16
    """--context-length: caption tokens per sample, end-of-text token included."""
    vocab_size: int | None = None
    """True vocabulary size (from the tokenizer when None)."""
    init_method_std: float = 0.02
    """--init-method-std"""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by"""

    @classmethod
    def from_preset(cls, name: str, **overrides) -> CLIPModelConfig:
        if name not in CLIP_PRESETS:
            raise ModelConfigError(f"--model {name!r} is not one of {', '.join(CLIP_PRESETS)}")
        fields = dict(CLIP_PRESETS[name])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def vision_tower(self) -> ModelConfig:
        return ModelConfig(
            num_layers=self.vision_layers, hidden_size=self.vision_hidden_size,
            num_attention_heads=self.vision_heads, seq_length=self.num_patches + 1,
            max_position_embeddings=self.num_patches + 1, init_method_std=self.init_method_std,
        )  # fmt: skip

    def text_tower(self) -> ModelConfig:
        return ModelConfig(
            num_layers=self.text_layers, hidden_size=self.text_hidden_size,
            num_attention_heads=self.text_heads, seq_length=self.context_length,
            max_position_embeddings=self.context_length, vocab_size=self.vocab_size,
            init_method_std=self.init_method_std,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
        )  # fmt: skip

    def validate(self, tensor_parallel_size: int = 1) -> None:
        if self.image_size % self.patch_size:
            raise ModelConfigError(
                f"--image-size ({self.image_size}) must be divisible by --patch-size "
                f"({self.patch_size})"
            )
        if self.image_channels not in (1, 3):
            raise ModelConfigError(f"--image-channels ({self.image_channels}) must be 1 or 3")
        if self.context_length < 2:
            raise ModelConfigError(f"--context-length ({self.context_length}) must be >= 2")
        for flag, value in (("--embed-dim", self.embed_dim), ("--vision-layers",
                            self.vision_layers), ("--text-layers", self.text_layers)):  # fmt: skip
            if value < 1:
                raise ModelConfigError(f"{flag} ({value}) must be >= 1")
        for tower, prefix in ((self.vision_tower(), "--vision"), (self.text_tower(), "--text")):
            try:
                tower.validate(tensor_parallel_size)
            except ModelConfigError as e:  # name the tower's own flags
                message = str(e).replace("--hidden-size", f"{prefix}-hidden-size")
                raise ModelConfigError(
                    message.replace("--num-attention-heads", f"{prefix}-heads")
                ) from None


class VisionEmbedding(nn.Module):
    """``[b, C, S, S]`` -> ``[s = 1 + patches, b, h]``: patches, class token, positions, norm."""

    def __init__(self, model: CLIPModelConfig, config):
        super().__init__()
        h, p = config.hidden_size, model.patch_size
        self.patch_size = p
        self.patch_embedding = nn.Linear(model.image_channels * p * p, h, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(h) * h**-0.5)
        self.position_embeddings = nn.Parameter(torch.randn(model.num_patches + 1, h) * h**-0.5)
        self.norm_pre = FinalNorm(config, _vision_spec())

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
        from megatron.core import tensor_parallel

        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            padded_vocab, config.hidden_size, init_method=config.embedding_init_method,
            config=config,
        )  # fmt: skip
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


def _vision_spec():
    """megatron-core's local layer spec with bidirectional attention (no mask)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="LayerNorm"))
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.no_mask}
    return spec


class CLIPModel(nn.Module):
    """The two towers; ``encode_image``/``encode_text`` return normalised ``[b, d]`` embeddings.

    ``forward(images [b, C, S, S], tokens [b, L], lengths [b])`` returns
    ``(image_features [b, d], text_features [b, d])`` before normalisation (TaU reads them).
    megatron-core's ``parallel_state`` (TP group) must be initialised first.
    """

    def __init__(self, model: CLIPModelConfig, *, tensor_parallel_size: int = 1,
                 params_dtype: torch.dtype = torch.float32, recompute: bool = False,
                 seed: int = 1234):  # fmt: skip
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        model.validate(tensor_parallel_size)
        self.config = model
        vision, text = model.vision_tower(), model.text_tower()
        kw = dict(tensor_parallel_size=tensor_parallel_size, params_dtype=params_dtype)
        vconfig, tconfig = transformer_config(vision, **kw), transformer_config(text, **kw)
        vspec, tspec = _vision_spec(), get_gpt_layer_local_spec(normalization="LayerNorm")
        builders = [
            ("vision_embedding", lambda: VisionEmbedding(model, vconfig)),
            *[(f"vision_layer{i}", lambda i=i: TransformerPiece(vconfig, vspec, i + 1, None,
                                                                recompute))
              for i in range(model.vision_layers)],
            ("vision_norm", lambda: FinalNorm(vconfig, vspec)),
            ("vision_projection", lambda: Projection(vision.hidden_size, model.embed_dim)),
            ("text_embedding", lambda: TextEmbedding(model, tconfig,
                                                     text.padded_vocab_size(tensor_parallel_size))),
            *[(f"text_layer{i}", lambda i=i: TransformerPiece(tconfig, tspec, i + 1, None,
                                                              recompute))
              for i in range(model.text_layers)],
            ("text_norm", lambda: FinalNorm(tconfig, tspec)),
            ("text_projection", lambda: Projection(text.hidden_size, model.embed_dim)),
        ]  # fmt: skip
        self.pieces = nn.ModuleDict()
        for index, (name, build) in enumerate(builders):
            seed_rngs(seed + index)
            self.pieces[name] = build()
        self.to(params_dtype)  # the embeddings and projections megatron-core does not build
        self.num_pieces = len(builders)

    def _run(self, prefix: str, x: torch.Tensor, layers: int) -> torch.Tensor:
        for i in range(layers):
            x = self.pieces[f"{prefix}_layer{i}"](x)
        return self.pieces[f"{prefix}_norm"](x)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """``[b, C, S, S]`` -> ``[b, d]`` (not normalised): the class token, projected."""
        x = self._run("vision", self.pieces["vision_embedding"](images), self.config.vision_layers)
        return self.pieces["vision_projection"](x[0])

    def text_features(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[b, L]`` tokens, ``[b]`` lengths -> ``[b, d]`` at each end-of-text token."""
        x = self._run("text", self.pieces["text_embedding"](tokens), self.config.text_layers)
        eot = (lengths.long() - 1).clamp(0, tokens.shape[1] - 1)  # [b]
        pooled = x[eot, torch.arange(tokens.shape[0], device=x.device)]  # [b, h]
        return self.pieces["text_projection"](pooled)

    def forward(self, images, tokens, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image_features(images), self.text_features(tokens, lengths)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.image_features(images).float(), dim=-1)

    def encode_text(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.text_features(tokens, lengths).float(), dim=-1)


def clip_model_summary(model: CLIPModelConfig) -> dict:
    return dataclasses.asdict(model)
