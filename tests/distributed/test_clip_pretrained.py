"""Pretrained towers: a randomly initialised Hugging Face ``CLIPModel`` (QuickGELU, built from
its config) imported into our towers at TP 1 and 2 gives its image and text embeddings within
1e-5; the same weights as an OpenCLIP state dict (written here from the Hugging Face one by
OpenCLIP's published layout) import to the same model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import hf_clip_config

EOS, VOCAB, CONTEXT = 98, 99, 16


def _hf_model():
    from transformers import CLIPModel

    config = hf_clip_config(128, 2, VOCAB, CONTEXT, EOS, channels=3, logit_scale_init_value=3.0)
    torch.manual_seed(11)
    model = CLIPModel(config).eval()
    with torch.no_grad():  # LayerNorms away from (1, 0), so their mapping matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _inputs():
    gen = torch.Generator().manual_seed(3)
    images = torch.randn(3, 3, 16, 16, generator=gen)
    lengths = torch.tensor([5, CONTEXT, 2])
    tokens = torch.randint(2, EOS, (3, CONTEXT), generator=gen)
    for row, n in enumerate(lengths.tolist()):  # the end-of-text token at length - 1, then pad
        tokens[row, n - 1] = EOS
        tokens[row, n:] = 1
    return images, tokens, lengths


def _open_clip_state(hf_state: dict) -> dict:
    """OpenCLIP's names and layouts of the Hugging Face weights (in_proj = [q; k; v], the
    projections as ``x @ proj``)."""
    out = {"logit_scale": hf_state["logit_scale"], "attn_mask": torch.zeros(CONTEXT, CONTEXT)}
    v, t = "vision_model.", "text_model."
    out["visual.conv1.weight"] = hf_state[v + "embeddings.patch_embedding.weight"]
    out["visual.class_embedding"] = hf_state[v + "embeddings.class_embedding"]
    out["visual.positional_embedding"] = hf_state[v + "embeddings.position_embedding.weight"]
    out["token_embedding.weight"] = hf_state[t + "embeddings.token_embedding.weight"]
    out["positional_embedding"] = hf_state[t + "embeddings.position_embedding.weight"]
    out["visual.proj"] = hf_state["visual_projection.weight"].t()
    out["text_projection"] = hf_state["text_projection.weight"].t()
    norms = (
        ("visual.ln_pre.", v + "pre_layrnorm."),
        ("visual.ln_post.", v + "post_layernorm."),
        ("ln_final.", t + "final_layer_norm."),
    )
    for ours, theirs in norms:
        for kind in ("weight", "bias"):
            out[ours + kind] = hf_state[theirs + kind]
    for ours, theirs in (("visual.transformer.resblocks.", v), ("transformer.resblocks.", t)):
        for i in range(2):
            a, b = f"{ours}{i}.", f"{theirs}encoder.layers.{i}."
            for kind in ("weight", "bias"):
                out[f"{a}attn.in_proj_{kind}"] = torch.cat(
                    [hf_state[f"{b}self_attn.{x}_proj.{kind}"] for x in "qkv"]
                )
                for o, h in (
                    ("ln_1", "layer_norm1"),
                    ("ln_2", "layer_norm2"),
                    ("attn.out_proj", "self_attn.out_proj"),
                    ("mlp.c_fc", "mlp.fc1"),
                    ("mlp.c_proj", "mlp.fc2"),
                ):
                    out[f"{a}{o}.{kind}"] = hf_state[f"{b}{h}.{kind}"]
    return out


def _import_and_encode(source: str):
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.clip import pretrained
    from megatron_tempnet.models.clip.config import CLIPLossConfig, CLIPModelConfig
    from megatron_tempnet.models.clip.objective import CLIPTrainModule
    from megatron_tempnet.models.clip.towers import CLIPModel

    apply_cpu_support()
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    hf = _hf_model()
    state = hf.state_dict()
    if source == "hf":
        fields = pretrained.config_from_hf(hf.config.to_dict())
        full = pretrained.full_from_hf(state, CLIPModelConfig(**fields))
    else:
        open_clip = _open_clip_state(state)
        fields = pretrained.config_from_open_clip(open_clip, quick_gelu=True)
        full = pretrained.full_from_hf(
            pretrained.hf_names_from_open_clip(open_clip), CLIPModelConfig(**fields)
        )
    config = CLIPModelConfig(**fields)
    module = CLIPTrainModule(
        CLIPModel(config, tensor_parallel_size=tp, seed=1), CLIPLossConfig(clip_loss="clip")
    )
    missing = pretrained.load_full(
        module,
        full,
        tensor_parallel=tp,
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        padded_vocab=config.padded_vocab_size(tp),
    )
    images, tokens, lengths = _inputs()
    with torch.no_grad():
        ours = module.eval().encode(images, tokens, lengths)
        out = hf(input_ids=tokens, pixel_values=images)  # normalised embeddings
        theirs = {"image": out.image_embeds, "text": out.text_embeds}
    return {
        "ours": ours,
        "theirs": theirs,
        "missing": missing,
        "fields": fields,
        "log_tau": module.log_tau.detach(),
    }


@pytest.mark.parametrize("source", ["hf", "open_clip"])
def test_imported_towers_give_the_reference_embeddings(source):
    for tp in (1, 2):
        for rank in run_distributed(_import_and_encode, tp, args=(source,)):
            assert rank["missing"] == []  # --clip-loss clip: log_tau from the logit scale
            assert rank["fields"]["quick_gelu"] and rank["fields"]["vision_heads"] == 2
            for side in ("image", "text"):
                got, expected = rank["ours"][side], rank["theirs"][side]
                assert got.shape == expected.shape == (3, 32)
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            assert float(rank["log_tau"]) == pytest.approx(-3.0)


def test_unsupported_checkpoints_are_named():
    from megatron_tempnet.models.clip import pretrained

    config = _hf_model().config.to_dict()
    config["vision_config"]["intermediate_size"] = 100
    with pytest.raises(pretrained.PretrainedCLIPError, match="vision_config.intermediate_size"):
        pretrained.config_from_hf(config)
    with pytest.raises(
        pretrained.PretrainedCLIPError, match="unknown OpenCLIP tensor 'visual.trunk"
    ):
        pretrained.hf_names_from_open_clip({"visual.trunk.stem.weight": torch.zeros(1)})
