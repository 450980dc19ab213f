"""--apply-layernorm-1p: zero-centred norm weights (the norms multiply by 1 + weight), for
LayerNorm (GPT-2's shape) and RMSNorm (LLaMA's).

The model starts as the one without the flag (weights 0, so scale 1) and computes, with any
weights, what that model computes with 1 + weight; the Hugging Face export writes 1 + weight (the
exported model's logits equal ours) and the import subtracts it again. A checkpoint saved with
(without) the flag loads only with (without) it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from megatron.core import parallel_state

from megatron_tempnet.models.gpt import ModelConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import parity_model

SEQ, BATCH, VOCAB = 12, 2, 200


def _model(arch: str, one_p: bool) -> ModelConfig:
    return parity_model(arch, SEQ, VOCAB, llama_ffn=96, apply_layernorm_1p=one_p)


def _norm_weights(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "norm" in n and n.endswith("weight")}


class _Tensors:
    """``HFWeights``' reading interface over an exported state dict."""

    def __init__(self, state: dict):
        self.state = state

    def get(self, *names: str) -> torch.Tensor:
        return next(self.state[n] for n in names if n in self.state)


def _one_p(arch: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.inference.checkpoint_io import lm_names
    from megatron_tempnet.inference.hf_weights import from_hf, hf_config, to_hf
    from megatron_tempnet.models.gpt import build_gpt_model

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    cfg = _model(arch, one_p=True)
    one_p = build_gpt_model(cfg, seed=3)
    plain = build_gpt_model(_model(arch, one_p=False), seed=3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    out = {"initial": [p.detach().clone() for p in _norm_weights(one_p).values()]}
    with torch.no_grad():
        out["initial_logits"] = (one_p(tokens, positions), plain(tokens, positions))
        gen = torch.Generator().manual_seed(1)
        for name, p in _norm_weights(one_p).items():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)  # scale in [0.5, 1.5]
            _norm_weights(plain)[name].copy_(p + 1)
        out["logits"] = (one_p(tokens, positions), plain(tokens, positions))
    # the Hugging Face export of the 1p model, loaded by transformers
    state = one_p.state_dict()
    names = [n for n in lm_names(cfg) if not n.endswith("_extra_state")]
    unpad = {"pieces.0.word_embeddings.weight", f"pieces.{cfg.num_layers + 3}.output_layer.weight"}
    full = {n: state[n][:VOCAB] if n in unpad else state[n] for n in names}
    exported = dict(to_hf(cfg, full.__getitem__, names))
    hf = hf_config(cfg, torch.float32)
    hf_model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(hf.pop("model_type"), **hf), attn_implementation="eager"
    ).eval()
    missing, unexpected = hf_model.load_state_dict(exported, strict=False)
    assert not unexpected and not [m for m in missing if m != "lm_head.weight"], missing
    with torch.no_grad():
        out["hf_logits"] = (hf_model(tokens).logits, one_p(tokens, positions)[..., :VOCAB])
    # ... and imported back into a 1p model
    imported = from_hf(cfg, _Tensors(exported))
    out["imported"] = {n: (imported(n), full[n]) for n in names}
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def runs(request):
    return run_distributed(_one_p, 1, args=(request.param,))[0], request.param


def test_the_norms_start_at_zero_and_multiply_by_one_plus_weight(runs):
    out, arch = runs
    assert len(out["initial"]) == 5 and all(not w.any() for w in out["initial"])
    for key in ("initial_logits", "logits"):
        ours, plain = out[key]
        torch.testing.assert_close(ours, plain, rtol=1e-6, atol=1e-6)
    assert (out["logits"][0] - out["initial_logits"][0]).abs().max() > 1e-2  # the scales act


def test_the_hugging_face_export_writes_one_plus_weight(runs):
    out, arch = runs
    hf, ours = out["hf_logits"]
    torch.testing.assert_close(hf, ours, rtol=1e-4, atol=1e-4)
    norms = 0
    for name, (imported, original) in out["imported"].items():
        torch.testing.assert_close(imported, original, rtol=0, atol=1e-6, msg=name)
        norms += "norm" in name and name.endswith("weight")
    assert norms == 5


def _run_config(one_p: bool, load: str):
    from megatron_tempnet.data.gpt_data import GPTDataConfig
    from megatron_tempnet.data.tokenizers import TokenizerConfig
    from megatron_tempnet.models.gpt.task import (
        GPTOptimizerConfig,
        GPTRunConfig,
        GPTTrainingConfig,
    )
    from megatron_tempnet.trainer.config import CheckpointConfig

    return GPTRunConfig(
        model=_model("llama", one_p),
        data=GPTDataConfig(data_path=["unused"], seq_length=SEQ),
        tokenizer=TokenizerConfig(tokenizer_type="GPT2BPETokenizer"),
        training=GPTTrainingConfig(train_iters=1),
        optimizer=GPTOptimizerConfig(lr=1e-3),
        checkpoint=CheckpointConfig(load=load, save=load),
    )


def test_a_checkpoint_loads_only_with_its_own_norm_weights(tmp_path):
    """1p norm weights are offsets from 1, the others scales: the same tensors, so --load and
    --pretrained-checkpoint refuse a checkpoint saved the other way (older checkpoints, which
    do not record the flag, load)."""
    from megatron_tempnet.checkpoint.checkpoint_format import publish_latest
    from megatron_tempnet.checkpoint.checkpoint_writer import TRAIN_STATE
    from megatron_tempnet.models.gpt.task import validate_gpt
    from megatron_tempnet.trainer.config import ConfigError

    for saved, name in ((True, "one-p"), (False, "plain"), (None, "older")):
        os.makedirs(tmp_path / name / "iter_0000002")
        model = {} if saved is None else {"apply_layernorm_1p": saved}
        state = {"format": 2, "iteration": 2, "config": {"model": model}}
        (tmp_path / name / "iter_0000002" / TRAIN_STATE).write_text(json.dumps(state))
        publish_latest(str(tmp_path / name), "iter_0000002")
    validate_gpt(_run_config(True, str(tmp_path / "one-p")), 1)
    validate_gpt(_run_config(False, str(tmp_path / "plain")), 1)
    validate_gpt(_run_config(True, str(tmp_path / "older")), 1)
    with pytest.raises(ConfigError, match="iter_0000002 was saved with --apply-layernorm-1p"):
        validate_gpt(_run_config(False, str(tmp_path / "one-p")), 1)
    config = _run_config(True, str(tmp_path / "fresh"))
    config.checkpoint.pretrained_checkpoint = str(tmp_path / "plain")
    with pytest.raises(ConfigError, match="--pretrained-checkpoint .* without --apply-layernorm"):
        validate_gpt(config, 1)
