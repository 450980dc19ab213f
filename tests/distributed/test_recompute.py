"""Activation recomputation (--recompute-granularity/-method/-num-layers): the same logits and
gradients as keeping every activation (float32 within 1e-6, float64 exactly), for GPT and CLIP,
in one process and on two pipeline stages; and what the backward pass keeps shrinks as each
mode says, counted tensor by tensor with ``torch.autograd.graph.saved_tensors_hooks``."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.models.clip.config import CLIPModelConfig
from megatron_tempnet.models.gpt import ModelConfig
from megatron_tempnet.models.recompute import Recompute
from megatron_tempnet.trainer.config import ConfigError, RunConfig, TrainingConfig
from megatron_tempnet.trainer.validation import validate_run
from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import LLAMA_SHAPE

SEQ, BATCH, LAYERS = 16, 2, 4
MODES = {
    "none": Recompute(),
    "uniform-1": Recompute("full", "uniform", 1),
    "uniform-2": Recompute("full", "uniform", 2),
    "uniform-3": Recompute("full", "uniform", 3),  # chunks of 3 and 1
    "block-1": Recompute("full", "block", 1),
    "block-3": Recompute("full", "block", 3),
    "selective": Recompute("selective"),
}


def _gpt(backend: str, llama: bool = False) -> ModelConfig:
    shape = LLAMA_SHAPE if llama else {}
    cfg = ModelConfig.from_preset("tiny", vocab_size=200, num_layers=LAYERS, **shape)
    cfg.attention_backend = backend
    cfg.max_position_embeddings = cfg.seq_length = SEQ
    return cfg


def _inputs(vocab: int):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ)[None].expand(BATCH, SEQ)


class SavedBytes:
    """Bytes of the distinct storages the autograd graph keeps for backward while active."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def __enter__(self):
        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _one_process(configs: dict, dtype: torch.dtype) -> dict:
    """For each ``{name: (ModelConfig, Recompute)}``: logits, gradients, saved bytes."""
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import build_gpt_model

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    out = {}
    for name, (cfg, recompute) in configs.items():
        # as DeepSpeed casts the module (the learned positions are no megatron-core layer)
        model = build_gpt_model(cfg, recompute=recompute, seed=3).to(dtype)
        tokens, positions = _inputs(cfg.vocab_size)
        with SavedBytes() as saved:
            logits = model(tokens, positions)  # [b, s, V_pad]
        (logits.double() ** 2).mean().backward()
        out[name] = {
            "logits": logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "saved": saved.total,
        }
    return out


def _compare(results: dict, reference: str, exact: bool) -> None:
    ref = results[reference]
    for name, got in results.items():
        pairs = [(got["logits"], ref["logits"])]
        pairs += [(got["grads"][n], g) for n, g in ref["grads"].items()]
        assert len(pairs) > 20
        for a, b in pairs:
            if exact:
                assert torch.equal(a, b), name
            else:
                assert (a - b).abs().max() <= 1e-6 * b.abs().max(), name


@pytest.mark.parametrize("backend", ["auto", "unfused"])
def test_every_mode_gives_the_same_gradients_in_one_process(backend):
    for dtype, exact in ((torch.float32, False), (torch.float64, True)):
        configs = {name: (_gpt(backend), r) for name, r in MODES.items()}
        configs["llama-none"] = (_gpt(backend, llama=True), Recompute())
        configs["llama-uniform-3"] = (_gpt(backend, llama=True), MODES["uniform-3"])
        configs["llama-selective"] = (_gpt(backend, llama=True), MODES["selective"])
        (results,) = run_distributed(_one_process, 1, args=(configs, dtype))
        llama = {k: v for k, v in results.items() if k.startswith("llama")}
        _compare({k: v for k, v in results.items() if k not in llama}, "none", exact)
        _compare(llama, "llama-none", exact)


def test_saved_activations_shrink_as_each_mode_says():
    """4 layers; ``x`` = a layer's input [s, b, h] in float32."""
    configs = {name: (_gpt("unfused"), r) for name, r in MODES.items()}
    (results,) = run_distributed(_one_process, 1, args=(configs, torch.float32))
    saved = {name: r["saved"] for name, r in results.items()}
    cfg = _gpt("unfused")
    x = SEQ * BATCH * cfg.hidden_size * 4
    # full + block: each of the first n layers keeps its input instead of everything it keeps
    layer = saved["none"] - saved["block-1"]  # P - x
    assert layer > 10 * x  # a layer keeps much more than its input
    assert saved["block-1"] - saved["block-3"] == 2 * layer
    # full + uniform: one input per chunk (4, 2 and 2 chunks), nothing else of the layers
    assert saved["uniform-1"] - saved["uniform-2"] == 2 * x
    assert saved["uniform-2"] == saved["uniform-3"]
    # the unfused attention's causal mask [s, s] (bool), shared by the layers that keep all
    mask = SEQ * SEQ
    assert saved["block-3"] - saved["uniform-1"] == layer + mask
    # selective: every layer's softmax [b, heads, s, s] and the shared mask are not kept; the
    # checkpoint keeps megatron-core's mask-type code (an int32) per layer
    softmax = BATCH * cfg.num_attention_heads * SEQ * SEQ * 4
    assert saved["none"] - saved["selective"] == LAYERS * softmax + mask - LAYERS * 4


def _clip(configs: dict) -> dict:
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.clip.towers import CLIPModel

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    out = {}
    for name, (cfg, recompute) in configs.items():
        gen = torch.Generator().manual_seed(0)
        images = torch.randn(3, cfg.image_channels, cfg.image_size, cfg.image_size, generator=gen)
        tokens = torch.randint(2, cfg.vocab_size, (3, cfg.context_length), generator=gen)
        lengths = torch.tensor([5, cfg.context_length, 2])
        model = CLIPModel(cfg, recompute=recompute, seed=4).double()
        with SavedBytes() as saved:
            image, text = model(images.double(), tokens, lengths)
        (image.pow(2).sum() + text.pow(3).sum()).backward()
        out[name] = {
            "logits": torch.cat([image, text]).detach(),
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            "saved": saved.total,
        }
    return out


def test_clip_towers_recompute_exactly():
    cfg = CLIPModelConfig.from_preset(
        "clip-tiny", vocab_size=200, embed_dim=16, vision_layers=3, text_layers=3
    )
    names = ("none", "uniform-2", "block-1", "selective")
    configs = {n: (cfg, MODES[n]) for n in names}
    configs["selective-unfused"] = (
        dataclasses.replace(cfg, attention_backend="unfused"),
        MODES["selective"],
    )
    configs["none-unfused"] = (configs["selective-unfused"][0], MODES["none"])
    (results,) = run_distributed(_clip, 1, args=(configs,))
    unfused = {k: results.pop(k) for k in ("selective-unfused", "none-unfused")}
    _compare(results, "none", exact=True)
    _compare(unfused, "none-unfused", exact=True)
    saved = {name: r["saved"] for name, r in results.items()}
    assert saved["uniform-2"] < saved["block-1"] < saved["none"]
    assert unfused["selective-unfused"]["saved"] < unfused["none-unfused"]["saved"]


def _pipeline(cfg: ModelConfig, modes: dict) -> dict:
    """Two stages run by hand (forward, send, backward, send back): each stage's gradients under
    their one-process names, and the bytes each stage keeps."""
    import deepspeed

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt.objective import LossConfig
    from megatron_tempnet.models.gpt.pipeline import build_pipeline

    apply_cpu_support()
    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # read by DeepSpeed's PipelineModule
    deepspeed.init_distributed("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    stage = dist.get_rank()
    out = {}
    for name, recompute in modes.items():
        module = build_pipeline(
            cfg,
            LossConfig(loss="ce", tau_source="fixed", fused_output_stage=False),
            tensor_parallel=1,
            pipeline_parallel=2,
            dtype=torch.float32,
            recompute=recompute,
            freeze_lm=False,
            seed=3,
            tempnet_kwargs={},
            tp_group=parallel_state.get_tensor_model_parallel_group(),
        )
        module.double().train()
        hidden = torch.zeros(SEQ, BATCH, cfg.hidden_size, dtype=torch.float64)
        with SavedBytes() as saved:
            if stage == 0:
                hidden = module(_inputs(cfg.vocab_size))
                dist.send(hidden.detach(), 1)
            else:
                dist.recv(hidden, 0)
                hidden.requires_grad_(True)
                logits = module(hidden)
        if stage == 0:
            grad = torch.zeros_like(hidden)
            dist.recv(grad, 1)
            hidden.backward(grad)
        else:
            (logits**2).mean().backward()
            dist.send(hidden.grad, 0)
        grads = {n: p.grad for n, p in module.layout_free_parameters()}
        out[name] = {"grads": grads, "saved": saved.total}
    return out


def _reference(cfg: ModelConfig) -> dict:
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import build_gpt_model

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    model = build_gpt_model(cfg, seed=3).double()
    (model(*_inputs(cfg.vocab_size)) ** 2).mean().backward()
    return {f"lm.{n}": p.grad for n, p in model.named_parameters()}


def test_pipeline_stages_recompute_their_own_layers():
    """PP 2, two layers per stage: block 1 recomputes the first layer of each stage, uniform 3
    each stage's two layers as one chunk; the gradients are the one-process model's."""
    cfg = _gpt("auto", llama=True)
    (reference,) = run_distributed(_reference, 1, args=(cfg,))
    modes = {n: MODES[n] for n in ("none", "uniform-1", "uniform-3", "block-1", "selective")}
    stages = run_distributed(_pipeline, 2, args=(cfg, modes), timeout=300)
    for stage in stages:
        for name in modes:
            grads = stage[name]["grads"]
            assert len(grads) > 5
            for n, g in grads.items():
                assert torch.equal(g, reference[n]), (name, n)
        saved = {name: stage[name]["saved"] for name in modes}
        # each layer recomputed saves the same: block 1 is half of uniform 1 on every stage
        assert saved["none"] - saved["block-1"] == saved["block-1"] - saved["uniform-1"] > 0
        x = SEQ * BATCH * cfg.hidden_size * 8  # a layer's float64 input
        assert saved["uniform-1"] - saved["uniform-3"] == x
        assert saved["selective"] < saved["none"]


CLIP_DEEP = dict(vocab_size=200, embed_dim=16, vision_layers=4, text_layers=4)


def _clip_inputs(cfg: CLIPModelConfig):
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(3, cfg.image_channels, cfg.image_size, cfg.image_size, generator=gen)
    tokens = torch.randint(2, cfg.vocab_size, (3, cfg.context_length), generator=gen)
    return images.double(), tokens, torch.tensor([5, cfg.context_length, 2])


def _clip_pipeline(cfg: CLIPModelConfig, modes: dict) -> dict:
    """CLIP's two stages by hand (the towers' streams sent and their gradients sent back)."""
    import deepspeed

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.clip.config import CLIPLossConfig
    from megatron_tempnet.models.clip.pipeline import build_pipeline

    apply_cpu_support()
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    deepspeed.init_distributed("gloo")
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    stage, out = dist.get_rank(), {}
    images, tokens, lengths = _clip_inputs(cfg)
    for name, recompute in modes.items():
        module = (
            build_pipeline(
                cfg,
                CLIPLossConfig(),
                tensor_parallel=1,
                pipeline_parallel=2,
                dtype=torch.float32,
                recompute=recompute,
                seed=4,
                dp_group=parallel_state.get_data_parallel_group(),
                sample_state=None,
            )
            .double()
            .train()
        )
        streams = [
            torch.zeros(17, 3, 64, dtype=torch.float64),
            torch.zeros(cfg.context_length, 3, 64, dtype=torch.float64),
        ]
        with SavedBytes() as saved:
            if stage == 0:
                streams = module((images, tokens, lengths))[:2]
                for t in streams:
                    dist.send(t.detach(), 1)
            else:
                for t in streams:
                    dist.recv(t, 0)
                    t.requires_grad_(True)
                image, text = module((*streams, lengths))
        if stage == 0:
            grads = [torch.zeros_like(t) for t in streams]
            for g in grads:
                dist.recv(g, 1)
            torch.autograd.backward(streams, grads)
        else:
            (image.pow(2).sum() + text.pow(3).sum()).backward()
            for t in streams:
                dist.send(t.grad, 0)
        grads = {n: p.grad for n, p in module.layout_free_parameters() if p.grad is not None}
        out[name] = {"grads": grads, "saved": saved.total}
    return out


def _clip_reference(cfg: CLIPModelConfig) -> dict:
    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.clip.towers import CLIPModel

    apply_cpu_support()
    parallel_state.initialize_model_parallel()
    model = CLIPModel(cfg, seed=4).double()
    image, text = model(*_clip_inputs(cfg))
    (image.pow(2).sum() + text.pow(3).sum()).backward()
    return {f"clip.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_clip_pipeline_stages_recompute_each_towers_layers():
    """PP 2 over the interleaved towers (v0 t0 v1 t1 | v2 t2 v3 t3): per stage and tower, block
    1 recomputes the first layer, uniform 2 both as one chunk."""
    cfg = CLIPModelConfig.from_preset("clip-tiny", **CLIP_DEEP)
    (reference,) = run_distributed(_clip_reference, 1, args=(cfg,))
    modes = {n: MODES[n] for n in ("none", "uniform-2", "block-1")}
    stages = run_distributed(_clip_pipeline, 2, args=(cfg, modes), timeout=300)
    for stage in stages:
        for name in modes:
            grads = {n: g for n, g in stage[name]["grads"].items() if n in reference}
            assert len(grads) > 10
            for n, g in grads.items():
                assert torch.equal(g, reference[n]), (name, n)
        saved = {name: stage[name]["saved"] for name in modes}
        assert saved["none"] > saved["block-1"] > saved["uniform-2"]


@pytest.mark.parametrize(
    "flags,message",
    [
        ({"recompute_granularity": "full"}, "full needs --recompute-method"),
        ({"recompute_granularity": "full", "recompute_method": "block"}, "--recompute-num-layers"),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 0,
            },
            "--recompute-num-layers (0) must be >= 1",
        ),
        (
            {"recompute_granularity": "selective", "recompute_method": "uniform"},
            "--recompute-method and --recompute-num-layers are for --recompute-granularity full",
        ),
        ({"recompute_method": "block", "recompute_num_layers": 1}, "need --recompute-granularity"),
        (
            {
                "recompute_activations": True,
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 1,
            },
            "contradicts",
        ),
    ],
)
def test_recompute_flag_checks(flags, message):
    config = RunConfig(training=TrainingConfig(train_iters=1, **flags))
    config.optimizer.lr = 1e-3
    with pytest.raises(ConfigError) as e:
        validate_run(config, 1)
    assert message in str(e.value)


def test_recompute_activations_is_selective():
    config = RunConfig(training=TrainingConfig(train_iters=1, recompute_activations=True))
    config.optimizer.lr = 1e-3
    validate_run(config, 1)
    assert Recompute.from_training(config.training) == Recompute("selective")
