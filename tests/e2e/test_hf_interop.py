"""Hugging Face interop: tiny random transformers LLaMA (grouped-query attention), LLaMA-3.1-style
(RoPE scaling), LLaMA-3.2-style (scaling, tied embeddings), Mistral and GPT-2 -> our checkpoints
at TP 1/2 x PP 1/2 give HF's logits (with the KV cache too); pretrain_gpt.py loads the
conversions (--load, --finetune, --pretrained-checkpoint) under DeepSpeed; ours -> HF is
weight-identical; HF configs are read in both RoPE spellings, and what the model here does not
compute is refused by name."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.checkpoints import global_tensors, weights
from tests.helpers.corpus import blend_corpus, data_flags
from tests.helpers.distributed import run_distributed
from tests.helpers.entry_points import cli_flags, run_command, run_entry_point
from tests.helpers.faults import PlantedPickle
from tests.helpers.hf_models import (
    LLAMA31_ROPE,
    LLAMA32_ROPE,
    load_hf,
    save_hf_gpt2,
    save_hf_llama,
    save_hf_mistral,
    to_hub_rope_spelling,
)
from tests.helpers.run_flags import tempnet_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    corpus = blend_corpus(str(d), vocab_size=500)
    vocab = corpus["tokenizer"].vocab_size  # 500: padded to 512 at TP 1 and 2
    llama32 = save_hf_llama(
        str(d), vocab, name="hf-llama32", rope_parameters=LLAMA32_ROPE, tie_word_embeddings=True
    )
    to_hub_rope_spelling(llama32)  # rope_theta + rope_scaling, as the Hub's 3.2 configs are
    return {
        "dir": d,
        "corpus": corpus,
        "vocab": vocab,
        "llama": save_hf_llama(str(d), vocab),
        "gpt2": save_hf_gpt2(str(d), vocab),
        "llama3.1": save_hf_llama(str(d), vocab, name="hf-llama31", rope_parameters=LLAMA31_ROPE),
        "llama3.2": llama32,
        "mistral": save_hf_mistral(str(d), vocab),
    }


def tool(script: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(REPO, "tools", *script.split("/")), *map(str, args)]
    r = run_command(cmd, env=ENV, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def convert(hf_dir: str, out, tp: int = 1, pp: int = 1) -> str:
    r = tool(
        "checkpoint/convert_hf_to_megatron.py",
        "--hf-dir",
        hf_dir,
        "--save",
        out,
        "--target-tp",
        tp,
        "--target-pp",
        pp,
    )
    # progress without a terminal: a closing line over the tensors, one per LM parameter
    done = re.search(rf"writing {re.escape(str(out))}: 100% (\d+)/(\d+) tensor in ", r.stderr)
    written = global_tensors(out, "iter_0000000", prefix="weight/")
    assert done and int(done[1]) == int(done[2]) == len(written), r.stderr
    return str(out)


def _our_logits(load_dir: str, tokens: torch.Tensor, cached_from: int | None):
    from megatron_tempnet.inference.model import init_inference, load_inference_model

    init_inference(torch.distributed.get_world_size())
    model = load_inference_model(load_dir)
    logits = model.logits(tokens)  # [b, s, V_pad/tp]
    if cached_from is None:
        return logits
    # generation's path: a prefill of the first tokens, then one cached step per token
    b, s = tokens.shape
    cache = model.new_cache(b, s)
    cache.at(0)
    prefix = torch.arange(cached_from)[None].expand(b, cached_from)
    last = torch.full((b,), cached_from - 1)
    steps = [model.cached_logits(tokens[:, :cached_from], prefix, cache, last)]
    for p in range(cached_from, s):
        cache.at(p)
        here, first = torch.full((b, 1), p), torch.zeros(b, dtype=torch.long)
        steps.append(model.cached_logits(tokens[:, p : p + 1], here, cache, first))
    return logits, torch.stack(steps, dim=1)  # [b, s - cached_from + 1, V_pad/tp]


def our_logits(load_dir: str, tokens: torch.Tensor, tp: int, cached_from: int | None = None):
    """``[b, s, V_pad]`` logits at TP ``tp``; with ``cached_from`` also those of positions
    ``cached_from - 1 ..`` computed with the KV cache."""
    args = (load_dir, tokens, cached_from)
    shards = run_distributed(_our_logits, world_size=tp, args=args, timeout=240)
    if cached_from is None:
        return torch.cat(shards, dim=-1)
    return tuple(torch.cat(parts, dim=-1) for parts in zip(*shards))


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))


_SCALED = ("llama3.1", "llama3.2")  # 24 tokens: past their 16-position original context
_PREFILL = 12


@pytest.mark.parametrize("arch", ["llama", "gpt2", "llama3.1", "llama3.2", "mistral"])
def test_converted_models_give_hf_logits_at_every_layout(hf, arch, tmp_path):
    tokens, vocab = _tokens(hf["vocab"]), hf["vocab"]
    with torch.no_grad():
        reference = load_hf(hf[arch])(tokens).logits.float()
    if arch in _SCALED:  # the test would see a converter that dropped the scaling
        plain = dict(rope_type="default", rope_theta=500000.0)
        with torch.no_grad():
            unscaled = load_hf(hf[arch], rope_parameters=plain)(tokens).logits.float()
        assert (unscaled - reference).abs().max() > 1e-3
    tied = arch in ("gpt2", "llama3.2")
    first = None
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        ckpt = convert(hf[arch], tmp_path / f"tp{tp}pp{pp}", tp, pp)
        # layout-free: every target layout writes the same full tensors (vocabulary unpadded;
        # a tied output layer is the embedding, not saved twice)
        saved = global_tensors(ckpt)
        assert saved["weight/lm.pieces.0.word_embeddings.weight"].shape[0] == vocab
        assert any("output_layer" in k for k in saved) != tied
        first = first or saved
        assert saved.keys() == first.keys() and all(torch.equal(saved[k], first[k]) for k in saved)
        logits = our_logits(ckpt, tokens, tp, _PREFILL if arch in _SCALED else None)
        if arch in _SCALED:
            logits, cached = logits
            want = reference[:, _PREFILL - 1 :]
            torch.testing.assert_close(cached[..., :vocab], want, rtol=0, atol=1e-5)
        assert logits.shape[-1] == 512  # padded for TP
        torch.testing.assert_close(logits[..., :vocab], reference, rtol=0, atol=1e-5)
        assert (logits[..., vocab:] == 0).all()  # zero rows for the padding


def model_args(ckpt) -> list[str]:
    """The model flags a conversion saved with the checkpoint ``ckpt`` (model_flags.txt)."""
    with open(os.path.join(ckpt, "model_flags.txt")) as f:
        return f.read().split()


def corpus_run_args(setup, iters: int, tempnet_size: int) -> list[str]:
    """A short pretrain_gpt.py run on the corpus of ``setup`` (a fixture's dict with ``corpus``
    and ``dir``): dataset A in 32-token sequences, batches of 4 in micro-batches of 2, no
    evaluation, a TempNet of width ``tempnet_size``."""
    corpus = setup["corpus"]
    run = {
        **data_flags(corpus["spec"], corpus["prefix"]["A"], 32),
        "micro-batch-size": 2,
        "global-batch-size": 4,
        "train-iters": iters,
        "eval-interval": 0,
        **tempnet_flags(tempnet_size),
        "data-cache-path": setup["dir"] / "cache",
    }
    return cli_flags(run)


def _pretrain(hf, nproc: int, flags: list[str], out) -> None:
    args = [*corpus_run_args(hf, 2, 16), "--save", str(out), *flags]
    run_entry_point("pretrain_gpt.py", nproc, args, env=ENV)


@pytest.mark.parametrize("arch,tp,pp,how", [("llama", 2, 1, "load"), ("llama", 1, 2, "finetune")])
def test_pretrain_gpt_trains_from_the_conversion(hf, arch, tp, pp, how, tmp_path):
    """With --lr 0 the run's saved LM is the converted one, tensor for tensor: the run loaded
    every tensor; its HF export gives the run's logits. (--pretrained-checkpoint: the
    walk-through's test below.)"""
    ckpt = convert(hf[arch], tmp_path / "converted", tp, pp)
    load = {"load": ["--load", ckpt], "finetune": ["--load", ckpt, "--finetune"]}[how]
    flags = [
        *model_args(ckpt),
        *load,
        "--lr",
        "0",
        "--weight-decay",
        "0",
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
    ]
    _pretrain(hf, tp * pp, flags, tmp_path / "run")
    run, converted = weights(tmp_path / "run"), weights(ckpt)
    assert any(n.startswith("tempnet.") for n in run)
    assert open(tmp_path / "run" / "latest").read() == "iter_0000002"
    lm = list(converted)
    assert lm and sorted(lm) == sorted(n for n in run if not n.startswith("tempnet."))
    for name in lm:
        assert torch.equal(run[name], converted[name]), name
    tool(
        "checkpoint/convert_megatron_to_hf.py",
        "--load",
        tmp_path / "run",
        "--save",
        tmp_path / "hf-out",
    )
    tokens = _tokens(hf["vocab"])
    with torch.no_grad():
        exported = load_hf(str(tmp_path / "hf-out"))(tokens).logits
    torch.testing.assert_close(
        our_logits(str(tmp_path / "run"), tokens, 1)[..., : hf["vocab"]],
        exported,
        rtol=0,
        atol=1e-5,
    )


# (LLaMA: the walk-through's test below)
@pytest.mark.parametrize("arch", ["gpt2", "llama3.1", "mistral"])
def test_round_trip_back_to_hf_is_weight_identical(hf, arch, tmp_path):
    from safetensors.torch import load_file

    ckpt = convert(hf[arch], tmp_path / "ours", 2, 2)
    out = tmp_path / "back"
    r = tool(
        "checkpoint/convert_megatron_to_hf.py",
        "--load",
        ckpt,
        "--save",
        out,
        "--max-shard-size-gb",
        0.0001,
    )  # about 100 KB: several shards
    assert "shard(s)" in r.stdout
    n = len(original := load_file(os.path.join(hf[arch], "model.safetensors")))
    done = re.search(rf"converting {re.escape(ckpt)}: 100% (\d+)/(\d+) tensor in ", r.stderr)
    assert done and done[1] == done[2] and 0 < int(done[1]) <= n, r.stderr  # ours: qkv merged
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    back = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    if arch == "gpt2":  # tied: HF writes lm_head only as the embedding
        original.pop("lm_head.weight", None)
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    with open(os.path.join(hf[arch], "config.json")) as f:
        want = json.load(f)
    with open(out / "config.json") as f:
        got = json.load(f)
    keys = [
        "vocab_size",
        "hidden_size",
        "num_key_value_heads",
        "rms_norm_eps",
        "n_embd",
        "n_head",
        "activation_function",
        "tie_word_embeddings",
        "model_type",
    ]
    assert {k: got.get(k) for k in keys if k in want} == {k: want[k] for k in keys if k in want}
    if arch != "gpt2":  # as transformers reads them: RoPE (written in the Hub's spelling), class
        from transformers import AutoConfig

        want, got = AutoConfig.from_pretrained(hf[arch]), AutoConfig.from_pretrained(str(out))
        assert type(got) is type(want) and got.architectures == want.architectures
        assert got.rope_parameters == want.rope_parameters
        assert getattr(got, "sliding_window", None) is getattr(want, "sliding_window", None)
    if arch == "mistral":  # the same computation, exported under LLaMA's name on request
        tool(
            "checkpoint/convert_megatron_to_hf.py",
            "--load",
            ckpt,
            "--save",
            tmp_path / "as",
            "--hf-model-type",
            "llama",
        )
        with open(tmp_path / "as" / "config.json") as f:
            assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


WALKTHROUGH = os.path.join(REPO, "docs", "walkthrough.md")


def _exported_as_imported(hf_dir: str, exported: str) -> None:
    """The exported HF folder holds the imported folder's weights, tensor for tensor, and its
    config's shape entries."""
    from safetensors.torch import load_file

    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    with open(os.path.join(exported, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    back = {k: v for s in shards for k, v in load_file(os.path.join(exported, s)).items()}
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    with open(os.path.join(hf_dir, "config.json")) as f:
        want = json.load(f)
    with open(os.path.join(exported, "config.json")) as f:
        got = json.load(f)
    keys = ["vocab_size", "hidden_size", "num_key_value_heads", "rms_norm_eps",
            "tie_word_embeddings", "model_type", "architectures"]  # fmt: skip
    assert {k: got.get(k) for k in keys} == {k: want[k] for k in keys}


def test_walkthrough_runs_as_written(tmp_path, monkeypatch):
    """docs/walkthrough.md's own commands on a tiny LLaMA with a tokenizer, at TP 2: the
    checkpoint carries the tokenizer that preprocessing and training use, TempNet is trained on
    the frozen LM given by --pretrained-checkpoint, the LM exports back weight-identical, and
    tools/generate.py and HF generate with TempNetLogitsProcessor choose the same tokens with
    the taus of docs/design.md computed here from HF's logits."""

    from megatron_tempnet.data.indexed import DatasetError
    from megatron_tempnet.data.tokenizer_sidecar import check_tokenizer, read_sidecar
    from megatron_tempnet.data.tokenizers import build_tokenizer
    from megatron_tempnet.inference.checkpoint_io import CheckpointReader
    from tests.e2e.test_inference_tools import reference_tau
    from tests.helpers.corpus import pydoc_documents, save_hf_tokenizer, write_jsonl
    from tests.helpers.doc_commands import run_document
    from tests.helpers.hf_models import add_tokenizer

    tokenizer_dir = save_hf_tokenizer(str(tmp_path), vocab_size=500)
    hf_dir = add_tokenizer(save_hf_llama(str(tmp_path), 500), tokenizer_dir)
    corpus = write_jsonl(str(tmp_path / "corpus.jsonl"), [{"text": t} for t in pydoc_documents()])
    lm, data, run, out = (str(tmp_path / n) for n in ("lm", "data/docs", "run", "out"))
    paths = dict(HF_DIR=hf_dir, LM=lm, CORPUS=corpus, DATA=data, RUN=run, OUT=out)
    layout = dict(NPROC="2", TP="2", PP="1", ITERS="3", GLOBAL_BATCH="4", MICRO_BATCH="2")
    env = dict(ENV, **paths, **layout, SEQ="32", SPLIT="98,2,0", WORKERS="1", NEW_TOKENS="6")
    monkeypatch.chdir(REPO)
    programs, (python,) = run_document(WALKTHROUGH, env, str(tmp_path / "bash.log"))
    steps = "convert_hf_to_megatron preprocess_data pretrain_gpt export_tempnet"
    steps += " convert_megatron_to_hf generate"
    ran = [os.path.basename(str(p.args[0])) for p in programs]
    assert ran == [f"{name}.py" for name in steps.split()]

    # 1. the checkpoint carries the model's tokenizer files and records that folder
    copied = sorted(os.listdir(os.path.join(lm, "tokenizer")))
    assert copied == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in copied:
        with open(os.path.join(lm, "tokenizer", name), "rb") as a:
            assert a.read() == open(os.path.join(hf_dir, name), "rb").read(), name
    assert CheckpointReader(lm).config["tokenizer"] == {
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_model": os.path.join(lm, "tokenizer"),
    }
    # 2. the dataset records that tokenizer; the HF directory's (other files beside it: a
    # different digest) is refused, as the walk-through says
    prefix = data + "_text_document"
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=os.path.join(lm, "tokenizer"))
    assert read_sidecar(prefix)[0] == ours.identity
    with pytest.raises(DatasetError, match="was tokenised with"):
        check_tokenizer(
            [prefix], build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir).identity
        )
    # 3. TempNet trained on the frozen LM: the run saved TempNet only
    assert open(os.path.join(run, "latest")).read() == "iter_0000003"
    assert os.path.exists(os.path.join(run, "iter_0000003", "FROZEN_LM_EXCLUDED"))
    saved = weights(run)
    assert saved and all(n.startswith("tempnet.") for n in saved)
    # 4. the LM back in HF's format: the original weights, tensor for tensor, and config
    _exported_as_imported(hf_dir, os.path.join(out, "hf"))
    # 5. the same greedy tokens and taus from tools/generate.py and from HF generate, and the
    # taus are TempNet's of the logits that chose each token (float64, from the exported file)
    with open(os.path.join(out, "generations.jsonl")) as f:
        (record,) = [json.loads(line) for line in f]
    hf = load_hf(os.path.join(out, "hf"))
    prompt = ours.tokenize("The meaning of life is")
    with open(os.path.join(out, "prompts.txt")) as f:
        assert f.read() == "The meaning of life is\n"
    generated = record["token_ids"]
    assert 1 <= len(generated) <= 6 and len(record["tau"]) == len(generated)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0]  # [s, V]
    choosing = logits[len(prompt) - 1 : -1]  # the logits each new token was chosen from
    assert generated == choosing.argmax(-1).tolist()  # greedy, on HF's logits
    want = reference_tau(choosing, os.path.join(out, "tempnet"))
    torch.testing.assert_close(
        torch.tensor(record["tau"], dtype=torch.float64), want, rtol=0, atol=1e-5
    )
    assert all(0.001 <= t <= 2.0 for t in record["tau"])
    # HF generate with the processor (the document's python block): the same tokens and taus
    assert python["ids"][0].tolist() == prompt
    n = python["tokens"].shape[1] - len(prompt)  # HF stops at the end token too
    assert n == len(generated) and python["tokens"][0, len(prompt) :].tolist() == generated
    torch.testing.assert_close(python["tempnet"].taus[0].double(), want, rtol=0, atol=1e-5)


# The Hub's config.json of each family (transformers 4.4x spelling), against the --model presets
_HUB = dict(
    hidden_act="silu",
    rms_norm_eps=1e-5,
    vocab_size=128256,
    num_key_value_heads=8,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    pretraining_tp=1,
    model_type="llama",
)
_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
_META_SCALING = dict(
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
    rope_type="llama3",
)
_HUB_31 = dict(_HUB, max_position_embeddings=131072, rope_scaling=_META_SCALING)
_HUB_32 = dict(_HUB_31, tie_word_embeddings=True, rope_scaling=dict(_META_SCALING, factor=32.0))
HUB_CONFIGS = {
    "llama3-8b": dict(_HUB, **_8B, max_position_embeddings=8192, rope_scaling=None),
    "llama3.1-8b": dict(_HUB_31, **_8B),
    "llama3.1-70b": dict(
        _HUB_31,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
    ),
    "llama3.2-1b": dict(
        _HUB_32,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        head_dim=64,
    ),
    "llama3.2-3b": dict(
        _HUB_32,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        head_dim=128,
    ),
    "mistral-7b": dict(
        _8B,
        model_type="mistral",
        hidden_act="silu",
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
        vocab_size=32768,
    ),
}
_ARCHITECTURE = """num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size
vocab_size max_position_embeddings norm_epsilon rotary_base use_rope_scaling rope_scaling_factor
rope_scaling_low_freq_factor rope_scaling_high_freq_factor
rope_scaling_original_max_position_embeddings untie_embeddings_and_output_weights""".split()


@pytest.mark.parametrize("preset", sorted(HUB_CONFIGS))
def test_hub_configs_import_as_the_presets(preset):
    from megatron_tempnet.inference.hf_weights import model_config_from_hf
    from megatron_tempnet.models.gpt import ModelConfig

    got, want = model_config_from_hf(HUB_CONFIGS[preset]), ModelConfig.from_preset(preset)
    assert {k: getattr(got, k) for k in _ARCHITECTURE} == {
        k: getattr(want, k) for k in _ARCHITECTURE
    }
    assert got.hf_model_type == (want.hf_model_type or "llama")


def _spellings() -> list[dict]:
    """One LLaMA-3.1-style config in transformers 5's spelling (``rope_parameters``) and in the
    Hub's (``rope_theta`` + ``rope_scaling``, with ``rope_type`` or the older ``type``)."""
    from transformers import LlamaConfig

    v5 = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters=dict(LLAMA31_ROPE),
    ).to_dict()
    scaling = {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_theta"}
    hub = {k: v for k, v in v5.items() if k != "rope_parameters"}
    hub.update(rope_theta=500000.0, rope_scaling=scaling)
    typed = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    return [v5, hub, dict(hub, rope_scaling=typed)]


def test_both_rope_spellings_convert_equal():
    from megatron_tempnet.inference.hf_weights import hf_config, model_config_from_hf

    v5, hub, typed = (model_config_from_hf(c) for c in _spellings())
    assert v5 == hub == typed
    scaling = v5.rope().scaling
    assert (v5.rotary_base, scaling.factor, scaling.low_freq_factor) == (500000, 4.0, 0.25)
    assert (scaling.high_freq_factor, scaling.original_max_position_embeddings) == (2.0, 16)
    exported = hf_config(v5, torch.float32)
    assert exported["rope_theta"] == 500000.0
    assert exported["rope_scaling"] == {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_theta"}


# (family, changes to its config, what the error must say); None removes a key
REFUSED = [
    ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0)), "rope_type 'linear'"),
    ("llama", dict(rope_scaling=dict(type="dynamic", factor=2.0)), "rope_type 'dynamic'"),
    (
        "llama",
        dict(rope_scaling=None, rope_parameters=dict(rope_type="yarn", factor=4.0)),
        "rope_parameters rope_type 'yarn'",
    ),
    ("llama", dict(rope_scaling=dict(rope_type="longrope", long_factor=[2.0])), "'longrope'"),
    ("llama", dict(rope_scaling=dict(LLAMA31_ROPE, low_freq_factor=None)), "lacks low_freq_fac"),
    ("llama", dict(rope_scaling=dict(LLAMA31_ROPE, attention_factor=0.5)), "attention_factor=0.5"),
    (
        "llama",
        dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)),
        "config.json gives rope_theta=500000.0 and rope_parameters gives rope_theta=10000.0",
    ),
    (
        "llama",
        dict(rope_scaling=None, rope_parameters=dict(full_attention=dict(rope_type="default"))),
        "per layer type",
    ),
    ("llama", dict(rope_scaling=None, rope_theta=10000.5), "rope_theta=10000.5"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("llama", dict(head_dim=32), "head_dim=32"),
    ("llama", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ("llama", dict(layer_types=["sliding_attention"] * 2), "['sliding_attention']"),
    ("llama", dict(model_type="qwen2"), "model_type 'qwen2'"),
    ("mistral", dict(sliding_window=4096), "mistral sliding_window=4096"),
]


@pytest.mark.parametrize("family,changes,message", REFUSED)
def test_settings_the_model_does_not_compute_are_refused(family, changes, message):
    from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
    from megatron_tempnet.inference.hf_weights import model_config_from_hf

    config = _spellings()[1] if family == "llama" else dict(HUB_CONFIGS["mistral-7b"])
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None or k == "rope_scaling"}
    with pytest.raises(CheckpointError) as error:
        model_config_from_hf(config)
    assert message in str(error.value)


def test_exported_configs_build_the_right_transformers_classes():
    """Mistral stays Mistral (no sliding window), LLaMA-3.2 keeps tied embeddings and scaling."""
    from transformers import AutoConfig, LlamaConfig, MistralConfig

    from megatron_tempnet.inference.hf_weights import hf_config, model_config_from_hf

    for preset, cls in [("mistral-7b", MistralConfig), ("llama3.2-1b", LlamaConfig)]:
        exported = hf_config(model_config_from_hf(HUB_CONFIGS[preset]), torch.bfloat16)
        config = AutoConfig.for_model(exported.pop("model_type"), **exported)
        hub = dict(HUB_CONFIGS[preset])
        hub = AutoConfig.for_model(hub.pop("model_type"), **hub)
        assert type(config) is cls and config.architectures == [cls.__name__[:-6] + "ForCausalLM"]
        for key in ("rope_parameters", "tie_word_embeddings", "head_dim", "num_key_value_heads"):
            assert getattr(config, key) == getattr(hub, key), key
        assert getattr(config, "sliding_window", None) is None


def _import_hf(hf_dir, save, *flags):
    """tools/checkpoint/convert_hf_to_megatron.py, not checked."""
    return tool("checkpoint/convert_hf_to_megatron.py", "--hf-dir", hf_dir, "--save", save, *flags,
                check=False)  # fmt: skip


def test_conversion_errors_are_clear(hf, tmp_path):
    bad = _import_hf(tmp_path / "nope", tmp_path / "x")
    assert bad.returncode == 1 and "--hf-dir" in bad.stderr and "Traceback" not in bad.stderr
    layers = _import_hf(hf["llama"], tmp_path / "y", "--target-pp", 3)
    assert layers.returncode == 1 and "--target-pp (3)" in layers.stderr
    with_tokenizer = tmp_path / "with-tokenizer"  # the model with a tokenizer file beside it
    os.makedirs(with_tokenizer)
    for name in os.listdir(hf["llama"]):
        os.symlink(os.path.join(hf["llama"], name), with_tokenizer / name)
    (with_tokenizer / "tokenizer_config.json").write_text("{}")
    heads = _import_hf(with_tokenizer, tmp_path / "z", "--target-tp", 4)
    assert heads.returncode == 1 and "--num-query-groups (2)" in heads.stderr
    assert not os.path.exists(tmp_path / "z")  # nothing written: no tokenizer/ either
    ckpt = convert(hf["llama"], tmp_path / "w")
    again = _import_hf(hf["llama"], ckpt)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    windowed = tmp_path / "windowed"
    os.makedirs(windowed)
    os.symlink(os.path.join(hf["mistral"], "model.safetensors"), windowed / "model.safetensors")
    with open(os.path.join(hf["mistral"], "config.json")) as f:
        config = dict(json.load(f), sliding_window=4096)
    with open(windowed / "config.json", "w") as f:
        json.dump(config, f)
    window = _import_hf(windowed, tmp_path / "v")
    assert window.returncode == 1 and "sliding_window=4096" in window.stderr
    assert "Traceback" not in window.stderr and not os.path.exists(tmp_path / "v" / "latest")
    planted, ran = tmp_path / "planted", tmp_path / "code-ran"
    os.makedirs(planted)
    shutil.copy(os.path.join(hf["llama"], "config.json"), planted / "config.json")
    torch.save(
        {"model.embed_tokens.weight": PlantedPickle(str(ran))}, planted / "pytorch_model.bin"
    )
    refused = _import_hf(planted, tmp_path / "u")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {planted / 'pytorch_model.bin'}: refused: loading it would run code (it calls "
        f"{open.__module__}.open); only files of tensors are loaded (torch.load weights_only=True)"
    ]
    assert not ran.exists() and not os.path.exists(tmp_path / "u" / "latest")
    missing = tool(
        "checkpoint/convert_megatron_to_hf.py",
        "--load",
        tmp_path / "none",
        "--save",
        tmp_path / "out",
        check=False,
    )
    assert missing.returncode == 1 and "--load" in missing.stderr
