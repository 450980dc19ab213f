"""Hugging Face interop: tiny random transformers LLaMA (grouped-query attention) and GPT-2 ->
our checkpoints at TP 1/2 x PP 1/2 give HF's logits; pretrain_gpt.py loads the conversions
(--load, --finetune, --pretrained-checkpoint) under DeepSpeed; ours -> HF is weight-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.corpus import blend_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.entry_points import run_command
from tests.helpers.hf_models import load_hf, save_hf_gpt2, save_hf_llama

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    corpus = blend_corpus(str(d), vocab_size=500)
    vocab = corpus["tokenizer"].vocab_size  # 500: padded to 512 at TP 1 and 2
    return {"dir": d, "corpus": corpus, "vocab": vocab,
            "llama": save_hf_llama(str(d), vocab), "gpt2": save_hf_gpt2(str(d), vocab)}  # fmt: skip


def tool(script: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(REPO, "tools", *script.split("/")), *map(str, args)]
    r = run_command(cmd, env=ENV, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def convert(hf_dir: str, out, tp: int = 1, pp: int = 1) -> str:
    tool("checkpoint/convert_hf_to_megatron.py", "--hf-dir", hf_dir, "--save", out,
         "--target-tp", tp, "--target-pp", pp)  # fmt: skip
    return str(out)


def _our_logits(load_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_tempnet.inference.model import init_inference, load_inference_model

    init_inference(torch.distributed.get_world_size())
    return load_inference_model(load_dir).logits(tokens)  # [b, s, V_pad/tp]


def our_logits(load_dir: str, tokens: torch.Tensor, tp: int) -> torch.Tensor:
    shards = run_distributed(_our_logits, world_size=tp, args=(load_dir, tokens), timeout=240)
    return torch.cat(shards, dim=-1)  # [b, s, V_pad]


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_converted_models_give_hf_logits_at_every_layout(hf, arch, tmp_path):
    tokens, vocab = _tokens(hf["vocab"]), hf["vocab"]
    with torch.no_grad():
        reference = load_hf(hf[arch])(tokens).logits.float()
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        ckpt = convert(hf[arch], tmp_path / f"tp{tp}pp{pp}", tp, pp)
        files = os.listdir(os.path.join(ckpt, "iter_0000000"))
        assert sum(f.startswith("layer_") for f in files) == (
            0 if pp == 1 else tp * (5 if arch == "gpt2" else 6)
        )
        logits = our_logits(ckpt, tokens, tp)
        assert logits.shape[-1] == 512  # padded for TP
        torch.testing.assert_close(logits[..., :vocab], reference, rtol=0, atol=1e-5)
        assert (logits[..., vocab:] == 0).all()  # zero rows for the padding


def _model_args(ckpt) -> list[str]:
    with open(os.path.join(ckpt, "model_flags.txt")) as f:
        return f.read().split()


def _pretrain(hf, nproc: int, flags: list[str], out) -> None:
    spec = hf["corpus"]["spec"]
    args = [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", spec["vocab_file"],
        "--merge-file", spec["merge_file"], "--data-path", hf["corpus"]["prefix"]["A"],
        "--split", "90,8,2", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "0",
        "--tempnet-hidden-size", "16", "--tempnet-proj-size", "16", "--tempnet-rho", "4",
        "--data-cache-path", str(hf["dir"] / "cache"), "--save", str(out), *flags,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(REPO, "pretrain_gpt.py"), *args]  # fmt: skip
    r = run_command(cmd, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.parametrize(
    "arch,tp,pp,how",
    [("llama", 2, 1, "load"), ("gpt2", 1, 2, "pretrained"), ("llama", 1, 2, "finetune")],
)
def test_pretrain_gpt_trains_from_the_conversion(hf, arch, tp, pp, how, tmp_path):
    """With --lr 0 the run's saved LM is the converted one, tensor for tensor: DeepSpeed loaded
    every file; its HF export gives the run's logits."""
    from megatron_tempnet.inference.checkpoint_io import CheckpointReader

    ckpt = convert(hf[arch], tmp_path / "converted", tp, pp)
    load = {
        "load": ["--load", ckpt],
        "finetune": ["--load", ckpt, "--finetune"],
        "pretrained": ["--pretrained-checkpoint", ckpt, "--load", str(tmp_path / "run")],
    }[how]
    flags = [
        *_model_args(ckpt),
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
    run, converted = CheckpointReader(str(tmp_path / "run")), CheckpointReader(ckpt)
    assert run.has_tempnet() and open(tmp_path / "run" / "latest").read() == "iter_0000002"
    lm = [n for n in converted.names()]
    assert lm and sorted(lm) == sorted(n for n in run.names() if not n.startswith("tempnet."))
    for name in lm:
        assert torch.equal(run.full(name), converted.full(name)), name
    tool("checkpoint/convert_megatron_to_hf.py", "--load", tmp_path / "run",
         "--save", tmp_path / "hf-out")  # fmt: skip
    tokens = _tokens(hf["vocab"])
    with torch.no_grad():
        exported = load_hf(str(tmp_path / "hf-out"))(tokens).logits
    torch.testing.assert_close(our_logits(str(tmp_path / "run"), tokens, 1)[..., : hf["vocab"]],
                               exported, rtol=0, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_round_trip_back_to_hf_is_weight_identical(hf, arch, tmp_path):
    from safetensors.torch import load_file

    ckpt = convert(hf[arch], tmp_path / "ours", 2, 2)
    out = tmp_path / "back"
    r = tool("checkpoint/convert_megatron_to_hf.py", "--load", ckpt, "--save", out,
             "--max-shard-size-gb", 0.0001)  # about 100 KB: several shards  # fmt: skip
    assert "shard(s)" in r.stdout
    original = load_file(os.path.join(hf[arch], "model.safetensors"))
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
    keys = ["vocab_size", "hidden_size", "num_key_value_heads", "rms_norm_eps", "n_embd",
            "n_head", "activation_function", "tie_word_embeddings", "model_type"]  # fmt: skip
    assert {k: got.get(k) for k in keys if k in want} == {k: want[k] for k in keys if k in want}


def test_conversion_errors_are_clear(hf, tmp_path):
    bad = tool("checkpoint/convert_hf_to_megatron.py", "--hf-dir", tmp_path / "nope",
               "--save", tmp_path / "x", check=False)  # fmt: skip
    assert bad.returncode == 1 and "--hf-dir" in bad.stderr and "Traceback" not in bad.stderr
    layers = tool("checkpoint/convert_hf_to_megatron.py", "--hf-dir", hf["llama"], "--save",
                  tmp_path / "y", "--target-pp", 3, check=False)  # fmt: skip
    assert layers.returncode == 1 and "--target-pp (3)" in layers.stderr
    heads = tool("checkpoint/convert_hf_to_megatron.py", "--hf-dir", hf["llama"], "--save",
                 tmp_path / "z", "--target-tp", 4, check=False)  # fmt: skip
    assert heads.returncode == 1 and "--num-query-groups (2)" in heads.stderr
    assert not os.path.exists(tmp_path / "z" / "latest")
    ckpt = convert(hf["llama"], tmp_path / "w")
    again = tool("checkpoint/convert_hf_to_megatron.py", "--hf-dir", hf["llama"], "--save", ckpt,
                 check=False)  # fmt: skip
    assert again.returncode == 1 and "--overwrite" in again.stderr
    missing = tool("checkpoint/convert_megatron_to_hf.py", "--load", tmp_path / "none",
                   "--save", tmp_path / "out", check=False)  # fmt: skip
    assert missing.returncode == 1 and "--load" in missing.stderr
