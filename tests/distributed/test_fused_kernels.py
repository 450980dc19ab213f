"""The fast model path computes the model of the slow one: fused attention (``--attention-backend
auto``) and megatron-core's bias fusions against megatron-core's unfused attention without them,
for GPT-2 and LLaMA (grouped-query attention) at TP 1 and 2 with recomputation and for both CLIP
towers; the fused core attention against a float64 formula; PyTorch's fused AdamW against its
per-tensor loop.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.models.clip.config import CLIPModelConfig
from megatron_tempnet.models.gpt import ModelConfig
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.utils.compilers import compiler_missing
from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import LLAMA_SHAPE

SEQ, BATCH = 16, 2
SLOW = dict(
    attention_backend="unfused",
    bias_gelu_fusion=False,
    bias_swiglu_fusion=False,
    bias_dropout_fusion=False,
)
ARCHS = {
    # GPT-2: learned positions, tied embeddings, biases, tanh GELU (the fused bias-GELU)
    "gpt2": dict(openai_gelu=True),
    # LLaMA: RoPE, RMSNorm, SwiGLU (the fused bias-SwiGLU), 4 heads sharing 2 key/value groups
    "llama-gqa": LLAMA_SHAPE,
}


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _gpt_fast_vs_slow(cfg: ModelConfig, recompute: Recompute | None) -> dict:
    """Forward + backward of the same weights on both paths; this rank's relative differences."""
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import build_gpt_model

    apply_cpu_support()
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)

    def run(model_cfg):
        model = build_gpt_model(model_cfg, tensor_parallel_size=tp, recompute=recompute, seed=3)
        logits = model(tokens, positions)  # [b, s, V_pad / tp]
        (logits.float() ** 2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        cores = {type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__}
        return logits.detach(), grads, cores

    slow, slow_grads, slow_cores = run(dataclasses.replace(cfg, **SLOW))
    fast, fast_grads, fast_cores = run(cfg)
    return {
        "logits": _relative(fast, slow),
        "grads": {n: _relative(fast_grads[n], g) for n, g in slow_grads.items()},
        "cores": (sorted(slow_cores), sorted(fast_cores)),
    }


SELECTIVE, FULL = Recompute("selective"), Recompute("full", "uniform", 1)


@pytest.mark.parametrize(
    "arch,tp,recompute",
    [("gpt2", 1, None), ("gpt2", 2, SELECTIVE), ("llama-gqa", 1, FULL), ("llama-gqa", 2, None)],
)
def test_fused_path_equals_unfused_gpt(arch, tp, recompute):
    cfg = ModelConfig.from_preset("tiny", vocab_size=200, **ARCHS[arch])
    cfg.max_position_embeddings = cfg.seq_length = SEQ
    for rank in run_distributed(_gpt_fast_vs_slow, tp, args=(cfg, recompute)):
        slow_cores, fast_cores = rank["cores"]
        assert "DotProductAttention" in slow_cores and "FusedCoreAttention" in fast_cores
        assert "DotProductAttention" not in fast_cores
        assert rank["logits"] < 1e-5
        assert len(rank["grads"]) > 10 and max(rank["grads"].values()) < 1e-5, rank["grads"]


def _clip_fast_vs_slow(cfg: CLIPModelConfig) -> dict:
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.clip.towers import CLIPModel

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(3, cfg.image_channels, cfg.image_size, cfg.image_size, generator=gen)
    tokens = torch.randint(2, cfg.vocab_size, (3, cfg.context_length), generator=gen)
    lengths = torch.tensor([5, cfg.context_length, 2])

    def run(model_cfg):
        model = CLIPModel(model_cfg, seed=4)
        image, text = model(images, tokens, lengths)
        (image.pow(2).sum() + text.pow(3).sum()).backward()
        return image.detach(), text.detach(), {n: p.grad for n, p in model.named_parameters()}

    slow_image, slow_text, slow_grads = run(dataclasses.replace(cfg, **SLOW))
    image, text, grads = run(cfg)
    return {
        "image": _relative(image, slow_image),
        "text": _relative(text, slow_text),
        "grads": {n: _relative(grads[n], g) for n, g in slow_grads.items() if g is not None},
    }


def test_fused_path_equals_unfused_clip_towers():
    cfg = CLIPModelConfig.from_preset("clip-tiny", vocab_size=200, embed_dim=16)
    (got,) = run_distributed(_clip_fast_vs_slow, 1, args=(cfg,))
    assert got["image"] < 1e-5 and got["text"] < 1e-5
    vision = {n: d for n, d in got["grads"].items() if "vision" in n}
    text = {n: d for n, d in got["grads"].items() if "text" in n}
    assert len(vision) > 10 and len(text) > 10
    assert max(got["grads"].values()) < 1e-5, got["grads"]


def _reference_attention(q, k, v, causal: bool) -> torch.Tensor:
    """float64 ``softmax(q k^T / sqrt(d)) v`` with key/value groups repeated; queries are the
    last ``sq`` of ``sk`` positions. q ``[sq, b, np, d]``, k/v ``[sk, b, ng, d]`` ->
    ``[sq, b, np d]``."""
    q, k, v = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))  # [b, heads, s, d]
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [b, np, sq, sk]
    sq, sk = scores.shape[-2:]
    if causal:
        future = torch.arange(sk)[None, :] > torch.arange(sk - sq, sk)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    out = scores.softmax(-1) @ v  # [b, np, sq, d]
    return out.permute(2, 0, 1, 3).reshape(sq, q.shape[0], -1)


def _core_attention_cases() -> dict:
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.attention import FusedCoreAttention
    from megatron_tempnet.models.transformer import TransformerShape, seed_rngs, transformer_config

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    seed_rngs(0)  # attention dropout draws from megatron-core's model-parallel RNG
    shape = TransformerShape(hidden_size=32, num_attention_heads=4, num_query_groups=2)
    config = transformer_config(shape)
    gen = torch.Generator().manual_seed(1)
    results = {}
    for name, mask, sq, sk in [
        ("causal", AttnMaskType.causal, 7, 7),
        ("causal, 3 new queries on 7 keys", AttnMaskType.causal, 3, 7),
        ("no mask", AttnMaskType.no_mask, 5, 9),
    ]:
        core = FusedCoreAttention(config, 1, mask).eval()
        q = torch.randn(sq, 2, 4, 8, generator=gen)
        k, v = torch.randn(2, sk, 2, 2, 8, generator=gen)
        ref = _reference_attention(q, k, v, mask == AttnMaskType.causal)
        results[name] = _relative(core(q, k, v, None).double(), ref)
    config.attention_dropout = 0.5
    core = FusedCoreAttention(config, 1, AttnMaskType.causal)
    q, k, v = torch.randn(3, 6, 2, 4, 8, generator=gen)
    k, v = k[:, :, :2], v[:, :, :2]
    dropped = core.train()(q, k, v, None)
    results["dropout"] = _relative(dropped, core.eval()(q, k, v, None))
    return results


def test_fused_core_attention_against_a_float64_formula():
    (got,) = run_distributed(_core_attention_cases, 1)
    for case in ("causal", "causal, 3 new queries on 7 keys", "no mask"):
        assert got[case] < 1e-6, (case, got[case])
    assert got["dropout"] > 0.1  # attention dropout acts in training only


def test_fused_adamw_equals_the_per_tensor_loop():
    from megatron_tempnet.trainer.config import OptimizerConfig
    from megatron_tempnet.trainer.engine import build_optimizer
    from megatron_tempnet.trainer.task import ParamGroup

    gen = torch.Generator().manual_seed(2)
    start = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen)]
    grads = [[torch.randn_like(p, generator=gen) for p in start] for _ in range(4)]
    opt_cfg = OptimizerConfig(adam_beta2=0.95)

    def train(make):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = make(params)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        return optimizer, params

    def ours(ps):
        groups = [
            ParamGroup("w", ps[:1], 1e-2, 0.0, 0.1, "lm"),
            ParamGroup("b", ps[1:], 3e-2, 0.0, 0.0, "lm"),
        ]
        return build_optimizer(groups, opt_cfg)

    fused, got = train(ours)
    assert fused.defaults["fused"] is True
    loop, ref = train(
        lambda ps: torch.optim.AdamW(
            [
                {"params": ps[:1], "lr": 1e-2, "weight_decay": 0.1},
                {"params": ps[1:], "lr": 3e-2, "weight_decay": 0.0},
            ],
            betas=(opt_cfg.adam_beta1, 0.95),
            eps=opt_cfg.adam_eps,
            foreach=False,
        )
    )
    for p, r in zip(got, ref):
        assert not torch.equal(p, start[0] if p.ndim == 2 else start[1])
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


@pytest.fixture
def fresh_probe():
    """The compile probe and its warning run again (each runs once per process)."""
    from megatron_tempnet.models import fusions

    for cached in (fusions._compile_probe, fusions.warn_fusions_off):
        cached.cache_clear()
    yield fusions
    for cached in (fusions._compile_probe, fusions.warn_fusions_off):
        cached.cache_clear()


def test_without_a_compiler_the_fusions_are_off_with_a_warning(monkeypatch, caplog, fresh_probe):
    from megatron_tempnet.models import transformer

    shape = transformer.TransformerShape(swiglu=True, add_bias_linear=False)
    with_compiler = transformer.transformer_config(shape)
    assert with_compiler.bias_activation_fusion and with_compiler.bias_dropout_fusion
    monkeypatch.setenv("CXX", "no-such-compiler")
    with caplog.at_level("WARNING"):
        without = transformer.transformer_config(shape)
    assert not without.bias_activation_fusion and not without.bias_dropout_fusion
    assert "no C++ compiler (no-such-compiler)" in caplog.text


def test_a_compiler_that_fails_turns_the_fusions_off_not_the_run(
    monkeypatch, tmp_path, caplog, fresh_probe
):
    """A compiler that is there but fails (on a GPU: Triton without libcuda.so, a ptxas that
    does not know the GPU) passes the check for a compiler, and megatron-core's first fused call
    then stopped the run; the probe fails instead, and the fusions are off with one warning."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu
    from torch._inductor import config as inductor

    from megatron_tempnet.models import transformer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing compiled is reused
    torch._dynamo.reset()
    assert compiler_missing(False, {"CXX": "false"}) is None
    shape = transformer.TransformerShape(openai_gelu=True, add_bias_linear=True)
    try:
        with inductor.patch({"cpp.cxx": (None, "false")}):  # a C++ compiler that fails
            with pytest.raises(Exception, match="false"):  # the first step, without the probe
                bias_gelu(torch.zeros(4), torch.ones(2, 4))
            with caplog.at_level("WARNING"):
                config = transformer.transformer_config(shape)
    finally:
        torch._dynamo.reset()
    assert not config.bias_activation_fusion and not config.bias_dropout_fusion
    [line] = [r.getMessage() for r in caplog.records if "fusions are off" in r.getMessage()]
    assert line.startswith("torch.compile failed on a probe (")


def test_on_a_gpu_triton_needs_a_c_compiler_and_python_headers(tmp_path):
    """Triton compiles a C launcher: without a C compiler or Python.h the fusions would fail at
    the first step on a GPU; they are reported missing instead (and turned off, as above)."""

    cc = shutil.which("gcc") or shutil.which("cc")
    assert compiler_missing(True, {"CC": cc}) is None  # this machine has both
    assert compiler_missing(True, {"CC": "no-such-cc"}) == ("no C compiler (no-such-cc) for Triton")
    missing = compiler_missing(True, {"CC": cc}, include=str(tmp_path))
    assert missing == f"no Python headers ({tmp_path}/Python.h) for Triton: install python3-dev"
    assert compiler_missing(False, {"CXX": "no-such-cxx"}) == (
        "no C++ compiler (no-such-cxx) for torch.compile"
    )
