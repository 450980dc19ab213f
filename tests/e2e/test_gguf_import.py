"""llama.cpp GGUF files -> our checkpoints (``convert_hf_to_megatron.py --gguf``).

Tiny LLaMA files are written here with ``gguf.GGUFWriter``: grouped-query attention with a tied
embedding, and plain multi-head attention with an output layer, their tensors in F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (``gguf.quants.quantize``) and Q4_K, Q5_K and Q6_K (random blocks:
the package dequantises K-quants but does not quantise them), with a byte-level BPE tokenizer in
the metadata. Each conversion gives transformers' logits for the same file (TP 1, and TP 2 for
one), and the tokenizer it saves gives transformers' ids; a converter without the q/k row
un-permutation, or one that reads a Q4_1 tensor as Q4_0, gives logits far from them; what the
model here does not compute is refused in one line naming it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

from megatron_tempnet.inference.gguf_weights import dequantize as real_dequantize
from tests.helpers.corpus import pydoc_documents, train_gpt2_bpe
from tests.helpers.distributed import run_distributed

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# rows of 256 values: every tensor can hold a K-quant; no FFN matrix is square
HIDDEN, HEADS, FFN, LAYERS = 256, 4, 512, 2
TEXT = "The quick brown fox: def f(x):\n    return x ** 2  # naïve café, 東京 🙂"
# per tensor kind, the types it is stored in, one per layer (norms are F32, as llama.cpp writes)
TYPES = {
    "gqa": {
        "token_embd": Q.Q8_0,
        "attn_q": (Q.Q4_1, Q.Q6_K),
        "attn_k": (Q.Q4_0, Q.Q4_1),
        "attn_v": (Q.Q8_0, Q.Q5_0),
        "attn_output": (Q.F16, Q.Q4_K),
        "ffn_gate": (Q.Q5_1, Q.BF16),
        "ffn_up": (Q.Q4_K, Q.Q8_0),
        "ffn_down": (Q.Q6_K, Q.Q5_K),
    },
    "mha": {
        "token_embd": Q.F16,
        "output": Q.Q6_K,
        "attn_q": (Q.Q8_0, Q.Q4_1),
        "attn_k": (Q.Q4_1, Q.F32),
        "attn_v": (Q.F32, Q.Q4_0),
        "attn_output": (Q.Q5_0, Q.F16),
        "ffn_gate": (Q.Q4_0, Q.Q5_K),
        "ffn_up": (Q.BF16, Q.Q5_1),
        "ffn_down": (Q.Q4_1, Q.Q8_0),
    },
}
GROUPS = {"gqa": 2, "mha": HEADS}


def tool():
    """``tools/checkpoint/convert_hf_to_megatron.py`` as a module (its ``main`` runs here)."""
    path = os.path.join(REPO, "tools", "checkpoint", "convert_hf_to_megatron.py")
    spec = importlib.util.spec_from_file_location("convert_hf_to_megatron", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bpe_vocabulary(directory: str) -> tuple[list[str], list[str]]:
    """A byte-level BPE trained on pydoc text: tokens in id order, merges in rank order."""
    import json

    vocab_file, merges_file = train_gpt2_bpe(directory, 400, pydoc_documents(40))
    with open(vocab_file) as f:
        vocab = json.load(f)
    with open(merges_file) as f:
        merges = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#")]
    return sorted(vocab, key=vocab.get), merges


def _k_blocks(rng, rows: int, cols: int, kind) -> np.ndarray:
    """Random K-quant blocks ``[rows, bytes]``: random codes and sub-block scales, the f16 block
    scales chosen so that the values stay below about 4 / sqrt(cols)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    top = 4 / np.sqrt(cols)

    def f16(largest_code: int) -> np.ndarray:
        d = rng.uniform(0.5, 1.0, (rows, cols // block, 1)) * top / largest_code
        return d.astype(np.float16).view(np.uint8)

    if kind == Q.Q6_K:  # codes, high bits, int8 scales, then d: d * scale * (6-bit code - 32)
        data[..., -2:] = f16(127 * 32)
    else:  # Q4_K, Q5_K: d, dmin, 6-bit scales and minima, codes: d * scale * code - dmin * min
        data[..., 0:2] = f16(63 * 31)
        data[..., 2:4] = f16(63 * 31)
    return data.reshape(rows, -1)


def _stored(rng, shape: tuple[int, ...], kind, vocab: int = 0) -> tuple[np.ndarray, object]:
    """A random tensor of HF shape ``[out, in]`` as stored in ``kind``."""
    if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return _k_blocks(rng, *shape, kind), kind
    if len(shape) == 1:  # a norm
        return rng.uniform(0.5, 1.5, shape).astype(np.float32), Q.F32
    std = 0.3 if shape[0] == vocab else 1 / np.sqrt(shape[1])  # embedding: logits of ~10
    values = rng.normal(0.0, std, shape).astype(np.float32)
    return gguf.quants.quantize(values, kind), kind


def write_gguf(path, case: str, vocabulary, *, arch="llama", drop=(), extra=None, scaling=None):
    """A two-layer LLaMA GGUF file of ``case`` (``TYPES``) with the BPE ``vocabulary``;
    ``drop`` leaves tensors out, ``extra`` adds (or replaces) ``{tensor name: (array, type)}``,
    ``scaling`` is a RoPE scaling type (factor 2)."""
    tokens, merges = vocabulary
    groups, d, V = GROUPS[case], HIDDEN // HEADS, len(tokens)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(groups)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(1e5)
    w.add_layer_norm_rms_eps(1e-5)
    if scaling is not None:
        w.add_rope_scaling_type(scaling)
        w.add_rope_scaling_factor(2.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    shapes = {"token_embd": (V, HIDDEN), "output": (V, HIDDEN), "attn_q": (HEADS * d, HIDDEN)}
    shapes.update(attn_k=(groups * d, HIDDEN), attn_v=(groups * d, HIDDEN))
    shapes.update(attn_output=(HIDDEN, HEADS * d), ffn_gate=(FFN, HIDDEN), ffn_up=(FFN, HIDDEN))
    shapes.update(ffn_down=(HIDDEN, FFN), attn_norm=(HIDDEN,), ffn_norm=(HIDDEN,))
    tensors = {"output_norm.weight": _stored(rng, (HIDDEN,), Q.F32)}
    for kind, types in TYPES[case].items():
        if not isinstance(types, tuple):
            tensors[f"{kind}.weight"] = _stored(rng, shapes[kind], types, V)
            continue
        for i, t in enumerate(types):
            tensors[f"blk.{i}.{kind}.weight"] = _stored(rng, shapes[kind], t)
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = _stored(rng, (HIDDEN,), Q.F32)
    tensors = {name: t for name, t in tensors.items() if name not in drop} | (extra or {})
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _read_q4_1_as_q4_0(data: np.ndarray, kind) -> np.ndarray:
    """A mis-read: Q4_1 blocks (d, m, 16 bytes of codes: d q + m) taken as Q4_0's (d, codes:
    d (q - 8)), the minimum dropped."""
    if kind != Q.Q4_1:
        return real_dequantize(data, kind)
    blocks = np.asarray(data).reshape(data.shape[0], -1, 20)
    as_q4_0 = np.concatenate([blocks[..., :2], blocks[..., 4:]], axis=-1)
    return real_dequantize(as_q4_0.reshape(data.shape[0], -1), Q.Q4_0)


def _logits(load_dirs: list[str], tokens: torch.Tensor, text: str):
    """Rank's logits ``[b, s, V_pad/tp]`` of each checkpoint, the first loaded as the inference
    tools load it (``load_from_args``: its saved tokenizer, no tokenizer flag), whose ids of
    ``text`` come back too."""
    from megatron_tempnet.inference.cli import add_model_args, load_from_args
    from megatron_tempnet.inference.model import load_inference_model

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    tp = str(torch.distributed.get_world_size())
    args = ["--load", load_dirs[0], "--fixed-tau", "1", "--tensor-model-parallel-size", tp]
    model, tokenizer = load_from_args(parser.parse_args(args))
    logits = [model.logits(tokens)]
    logits += [load_inference_model(d).logits(tokens) for d in load_dirs[1:]]
    return logits, tokenizer.tokenize(text)


def our_logits(load_dirs: list[str], tokens: torch.Tensor, tp: int):
    shards = run_distributed(_logits, world_size=tp, args=(load_dirs, tokens, TEXT), timeout=240)
    logits = [torch.cat(parts, dim=-1) for parts in zip(*(s[0] for s in shards))]
    return logits, shards[0][1]


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Both cases written and converted, plus the two broken conversions of ``gqa``; every
    checkpoint's logits at TP 1, ``gqa``'s at TP 2, and transformers' for each file."""
    from megatron_tempnet.inference import gguf_weights

    d = tmp_path_factory.mktemp("gguf")
    vocabulary = bpe_vocabulary(str(d))
    files = {case: write_gguf(d / f"{case}.gguf", case, vocabulary) for case in TYPES}
    convert = tool().main
    ckpt = {}
    for case, path in files.items():
        ckpt[case] = str(d / f"ckpt-{case}")
        assert convert(["--gguf", path, "--save", ckpt[case]]) == 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_weights, "unpermute_rows", lambda weight, heads: weight)
        ckpt["no-unpermute"] = str(d / "ckpt-no-unpermute")
        assert convert(["--gguf", files["gqa"], "--save", ckpt["no-unpermute"]]) == 0
        mp.undo()
        mp.setattr(gguf_weights, "dequantize", _read_q4_1_as_q4_0)
        ckpt["q4_1-as-q4_0"] = str(d / "ckpt-q4_1-as-q4_0")
        assert convert(["--gguf", files["gqa"], "--save", ckpt["q4_1-as-q4_0"]]) == 0
    tokens = torch.randint(
        0, len(vocabulary[0]), (2, 24), generator=torch.Generator().manual_seed(3)
    )
    names = list(ckpt)
    tp1, ids = our_logits([ckpt[n] for n in names], tokens, 1)
    tp2, ids_tp2 = our_logits([ckpt["gqa"]], tokens, 2)
    return {
        "vocabulary": vocabulary,
        "files": files,
        "ckpt": ckpt,
        "ours": dict(zip(names, tp1)),
        "ours_tp2": tp2[0],
        "ids": (ids, ids_tp2),
        "hf": {case: hf_logits(path, tokens) for case, path in files.items()},
    }


def _max_error(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max |ours - reference| over the true vocabulary, max |reference|)."""
    V = reference.shape[-1]
    assert (ours[..., V:] == 0).all()  # the padded rows are zero
    return (ours[..., :V] - reference).abs().max().item(), reference.abs().max().item()


@pytest.mark.parametrize("case", list(TYPES))
def test_conversion_gives_transformers_logits(converted, case):
    error, size = _max_error(converted["ours"][case], converted["hf"][case])
    assert size > 1.0 and error <= 1e-5 * size, (error, size)
    if case == "gqa":  # the same checkpoint loaded at TP 2
        error, _ = _max_error(converted["ours_tp2"], converted["hf"][case])
        assert error <= 1e-5 * size, (error, size)


def test_tests_see_a_missing_unpermutation_and_a_misread_type(converted):
    reference = converted["hf"]["gqa"]
    size = reference.abs().max().item()
    for broken in ("no-unpermute", "q4_1-as-q4_0"):
        error, _ = _max_error(converted["ours"][broken], reference)
        assert error > 0.05 * size, (broken, error, size)


def test_saved_tokenizer_gives_transformers_ids(converted):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer

    from megatron_tempnet.inference.checkpoint_io import CheckpointReader

    ckpt = converted["ckpt"]["gqa"]
    assert CheckpointReader(ckpt).config["tokenizer"] == {
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_model": os.path.join(ckpt, "tokenizer"),
    }
    directory, name = os.path.split(converted["files"]["gqa"])
    want = AutoTokenizer.from_pretrained(directory, gguf_file=name)(TEXT, add_special_tokens=False)
    tokens, merges = converted["vocabulary"]  # the tokenizer the file was written from
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    trained = Tokenizer(bpe)
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    ids, ids_tp2 = converted["ids"]
    assert ids == ids_tp2 == want["input_ids"] == trained.encode(TEXT).ids
    assert len(ids) > 10 and max(ids) >= 256  # merges were used


def _refused(tmp_path, *args) -> str:
    from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError

    with pytest.raises(CheckpointError) as error:
        tool().main([*args, "--save", str(tmp_path / "out")])
    assert not os.path.exists(tmp_path / "out" / "latest")
    return str(error.value)


def test_what_the_model_does_not_compute_is_refused(converted, tmp_path, monkeypatch):
    path, vocabulary = str(tmp_path / "m.gguf"), converted["vocabulary"]
    write_gguf(path, "mha", vocabulary, arch="qwen2")
    assert _refused(tmp_path, "--gguf", path) == (
        f"--gguf {path}: general.architecture 'qwen2': only 'llama' is supported"
    )
    v = np.zeros(gguf.quants.quant_shape_to_byte_shape((HIDDEN, HIDDEN), Q.Q8_1), np.uint8)
    extra = {"blk.1.attn_v.weight": (v, Q.Q8_1)}
    write_gguf(path, "mha", vocabulary, extra=extra)
    assert _refused(tmp_path, "--gguf", path) == (
        f"--gguf {path}: tensor blk.1.attn_v.weight has type Q8_1, which gguf cannot dequantise"
    )
    write_gguf(path, "mha", vocabulary, drop=["blk.1.ffn_up.weight"])
    assert _refused(tmp_path, "--gguf", path) == f"--gguf {path}: no tensor blk.1.ffn_up.weight"
    freqs = (np.full(HIDDEN // HEADS // 2, 2.0, dtype=np.float32), Q.F32)  # not LLaMA-3's
    write_gguf(path, "mha", vocabulary, extra={"rope_freqs.weight": freqs})
    assert _refused(tmp_path, "--gguf", path) == (
        f"--gguf {path}: tensor rope_freqs.weight: its factors are not LLaMA-3's scaling (too "
        "few between 1 and the largest)"
    )
    write_gguf(path, "mha", vocabulary, scaling=gguf.RopeScalingType.LINEAR)
    assert _refused(tmp_path, "--gguf", path).startswith(
        f"--gguf {path}: rope_scaling rope_type 'linear': only 'default' and 'llama3'"
    )
    hf_dir = converted["ckpt"]["gqa"]
    assert _refused(tmp_path, "--gguf", path, "--hf-dir", hf_dir) == (
        f"--hf-dir {hf_dir} and --gguf {path}: give one of them, not both"
    )
    monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
    assert _refused(tmp_path, "--gguf", path) == (
        f"--gguf {path}: reading GGUF files needs the `gguf` package: pip install -e '.[gguf]'"
    )


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3["original_max_position_embeddings"] = 32.0  # 4 of the 32 frequencies in between


def test_a_llama3_rope_freqs_table_gives_transformers_llama3_logits(converted, tmp_path):
    """A LLaMA-3.1-shaped file: RoPE scaling stored only as llama.cpp's ``rope_freqs`` table
    (here transformers' own llama3 frequencies over the plain ones). The import recovers the
    parameters, and the logits are transformers' with that scaling, far from those without."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from megatron_tempnet.inference.gguf_weights import GGUFWeights

    d, theta = HIDDEN // HEADS, 1e5
    rope = {"rope_type": "llama3", "rope_theta": theta, **LLAMA3}
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    table = (plain / scaled).numpy().astype(np.float32)
    path = write_gguf(tmp_path / "llama31.gguf", "gqa", converted["vocabulary"],
                      extra={"rope_freqs.weight": (table, Q.F32)})  # fmt: skip
    assert GGUFWeights(path).config["rope_scaling"] == {"rope_type": "llama3", **LLAMA3}
    ckpt = str(tmp_path / "ckpt")
    assert tool().main(["--gguf", path, "--save", ckpt]) == 0
    tokens = torch.randint(0, len(converted["vocabulary"][0]), (2, 24),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    ours = our_logits([ckpt], tokens, 1)[0][0]
    directory, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    hf.config.rope_parameters = rope
    hf.model.rotary_emb = LlamaRotaryEmbedding(config=hf.config)
    with torch.no_grad():
        reference = hf.eval()(tokens).logits
    error, size = _max_error(ours, reference)
    assert size > 1.0 and error <= 1e-5 * size, (error, size)
    unscaled, _ = _max_error(ours, converted["hf"]["gqa"])  # the same weights, no scaling
    assert unscaled > 1e-2 * size, (unscaled, size)


def _decode_blocks(raw: np.ndarray, qtype) -> np.ndarray:
    """Q8_0, Q4_0 and Q4_1 decoded from their bytes as ggml lays them out (32 values a block:
    an f16 scale d, for Q4_1 an f16 minimum m, then int8 values (Q8_0: d q) or 16 bytes of
    nibbles, the low ones the block's first 16 values (Q4_0: d (q - 8); Q4_1: d q + m))."""
    head = {Q.Q8_0: 2, Q.Q4_0: 2, Q.Q4_1: 4}[qtype]
    blocks = raw.reshape(-1, head + (32 if qtype == Q.Q8_0 else 16))
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    if qtype == Q.Q8_0:
        return (d * blocks[:, 2:].view(np.int8)).reshape(-1)
    nibbles = blocks[:, head:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float64)
    if qtype == Q.Q4_0:
        return (d * (q - 8)).reshape(-1)
    return (d * q + blocks[:, 2:4].copy().view(np.float16).astype(np.float64)).reshape(-1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantisation_follows_the_block_layout(qtype):
    """The values the import reads equal a decoder of the bytes written here, independent of the
    ``gguf`` package's own dequantiser (which transformers' reference shares)."""
    weights = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    read = real_dequantize(raw, qtype)
    assert read.shape == weights.shape
    np.testing.assert_allclose(read.reshape(-1), _decode_blocks(raw.reshape(-1), qtype), rtol=1e-6)
    scale = np.abs(weights).max()
    assert np.abs(read - weights).max() < {Q.Q8_0: 0.01, Q.Q4_0: 0.2, Q.Q4_1: 0.2}[qtype] * scale


def test_the_real_lm_example_runs_on_a_small_file(converted, tmp_path):
    """``examples/real_lm.py`` (``make real-lm``) end to end on the small grouped-query file
    instead of SmolLM2: import, parity with transformers, TempNet trained two ways on the frozen
    LM (the second run reading the first one's hidden states), the held-out table from
    tools/evaluate.py, the pictures and the generations; then --finetune (CE and DRO) in the
    same folder, reusing the import."""
    import json
    import re
    import subprocess

    def real_lm(out, *flags) -> subprocess.CompletedProcess:
        cmd = [sys.executable, os.path.join(REPO, "examples", "real_lm.py"), "--out", str(out)]
        cmd += ["--gguf", str(converted["files"]["gqa"]), "--seq-length", "32"]
        cmd += ["--max-heldout", "3", *flags]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    out = tmp_path / "rl"
    r = real_lm(out, "--iters", "4", "--runs", "dro", "ts-ce")
    difference = re.search(r"largest per-token difference ([\d.e+-]+) nats", r.stdout)
    assert difference and float(difference[1]) < 1e-4, r.stdout
    results = json.loads((out / "results.json").read_text())
    dro, rows = results["runs"]["dro"], results["rows"]
    assert dro["best_fixed_tllm_ppl"] == min(dro["tau_grid"].values())
    assert rows["tau = 1"][3] == dro["ppl"] == dro["tau_grid"]["1"]
    assert rows["per-token DRO optimum (Baseline 2, exact)"][3] == dro["tllm_ppl"]
    tsce = rows["TS-CE TempNet (Baseline 3 loss)"]
    assert tsce[3] == results["runs"]["ts-ce"]["tempnet_tllm_ppl"]
    assert rows["tau = 1"][4] == dro["calibration"]["tau_1"]
    assert tsce[4] == results["runs"]["ts-ce"]["calibration"]["tempnet"]
    for name in rows:  # the table prints every row with its perplexity, ECE and Brier score
        ppl, cal = rows[name][3], rows[name][4]
        line = rf"{re.escape(name)} +\|.*\| +{ppl:.2f} \| +{cal['ece']:.4f} \| {cal['brier']:.4f}\n"
        assert re.search(line, r.stdout), name
    # the second run read the hidden states the first one stored
    stored = re.search(r"the frozen LM's hidden states: (\d+) samples", r.stdout)
    assert stored and int(stored[1]) == len(list((out / "hidden").glob("*/*/*.pt"))) > 0
    for picture in ("tau.png", "reliability.png"):
        assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = {}
    for tag in ("tempnet", "target", "tau1", "transformers"):
        lines = (out / f"generations_{tag}.jsonl").read_text().splitlines()
        samples[tag] = [json.loads(x) for x in lines]
        assert len(samples[tag]) == 3 and all(len(g["tau"]) > 0 for g in samples[tag]), tag
    assert samples["tempnet"][0]["sampling"]["tau_max_eval"] is None
    assert samples["target"][0]["sampling"]["tau_max_eval"] > 0
    assert "TS-CE loss" in r.stdout and r.stderr == ""
    # setting (ii) in the same --out: the import, corpus and parity reused, not redone; the LM
    # finetuned with CE and with DRO + TempNet, scored on the same text
    imported = (out / "lm" / "model_flags.txt").stat().st_mtime_ns
    frozen_diagram = (out / "reliability.png").read_bytes()
    r = real_lm(out, "--iters", "2", "--finetune", "--runs", "ce", "dro")
    assert "[1-4/8] reused from an earlier run: the import of" in r.stdout, r.stdout
    assert "[2/8] import" not in r.stdout
    assert (out / "lm" / "model_flags.txt").stat().st_mtime_ns == imported
    runs = json.loads((out / "finetune_results.json").read_text())["runs"]
    assert "tempnet_tllm_ppl" not in runs["ce"] and runs["dro"]["tempnet_tau_std"] >= 0
    for name, label in (("ce", "CE (the baseline)"), ("dro", "DRO TempNet (setting ii)")):
        row = re.search(rf"{re.escape(label)} +\| +([\d.]+) \|", r.stdout)
        assert row and float(row[1]) == round(runs[name]["ppl"], 2), r.stdout
    verdict = f"DRO TempNet (setting ii) at tau = 1: {runs['dro']['ppl']:.3f} vs CE's"
    assert verdict in r.stdout and (out / "reliability.png").read_bytes() != frozen_diagram
