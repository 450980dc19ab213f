"""Pretrained CLIP towers: Hugging Face ``CLIPModel`` and OpenCLIP ViT state dicts, in our names.

Both formats are mapped to the *full* tensors (``distributed.sharding``: one-process, vocabulary
unpadded) of ``CLIPTrainModule``'s parameters, which any TP rank then cuts by the parameter's
kind. What differs between the architectures is configuration of our towers, not code:

- pre-norm layers with a norm before the ViT (HF's ``pre_layrnorm``, OpenCLIP's ``ln_pre``):
  our ``VisionEmbedding.norm_pre``; the final norms pool the class token / end-of-text token;
- QuickGELU (OpenAI's weights): ``--quick-gelu``, read from ``hidden_act``;
- text pooling at the end-of-text token: our captions end with it at ``length - 1``, where HF
  and OpenCLIP pool (the highest token id / the ``eos_token_id``); a causal mask, so padding
  after it changes nothing;
- the patch convolution (no bias) is our linear patch embedding over ``(channel, row, col)``;
- attention: HF's separate q/k/v and OpenCLIP's ``in_proj`` become megatron-core's grouped
  ``linear_qkv``;
- the logit scale: ``log_tau = -logit_scale`` (``--clip-loss clip`` starts from it).
"""

from __future__ import annotations

import torch

from megatron_tempnet.models.clip.config import CLIPModelConfig
from megatron_tempnet.models.transformer import ModelConfigError

P = "clip.pieces."
_LAYER = {  # ours (in a layer) -> HF's (in ``encoder.layers.{i}.``)
    "input_layernorm.weight": "layer_norm1.weight",
    "input_layernorm.bias": "layer_norm1.bias",
    "self_attention.linear_proj.weight": "self_attn.out_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.out_proj.bias",
    "pre_mlp_layernorm.weight": "layer_norm2.weight",
    "pre_mlp_layernorm.bias": "layer_norm2.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
}


class PretrainedCLIPError(ModelConfigError):
    """A pretrained CLIP checkpoint this project cannot map; names the field or tensor."""


def config_from_hf(config: dict) -> dict:
    """``CLIPModelConfig`` fields from a Hugging Face ``CLIPConfig`` (its ``to_dict()``)."""
    vision, text = config["vision_config"], config["text_config"]
    for tower, c in (("vision", vision), ("text", text)):
        if c.get("intermediate_size") != 4 * c["hidden_size"]:
            raise PretrainedCLIPError(
                f"{tower}_config.intermediate_size ({c.get('intermediate_size')}) is not 4 x "
                f"hidden_size ({c['hidden_size']}): our towers' MLPs are 4 x wide"
            )
        if c.get("hidden_act") not in ("quick_gelu", "gelu"):
            raise PretrainedCLIPError(
                f"{tower}_config.hidden_act {c.get('hidden_act')!r}: quick_gelu or gelu only"
            )
        if abs(c.get("layer_norm_eps", 1e-5) - 1e-5) > 1e-12:
            raise PretrainedCLIPError(f"{tower}_config.layer_norm_eps must be 1e-5")
    if vision["hidden_act"] != text["hidden_act"]:
        raise PretrainedCLIPError("the towers' hidden_act differ: one activation for both")
    return dict(
        embed_dim=config["projection_dim"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        image_channels=vision.get("num_channels", 3),
        vision_layers=vision["num_hidden_layers"],
        vision_hidden_size=vision["hidden_size"],
        vision_heads=vision["num_attention_heads"],
        text_layers=text["num_hidden_layers"],
        text_hidden_size=text["hidden_size"],
        text_heads=text["num_attention_heads"],
        context_length=text["max_position_embeddings"],
        vocab_size=text["vocab_size"],
        quick_gelu=vision["hidden_act"] == "quick_gelu",
    )


def full_from_hf(state: dict[str, torch.Tensor], model: CLIPModelConfig) -> dict:
    """Our full tensors (``CLIPTrainModule``'s names) from a Hugging Face ``CLIPModel`` state."""

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise PretrainedCLIPError(f"the checkpoint has no tensor {name!r}")
        return state[name].float()

    out: dict[str, torch.Tensor] = {}
    v, t = "vision_model.", "text_model."
    patch = get(v + "embeddings.patch_embedding.weight")  # [h, C, p, p]
    out[P + "vision_embedding.patch_embedding.weight"] = patch.reshape(patch.shape[0], -1)
    out[P + "vision_embedding.class_embedding"] = get(v + "embeddings.class_embedding")
    out[P + "vision_embedding.position_embeddings"] = get(
        v + "embeddings.position_embedding.weight"
    )
    for kind in ("weight", "bias"):
        out[P + f"vision_embedding.norm_pre.norm.{kind}"] = get(v + f"pre_layrnorm.{kind}")
        out[P + f"vision_norm.norm.{kind}"] = get(v + f"post_layernorm.{kind}")
        out[P + f"text_norm.norm.{kind}"] = get(t + f"final_layer_norm.{kind}")
    out[P + "vision_projection.weight"] = get("visual_projection.weight")
    out[P + "text_embedding.word_embeddings.weight"] = get(t + "embeddings.token_embedding.weight")
    out[P + "text_embedding.position_embeddings.weight"] = get(
        t + "embeddings.position_embedding.weight"
    )
    out[P + "text_projection.weight"] = get("text_projection.weight")
    for tower, prefix, count in (
        ("vision", v, model.vision_layers),
        ("text", t, model.text_layers),
    ):
        for i in range(count):
            ours, theirs = f"{P}{tower}_layer{i}.layer.", f"{prefix}encoder.layers.{i}."
            for name, hf_name in _LAYER.items():
                out[ours + name] = get(theirs + hf_name)
            for kind in ("weight", "bias"):  # one query group per head: [q_h; k_h; v_h] by head
                q, k, w = (get(f"{theirs}self_attn.{x}_proj.{kind}") for x in "qkv")
                heads = model.vision_heads if tower == "vision" else model.text_heads
                grouped = [x.reshape(heads, -1, *x.shape[1:]) for x in (q, k, w)]
                out[ours + f"self_attention.linear_qkv.{kind}"] = torch.cat(grouped, 1).reshape(
                    -1, *q.shape[1:]
                )
    if "logit_scale" in state:
        out["log_tau"] = -get("logit_scale").reshape(1)
    return out


def hf_names_from_open_clip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An OpenCLIP ViT CLIP state dict (``visual.*``, ``transformer.*``, ...) under Hugging
    Face's names, so that ``full_from_hf`` reads it."""
    out = {}
    towers = {"visual.transformer.resblocks.": "vision_model.encoder.layers.",
              "transformer.resblocks.": "text_model.encoder.layers."}  # fmt: skip
    plain = {
        "visual.class_embedding": "vision_model.embeddings.class_embedding",
        "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
        "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
        "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        "positional_embedding": "text_model.embeddings.position_embedding.weight",
        "logit_scale": "logit_scale",
    }
    norms = {"visual.ln_pre.": "vision_model.pre_layrnorm.",
             "visual.ln_post.": "vision_model.post_layernorm.",
             "ln_final.": "text_model.final_layer_norm."}  # fmt: skip
    block = {"ln_1.": "layer_norm1.", "ln_2.": "layer_norm2.", "attn.out_proj.":
             "self_attn.out_proj.", "mlp.c_fc.": "mlp.fc1.", "mlp.c_proj.": "mlp.fc2."}  # fmt: skip
    for name, tensor in state.items():
        if name in plain:
            out[plain[name]] = tensor
        elif name in ("visual.proj", "text_projection"):  # x @ proj: [h, d]
            hf = "visual_projection.weight" if name == "visual.proj" else "text_projection.weight"
            out[hf] = tensor.t()
        elif any(name.startswith(n) for n in norms):
            prefix = next(n for n in norms if name.startswith(n))
            out[norms[prefix] + name[len(prefix) :]] = tensor
        elif any(name.startswith(tw) for tw in towers):
            prefix = next(tw for tw in towers if name.startswith(tw))
            index, rest = name[len(prefix) :].split(".", 1)
            layer = f"{towers[prefix]}{index}."
            if rest.startswith("attn.in_proj_"):
                kind = rest.removeprefix("attn.in_proj_")
                for x, part in zip("qkv", tensor.chunk(3, dim=0)):
                    out[f"{layer}self_attn.{x}_proj.{kind}"] = part
            elif any(rest.startswith(b) for b in block):
                b = next(b for b in block if rest.startswith(b))
                out[layer + block[b] + rest[len(b) :]] = tensor
            else:
                raise PretrainedCLIPError(f"unknown OpenCLIP tensor {name!r}")
        elif name != "attn_mask":  # OpenCLIP's causal mask buffer
            raise PretrainedCLIPError(
                f"unknown OpenCLIP tensor {name!r}: a ViT CLIP with a transformer text tower "
                "(not a ModifiedResNet, CoCa or timm/HF text tower) is expected"
            )
    return out


def config_from_open_clip(state: dict[str, torch.Tensor], quick_gelu: bool) -> dict:
    """``CLIPModelConfig`` fields read off an OpenCLIP ViT state dict's shapes (the head
    counts are not in it: 64-wide heads, OpenCLIP's default)."""

    def layers(prefix: str) -> int:
        return len({k[len(prefix) :].split(".")[0] for k in state if k.startswith(prefix)})

    conv, pos = state["visual.conv1.weight"], state["visual.positional_embedding"]
    grid = round((pos.shape[0] - 1) ** 0.5)
    vision_width, text_width = conv.shape[0], state["token_embedding.weight"].shape[1]
    return dict(
        embed_dim=state["visual.proj"].shape[1],
        image_size=grid * conv.shape[-1],
        patch_size=conv.shape[-1],
        image_channels=conv.shape[1],
        vision_layers=layers("visual.transformer.resblocks."),
        vision_hidden_size=vision_width,
        vision_heads=vision_width // 64,
        text_layers=layers("transformer.resblocks."),
        text_hidden_size=text_width,
        text_heads=text_width // 64,
        context_length=state["positional_embedding"].shape[0],
        vocab_size=state["token_embedding.weight"].shape[0],
        quick_gelu=quick_gelu,
    )


@torch.no_grad()
def load_full(module: torch.nn.Module, full: dict[str, torch.Tensor], *, tensor_parallel: int,
              tensor_parallel_rank: int, padded_vocab: int) -> list[str]:  # fmt: skip
    """Copy this TP rank's shard of every full tensor into ``module`` (``CLIPTrainModule``
    names); returns the parameters the checkpoint did not have (the temperature's)."""
    from megatron_tempnet.distributed.sharding import parameter_kind, shard_tensor

    missing = []
    for name, param in module.named_parameters():
        if name not in full:
            missing.append(name)
            continue
        kind = parameter_kind(name, param, swiglu=False)
        value = shard_tensor(kind, full[name], tensor_parallel_rank, tensor_parallel,
                             padded_vocab=padded_vocab)  # fmt: skip
        if value.shape != param.shape:
            raise PretrainedCLIPError(
                f"{name}: the checkpoint's shard is {tuple(value.shape)}, the model's "
                f"{tuple(param.shape)}: give the model flags the conversion printed"
            )
        param.copy_(value.to(param.dtype))
    unused = sorted(set(full) - {n for n, _ in module.named_parameters()} - {"log_tau"})
    if unused:
        raise PretrainedCLIPError(f"tensors the model has no place for: {unused[:5]}")
    return missing
