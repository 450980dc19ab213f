"""CLIP's towers from megatron-core layers: TP = 2 equals TP = 1 (forward and gradients), the
ViT attends bidirectionally, the text tower reads each caption up to its end-of-text token."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.models.clip.config import CLIPModelConfig
from megatron_tempnet.models.gpt import ModelConfigError
from tests.helpers.distributed import run_distributed

BATCH = 3


def _config() -> CLIPModelConfig:
    return CLIPModelConfig.from_preset(
        "clip-tiny", vocab_size=200, embed_dim=16
    )  # padded to 256 at TP 1 and 2


def _inputs(cfg: CLIPModelConfig):
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, cfg.image_channels, cfg.image_size, cfg.image_size, generator=gen)
    tokens = torch.randint(2, cfg.vocab_size, (BATCH, cfg.context_length), generator=gen)
    lengths = torch.tensor([5, cfg.context_length, 2])
    for row, n in enumerate(lengths.tolist()):
        tokens[row, n:] = 0
    return images, tokens, lengths


def _forward_backward(cfg: CLIPModelConfig):
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.clip.towers import CLIPModel

    apply_cpu_support()
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = CLIPModel(cfg, tensor_parallel_size=tp, seed=5)
    images, tokens, lengths = _inputs(cfg)
    image_emb, text_emb = model.encode_image(images), model.encode_text(tokens, lengths)
    (image_emb @ text_emb.t()).sum().backward()
    out = {
        "image": image_emb.detach(),
        "text": text_emb.detach(),
        "grads": {
            n: p.grad.clone()
            for n, p in model.named_parameters()
            if not getattr(p, "tensor_model_parallel", False)
        },
    }
    with torch.no_grad():
        changed = tokens.clone()
        changed[0, 5:] = 7  # after caption 0's end-of-text token
        out["padding_changed"] = model.encode_text(changed, lengths)
        last_patch = images.clone()
        last_patch[:, :, -1, -1] += 1.0  # a pixel of the last patch only
        out["last_patch_changed"] = model.encode_image(last_patch)
    return out


def test_tp2_equals_tp1_and_attention_pattern():
    cfg = _config()
    tp1 = run_distributed(_forward_backward, 1, args=(cfg,))[0]
    tp2 = run_distributed(_forward_backward, 2, args=(cfg,))
    assert tp1["image"].shape == tp1["text"].shape == (BATCH, 16)
    torch.testing.assert_close(tp1["image"].norm(dim=1), torch.ones(BATCH))
    for res in tp2:
        torch.testing.assert_close(res["image"], tp1["image"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res["text"], tp1["text"], rtol=1e-5, atol=1e-6)
        assert res["grads"].keys() == tp1["grads"].keys()
        for name, grad in tp1["grads"].items():  # replicated parameters: the full gradient
            torch.testing.assert_close(res["grads"][name], grad, rtol=1e-4, atol=1e-6)
    # tokens after the end-of-text token do not reach the pooled state (causal text attention)
    torch.testing.assert_close(tp1["padding_changed"], tp1["text"], rtol=0, atol=0)
    # the class token sees the last patch (bidirectional attention in the ViT)
    assert (tp1["last_patch_changed"] - tp1["image"]).abs().max() > 1e-4


def test_flag_checks():
    with pytest.raises(ModelConfigError, match="--image-size .17. must be divisible by --patch"):
        CLIPModelConfig.from_preset("clip-tiny", image_size=17).validate()
    with pytest.raises(ModelConfigError, match="--vision-heads .4. must be divisible by --tensor"):
        CLIPModelConfig.from_preset("clip-tiny").validate(tensor_parallel_size=3)
    with pytest.raises(ModelConfigError, match="--model 'nope' is not one of"):
        CLIPModelConfig.from_preset("nope")
