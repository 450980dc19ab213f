"""--sequence-parallel at TP 2 against the same model without it.

The model (GPT-2's shape: learned positions, LayerNorm, GELU, biases, tied embeddings; LLaMA's:
RoPE, RMSNorm, SwiGLU, no biases, untied, grouped-query attention): logits and every gradient
equal, the gradients of the parameters applied to sequence shards (norms, row-parallel biases)
summed over TP (without the sum they would be each rank's part). Training through DeepSpeed
(ZeRO 1 and 2 at TP 2 x DP 2, ZeRO 1 at TP 2 x PP 2; fused and unfused output stage;
--freeze-lm): loss, gradient norm, tau, validation and the updated weights equal the run without
the flag, and its checkpoint loads for generation. Flag checks and the planner's figure. (The
fused output stage on sequence shards: test_sequence_parallel_output_stage.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_tempnet.models.gpt import ModelConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.shapes import parity_model

SEQ, BATCH, VOCAB = 16, 2, 200
CHUNK = 7  # tokens per chunk of the fused output stage (gathered from both TP ranks: 6)


def _model(arch: str, **kw) -> ModelConfig:
    return parity_model(arch, SEQ, VOCAB, llama_ffn=128, **kw)


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ)[None].expand(BATCH, SEQ)


def _setup_tp() -> int:
    from megatron_tempnet.compat import apply_cpu_support

    apply_cpu_support()
    tp = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return tp


# --------------------------------------------------------------------------------- the model


MODEL_ARCHS = ("gpt2", "llama", "gpt2-1p")  # 1p: --apply-layernorm-1p (the same norm module)


def _model_gradients() -> dict:
    """Per architecture: logits and gradients without and with sequence parallelism, and with
    it but without the gradient sum (the hooks removed)."""
    from megatron_tempnet.distributed.sequence_parallel import sequence_parallel_parameters
    from megatron_tempnet.models.gpt import build_gpt_model

    tp = _setup_tp()
    tokens, positions = _tokens()
    out = {}
    for arch in MODEL_ARCHS:
        shape = _model(arch.removesuffix("-1p"), apply_layernorm_1p=arch.endswith("-1p"))
        for case in ("off", "on", "unsummed"):
            model = build_gpt_model(
                shape, tensor_parallel_size=tp, seed=3, sequence_parallel=case != "off"
            )
            if case == "unsummed":
                for handle in model.sequence_parallel_hooks:
                    handle.remove()
            logits = model(tokens, positions)  # [b, s, V_pad/tp]
            (logits.float() ** 2).sum().backward()
            marked = {id(p) for p in sequence_parallel_parameters(model)}
            out[arch, case] = {
                "logits": logits.detach(),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "marked": sorted(n for n, p in model.named_parameters() if id(p) in marked),
                "hooks": len(model.sequence_parallel_hooks),
            }
    return out


@pytest.fixture(scope="module")
def model_runs():
    return run_distributed(_model_gradients, world_size=2)


@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_the_model_computes_the_same_and_sums_shard_gradients_over_tp(model_runs, arch):
    for ranks in model_runs:
        off, on, unsummed = (ranks[arch, case] for case in ("off", "on", "unsummed"))
        torch.testing.assert_close(on["logits"], off["logits"], rtol=1e-5, atol=1e-6)
        assert off["marked"] == [] and off["hooks"] == 0
        norms = [n for n in on["grads"] if "layernorm" in n or ".norm." in n]
        row_biases = [n for n in on["grads"] if n.endswith(("linear_proj.bias", "fc2.bias"))]
        assert on["marked"] == sorted(norms + row_biases) and on["hooks"] == len(on["marked"])
        gpt2 = arch.startswith("gpt2")
        assert len(norms) == (10 if gpt2 else 5) and len(row_biases) == (4 if gpt2 else 0)
        for name, want in off["grads"].items():
            torch.testing.assert_close(on["grads"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    for name in model_runs[0][arch, "on"]["marked"]:
        want = model_runs[0][arch, "off"]["grads"][name]
        parts = [ranks[arch, "unsummed"]["grads"][name] for ranks in model_runs]
        # without the sum each rank holds its own tokens' part: wrong alone, right summed
        assert all((part - want).abs().max() > 1e-3 * want.abs().max() for part in parts), name
        torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------ training through DeepSpeed

ITERS, GLOBAL_BATCH = 3, 4


def _run_config(case: dict, world: int):
    """An in-process ``GPTRunConfig`` of ``case`` (its layout, model and objective)."""
    from megatron_tempnet.data.gpt_data import GPTDataConfig
    from megatron_tempnet.data.tokenizers import TokenizerConfig
    from megatron_tempnet.models.gpt.objective import LossConfig
    from megatron_tempnet.models.gpt.task import (
        GPTOptimizerConfig,
        GPTRunConfig,
        GPTTrainingConfig,
        validate_gpt,
    )
    from megatron_tempnet.tempnet import TempNetConfig
    from megatron_tempnet.trainer.config import ParallelConfig

    config = GPTRunConfig(
        model=_model(case["arch"]),
        loss=LossConfig(
            rho=3.0,
            tempnet=TempNetConfig(tempnet_hidden_size=16, tempnet_proj_size=8),
            fused_output_stage=case["fused"],
            output_stage_chunk_size=CHUNK,
        ),
        data=GPTDataConfig(data_path=["unused"], seq_length=SEQ),
        tokenizer=TokenizerConfig(tokenizer_type="GPT2BPETokenizer"),
        training=GPTTrainingConfig(
            train_iters=ITERS,
            micro_batch_size=1,
            global_batch_size=GLOBAL_BATCH,
            seed=5,
            num_workers=0,
            freeze_lm=case["freeze"],
        ),
        parallel=ParallelConfig(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=case["pp"],
            zero_stage=case["zero"],
            sequence_parallel=case["sp"],
        ),
        # AdamW's first steps move every weight by about +-lr whatever its gradient's size: at
        # the default epsilon (1e-8) a gradient that is float32 rounding noise around zero
        # (it differs with the order of any sum) moves its weight by a random +-lr; an
        # epsilon of 1e-4 keeps the update proportional to such gradients
        optimizer=GPTOptimizerConfig(lr=3e-3, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-4),
    )
    validate_gpt(config, world)
    return config


def _global_batches(seed: int) -> list[list[dict]]:
    """Every iteration's global batch (GLOBAL_BATCH samples), masked tokens included."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ITERS + 1):  # the last one validates
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=gen) > 0.15).float()
        positions = torch.arange(SEQ)[None].expand(GLOBAL_BATCH, SEQ)
        out.append(
            [
                {
                    "tokens": tokens[i : i + 1, :-1],
                    "labels": tokens[i : i + 1, 1:],
                    "loss_mask": mask[i : i + 1],
                    "position_ids": positions[i : i + 1],
                }
                for i in range(GLOBAL_BATCH)
            ]
        )
    return out


def _train(case: dict, save_dir: str | None) -> dict:
    """``ITERS`` iterations of ``case`` at constant learning rate, then one validation pass:
    per iteration the logged metrics and gradient norm, the last micro-batch's taus, and this
    rank's weights after the last step."""
    from megatron_tempnet.models.gpt.pipeline import pipeline_evaluate
    from megatron_tempnet.models.gpt.step import evaluate
    from megatron_tempnet.models.gpt.task import GPTTask
    from megatron_tempnet.trainer.engine import build_engine
    from megatron_tempnet.trainer.stats import read_step

    world = dist.get_world_size()
    config = _run_config(case, world)
    task = GPTTask()
    model = task.build_model(config, None)
    marked = [p for p in model.module.parameters() if getattr(p, "sequence_parallel", False)]
    assert bool(marked) == case["sp"]  # the norms (and GPT-2's row-parallel biases)
    engine, optimizer = build_engine(model, config, world)
    step = task.build_step(engine, optimizer, config, None)
    dp_group = parallel_state.get_data_parallel_group()
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    mine = lambda batch: batch[dp_rank::dp]  # noqa: E731  (this rank's micro-batches)
    batches = _global_batches(seed=11)
    steps = []
    for global_batch in batches[:ITERS]:
        stats = step(mine(global_batch))
        report = read_step(stats)
        steps.append({**report.metrics, "grad_norm": report.grad_norm, "tau": stats.tau_sample()})
    if case["pp"] > 1:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        valid = pipeline_evaluate(engine, mine(batches[-1]), dp_group=dp_group, pp_group=pp_group)
    else:
        valid = evaluate(engine, mine(batches[-1]), dp_group=dp_group)
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out = {"steps": steps, "valid": valid, "weights": weights}
    if save_dir is not None:
        out["generation"] = _generation_logits(engine, config, model, save_dir)
    return out


def _generation_logits(engine, config, model, save_dir: str) -> tuple:
    """Logits of the trained module (sequence parallel) and of the inference model loaded from
    its checkpoint (built without sequence parallelism, as generation builds it)."""
    import dataclasses
    import json

    from megatron_tempnet.checkpoint.checkpointer import Checkpointer
    from megatron_tempnet.inference.model import load_inference_model

    saving = dataclasses.replace(config.checkpoint, save=save_dir)
    client = {"config": json.loads(config.to_json()), "data": {}}
    Checkpointer(engine, model, dataclasses.replace(config, checkpoint=saving)).save(ITERS, client)
    inference = load_inference_model(save_dir)
    assert not inference.lm.sequence_parallel
    tokens, positions = _tokens(seed=4)
    with torch.no_grad():
        trained = engine.module.lm(tokens, positions)  # [b, s, V_pad/tp], gathered sequence
        loaded = inference.lm(tokens, positions)
    # the true vocabulary's columns (a conversion keeps no padded rows: they load as zeros)
    true = max(0, min(trained.shape[-1], VOCAB - dist.get_rank() % 2 * trained.shape[-1]))
    return trained[..., :true], loaded[..., :true]


def _cases(layout: str) -> list[dict]:
    """The runs of one launch: references (sp False) and the same runs sequence parallel."""
    base = dict(pp=1, zero=1, fused=True, freeze=False)
    if layout == "pp2":
        base["pp"] = 2
        variants = [
            dict(arch="gpt2"),
            dict(arch="llama"),
            dict(arch="llama", fused=False),
            dict(arch="gpt2", freeze=True),
        ]
        return [{**base, **v, "sp": sp} for v in variants for sp in (False, True)]
    runs = []
    for variant, zeros in [
        (dict(arch="gpt2"), (1, 2)),
        (dict(arch="llama"), (1, 2)),
        (dict(arch="gpt2", fused=False), (2,)),
        (dict(arch="llama", fused=False), (1,)),
        (dict(arch="llama", freeze=True), (2,)),
    ]:
        runs.append({**base, **variant, "sp": False})
        runs += [{**base, **variant, "zero": z, "sp": True} for z in zeros]
    return runs


def _launch(layout: str, save_dir: str) -> list:
    """Every case of ``layout`` in this launch (the ranks build one engine after another)."""
    import os

    from megatron_tempnet.trainer.engine import init_process_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed's
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # over this process group
    cases = _cases(layout)
    init_process_groups(_run_config(cases[0], dist.get_world_size()))
    results = []
    for case in cases:
        generation = case == dict(arch="llama", pp=1, zero=2, fused=True, freeze=False, sp=True)
        results.append((case, _train(case, save_dir if generation else None)))
    return results


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    """TP 2 x DP 2 (ZeRO 1 and 2), four processes; one run saves a checkpoint."""
    save_dir = str(tmp_path_factory.mktemp("sp-checkpoint"))
    return run_distributed(_launch, 4, args=("dp2", save_dir), timeout=600)


@pytest.fixture(scope="module")
def pp2_runs():
    """TP 2 x PP 2 (ZeRO 1), four processes."""
    return run_distributed(_launch, 4, args=("pp2", None), timeout=600)


def _relative(got, want) -> float:
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    return err / max(float(want.abs().max()), 1e-12) if err else 0.0


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_training_with_sequence_parallelism_equals_training_without(request, layout):
    runs = request.getfixturevalue(f"{layout}_runs")
    checked = 0
    for rank, results in enumerate(runs):
        references = {}
        for case, result in results:
            key = (case["arch"], case["fused"], case["freeze"])
            if not case["sp"]:
                references[key] = result
                continue
            ref = references[key]
            where = (rank, case)
            assert len(result["steps"]) == ITERS
            for got, want in zip(result["steps"], ref["steps"]):
                for name in ("loss", "ce_loss", "tau_mean", "tau_min", "tau_max", "grad_norm"):
                    assert _relative(got[name], want[name]) <= 1e-5, (where, name)
                # the taus' spread (~2e-4 here) to float32's rounding of taus near 1
                spread = abs(got["tau_std"] - want["tau_std"]) / want["tau_max"]
                assert spread <= 1e-5, (where, "tau_std")
                assert got["tau"].shape == want["tau"].shape and got["tau"].numel() > 0
                assert _relative(got["tau"], want["tau"]) <= 1e-5, where
            assert ref["steps"][-1]["loss"] < ref["steps"][0]["loss"]  # it learns
            for name in ref["valid"]:
                assert _relative(result["valid"][name], ref["valid"][name]) <= 1e-5, (where, name)
            assert result["weights"].keys() == ref["weights"].keys()
            for name, want in ref["weights"].items():
                # after AdamW's steps: GPT-2's fc2 bias, whose gradient is near zero, reaches
                # 6e-6 to 1.2e-5 from float32's summation order alone (9e-6 without the fused
                # stage), while the losses and gradient norms agree within 1e-7
                assert _relative(result["weights"][name], want) <= 3e-5, (where, name)
            checked += 1
    assert checked == len(runs) * sum(case["sp"] for case in _cases(layout))


def test_a_checkpoint_saved_with_sequence_parallelism_loads_for_generation(dp2_runs):
    found = [r["generation"] for results in dp2_runs for _, r in results if "generation" in r]
    assert len(found) == len(dp2_runs)
    for rank, (trained, loaded) in enumerate(found):
        assert trained.shape == loaded.shape == (BATCH, SEQ, 128 if rank % 2 == 0 else 72)
        torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- flags and planner


def test_the_flag_is_off_at_tp1_and_needs_a_divisible_sequence(caplog):
    from megatron_tempnet.trainer.config import ConfigError

    case = dict(arch="gpt2", pp=1, zero=0, fused=True, freeze=False, sp=True)
    config = _run_config(case, world=2)  # TP 2, DP 1
    assert config.parallel.sequence_parallel
    caplog.set_level("WARNING", logger="megatron_tempnet")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", "0")
        from megatron_tempnet.models.gpt.task import validate_gpt

        config.parallel.tensor_model_parallel_size = 1
        validate_gpt(config, 1)
    assert not config.parallel.sequence_parallel  # as Megatron-LM: off, with a warning
    assert "--sequence-parallel is off" in caplog.text
    with pytest.raises(
        ConfigError,
        match=r"--seq-length \(15\) must be divisible by "
        r"--tensor-model-parallel-size \(2\)",
    ):
        config = _run_config(case, world=2)
        config.model.seq_length = config.data.seq_length = 15
        validate_gpt(config, 2)


def test_the_planner_counts_the_norm_regions_once_per_tp_rank():
    """GPT-2 125M at TP 2, 1024 tokens, bf16 (e = 2), fused attention. One layer keeps
    s*b*e*(4h + (qkv + h + f + f)/t) + 4*b*a*s/t bytes, qkv = h + 2*g*d = 2304 (g = 12 heads of
    d = 64), f = 3072: without the flag 2048 * (3072 + 9216/2) + 24576 = 15,753,216; with it the
    norm regions' 4h = 3072 become 4h/t = 1536: 2048 * (1536 + 4608) + 24576 = 12,607,488; and
    the all-gather buffer [s, b, h] = 1024 * 768 * 2 = 1,572,864 bytes."""
    from megatron_tempnet.models.gpt.memory import EstimateError, Layout, estimate

    model = ModelConfig.from_preset("gpt2-125m", vocab_size=50257)
    common = dict(tensor_parallel=2, precision="bf16")
    (off,) = estimate(model, Layout(**common))
    (on,) = estimate(model, Layout(**common, sequence_parallel=True))
    assert off.parts["activations"] == 12 * 15_753_216
    assert on.parts["activations"] == 12 * 12_607_488
    assert on.parts["SP gather buffer"] == 1_572_864 and "SP gather buffer" not in off.parts
    # recomputing whole layers keeps each layer's input: this rank's shard of it
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    (off,) = estimate(model, Layout(**common, **full))
    (on,) = estimate(model, Layout(**common, **full, sequence_parallel=True))
    assert off.parts["activations"] == 12 * 1024 * 2 * 768 == 2 * on.parts["activations"]
    with pytest.raises(EstimateError, match=r"--seq-length \(1001\) must be divisible"):
        estimate(
            ModelConfig.from_preset("gpt2-125m", vocab_size=50257, seq_length=1001),
            Layout(**common, sequence_parallel=True),
        )
