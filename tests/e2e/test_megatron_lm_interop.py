"""Megatron-LM checkpoints in pretrain_gpt.py and the tools: megatron-core's own LLaMA-shaped
``GPTModel`` saved at TP 2 in Megatron-LM's torch_dist and legacy torch formats and in
Megatron-DeepSpeed's (with the corpus' tokenizer in its args) trains TempNet here at another
layout in setting (ii) (--load --finetune) and setting (iii) (--pretrained-checkpoint, frozen
LM); tools/generate.py and tools/evaluate.py read the Megatron-LM checkpoint, directly and behind
a TempNet-only run, giving megatron-core's greedy tokens and CE, as does transformers on its
conversion to Hugging Face."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.checkpoints import weights
from tests.helpers.corpus import blend_corpus, data_flags, pydoc_documents
from tests.helpers.distributed import run_distributed
from tests.helpers.entry_points import cli_flags, run_command, run_entry_point
from tests.helpers.hf_models import load_hf
from tests.helpers.run_flags import tempnet_flags
from tests.helpers.shapes import parity_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
SEQ, NEW = 64, 8
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--max-position-embeddings", str(SEQ), "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip


def _write(root: str, vocab: int, spec: dict, documents: list[list[int]], prompt: list[int]):
    """megatron-core's LLaMA at TP 2, saved both ways; its CE on ``documents`` and greedy
    continuation of ``prompt`` (rank 0's)."""
    from tests.helpers import megatron_lm

    model = parity_model("llama", SEQ, vocab, llama_ffn=96)
    gpt = megatron_lm.build_gpt_model(model, tp=2, pp=1)
    args = megatron_lm.megatron_args(model, tp=2, pp=1, vocab_size=None)
    args.vocab_size = None
    vars(args).update(spec)
    megatron_lm.save_torch_dist(gpt, args, os.path.join(root, "dist"))
    megatron_lm.save_legacy(gpt, args, os.path.join(root, "legacy"), te_names=True)
    ds_args = megatron_lm.deepspeed_args(model, tp=2, pp=1, vocab_size=None)
    vars(ds_args).update(spec)
    megatron_lm.save_deepspeed(gpt, ds_args, os.path.join(root, "deepspeed"))
    ce = []
    for doc in documents:
        logits = megatron_lm.pipeline_logits(gpt, torch.tensor([doc]))[0, :-1, :vocab].double()
        ce.append(torch.nn.functional.cross_entropy(logits, torch.tensor(doc[1:]), reduction="sum"))
    tokens = list(prompt)
    for _ in range(NEW):
        logits = megatron_lm.pipeline_logits(gpt, torch.tensor([tokens]))
        tokens.append(int(logits[0, -1, :vocab].argmax()))
    return {"ce": torch.stack(ce), "greedy": tokens[len(prompt) :]}


@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    d = tmp_path_factory.mktemp("megatron_lm")
    corpus = blend_corpus(str(d), vocab_size=500)
    tokenizer = corpus["tokenizer"]
    texts = [t[:110] for t in pydoc_documents(4)]
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    documents = [tokenizer.tokenize(t) for t in texts]
    assert max(len(doc) for doc in documents) <= SEQ
    prompt = documents[0][:6]
    (d / "p.jsonl").write_text(json.dumps({"prompt": tokenizer.detokenize(prompt)}) + "\n")
    assert tokenizer.tokenize(tokenizer.detokenize(prompt)) == prompt
    args = (str(d), tokenizer.vocab_size, corpus["spec"], documents, prompt)
    reference = run_distributed(_write, world_size=2, args=args, timeout=240)[0]
    return {"dir": d, "corpus": corpus, "documents": documents, **reference}


def _train(mlm, out, nproc: int, flags: list[str], model: list[str] = MODEL_FLAGS) -> None:
    run = {
        **data_flags(mlm["corpus"]["spec"], mlm["corpus"]["prefix"]["A"], 32),
        "micro-batch-size": 2,
        "global-batch-size": 4,
        "train-iters": 2,
        "eval-interval": 0,
        "lr": 0,
        "weight-decay": 0,
        "tempnet-lr": 1e-3,
        **tempnet_flags(16),
        "data-cache-path": mlm["dir"] / "cache",
        "save": out,
    }
    run_entry_point("pretrain_gpt.py", nproc, [*cli_flags(run), *model, *flags], env=ENV)


def _tool(script: str, *args) -> str:
    cmd = [sys.executable, os.path.join(REPO, "tools", script), *map(str, args)]
    r = run_command(cmd, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr


def _greedy(mlm, load, tmp_path, *flags) -> list[int]:
    out = tmp_path / "gen.jsonl"
    _tool(
        "generate.py", "--load", load, "--prompts", mlm["dir"] / "p.jsonl", "--output", out,
        "--max-new-tokens", NEW, "--ignore-eod", *flags,
    )  # fmt: skip
    return json.loads(out.read_text().splitlines()[0])["token_ids"]


def _ppl(mlm, load, tmp_path, *flags) -> dict:
    out = tmp_path / "eval.json"
    _tool(
        "evaluate.py", "--load", load, "--jsonl", mlm["dir"] / "docs.jsonl", "--documents",
        "separate", "--output", out, *flags,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_setting_ii_finetunes_a_torch_dist_checkpoint_at_pp2(mlm, tmp_path):
    """--load --finetune --use-checkpoint-args of the TP-2 torch_dist checkpoint at TP 1 x PP 2
    (the model from its args): with the LM's learning rate 0 the run's LM is Megatron-LM's,
    tensor for tensor; TempNet trained."""
    from megatron_tempnet.inference.checkpoint_io import open_reader

    source = str(mlm["dir"] / "dist")
    flags = ["--load", source, "--finetune", "--use-checkpoint-args"]
    _train(mlm, tmp_path / "run", 2, [*flags, "--pipeline-model-parallel-size", "2"], model=[])
    run = weights(tmp_path / "run")
    reader = open_reader(source, vocab_size=mlm["corpus"]["tokenizer"].vocab_size)
    lm = {n: t for n, t in run.items() if n.startswith("lm.")}
    assert len(lm) == 3 + 2 * 6  # embedding, final norm, output; 6 per layer
    for name, tensor in lm.items():
        assert torch.equal(tensor, reader.full(name.removeprefix("lm."))), name
    assert any(n.startswith("tempnet.") for n in run)
    assert _greedy(mlm, tmp_path / "run", tmp_path) == mlm["greedy"]


def test_setting_iii_trains_tempnet_on_a_frozen_legacy_checkpoint(mlm, tmp_path):
    """--pretrained-checkpoint (legacy torch, Transformer Engine's names) with --freeze-lm at
    TP 1: the run saves TempNet only; generate and evaluate read the LM from the Megatron-LM
    checkpoint behind it, and from it directly: megatron-core's greedy tokens and CE."""
    source = str(mlm["dir"] / "legacy")
    run = tmp_path / "run"
    _train(mlm, run, 1, ["--pretrained-checkpoint", source, "--freeze-lm", "--load", run])
    assert all(n.startswith("tempnet.") for n in weights(run))
    assert _greedy(mlm, run, tmp_path) == mlm["greedy"]
    assert _greedy(mlm, source, tmp_path, "--fixed-tau", 1) == mlm["greedy"]
    n = sum(len(d) - 1 for d in mlm["documents"])
    want = math.exp(mlm["ce"].sum().item() / n)
    fixed = ("--fixed-tau", 1)
    for load, flags in ((run, ()), (mlm["dir"] / "dist", fixed), (mlm["dir"] / "deepspeed", fixed)):
        got = _ppl(mlm, load, tmp_path, *flags)
        assert got["tokens"] == n and got["ppl"] == pytest.approx(want, rel=1e-5)
    # to Hugging Face, straight from Megatron-DeepSpeed's checkpoint: transformers' CE is the same
    _tool("checkpoint/convert_megatron_to_hf.py", "--load", mlm["dir"] / "deepspeed", "--save",
          tmp_path / "hf")  # fmt: skip
    hf = load_hf(str(tmp_path / "hf"))
    with torch.no_grad():
        for doc, ce in zip(mlm["documents"], mlm["ce"]):
            logits = hf(torch.tensor([doc])).logits[0, :-1].double()
            got = torch.nn.functional.cross_entropy(logits, torch.tensor(doc[1:]), reduction="sum")
            assert got.item() == pytest.approx(ce.item(), rel=1e-5)
    # back to Megatron-LM: the LM from the checkpoint the run started from, TempNet beside it
    back = tmp_path / "back"
    _tool("checkpoint/export_megatron_lm.py", "--load", run, "--save", back, "--target-tp", 2)
    assert (back / "latest_checkpointed_iteration.txt").read_text() == "release"
    exported = load_file(back / "tempnet" / "tempnet.safetensors")
    for name, tensor in weights(run).items():
        assert torch.equal(exported[name.removeprefix("tempnet.")], tensor), name
    assert _greedy(mlm, back, tmp_path, "--tempnet", back / "tempnet") == mlm["greedy"]
