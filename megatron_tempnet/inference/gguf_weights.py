"""llama.cpp GGUF LLaMA files seen as a Hugging Face model directory, for ``hf_weights.from_hf``.

``GGUFWeights(path)`` offers what ``HFWeights`` offers: ``config``, an HF ``config.json`` dict
built from the file's metadata (so ``model_config_from_hf`` applies its checks to it), and
``get(*hf_names)``, one tensor under its HF name, float32, dequantised only when asked. The file is
memory-mapped (``gguf.GGUFReader``) and each tensor is dequantised on its own
(``gguf.quants.dequantize``): memory holds the quantised file's pages and one float32 tensor.

What the format says, and what is done with it:

- Shapes: GGUF lists a tensor's dimensions fastest-varying first (ggml's ``ne``), so a linear
  layer ``[out, in]`` is stored ``ne = [in, out]``; the reader's row-major arrays, once
  dequantised, are ``[out, in]``, HF's orientation (checked against the expected shapes).
- Names: ``token_embd``, ``output_norm``, ``output`` (absent: the embedding is tied), and per
  layer ``blk.{i}.`` ``attn_norm``, ``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``,
  ``ffn_norm``, ``ffn_gate``, ``ffn_up``, ``ffn_down``, and ``rope_freqs`` (below). Any other
  tensor (biases, experts) is a computation the model here would miss: the file is refused,
  naming it.
- RoPE: HF's LLaMA rotates the two halves of a head: row ``j * d/2 + i`` of a q or k head is
  component ``j`` (0 or 1) of frequency ``i``. llama.cpp rotates adjacent pairs, and its converter
  moves that row to ``2 i + j``. ``unpermute_rows`` moves it back (q with the query heads, k with
  the key/value heads), after which the rows are megatron-core's non-interleaved layout.
- Metadata (``llama.*``): ``block_count``, ``embedding_length``, ``feed_forward_length``,
  ``attention.head_count(_kv)``, ``attention.layer_norm_rms_epsilon``, ``context_length``,
  ``rope.freq_base``, ``rope.dimension_count`` (RoPE over part of the head, refused),
  ``attention.key_length`` (a head size other than hidden / heads, refused), ``rope.scaling.type``
  (any, refused by ``model_config_from_hf``), ``expert_count`` (refused). The vocabulary size is
  the embedding's row count.
- LLaMA-3.1/3.2's RoPE scaling: llama.cpp stores it only as the ``rope_freqs`` table, what each
  frequency is divided by. ``llama3_rope_scaling`` recovers the parameters from it (exactly up
  to a common scale the frequencies do not depend on; ``rope.scaling.original_context_length``
  fixes it when present) and checks them against every factor; any other table is refused.
- Quantisation: every type ``gguf.quants`` dequantises (F32, F16, BF16, Q4_0 ... Q8_0, the
  K-quants, the IQ types); another (Q8_1, Q8_K, integers) is refused naming the tensor and type.
- The tokenizer (``tokenizer.ggml.*``) is rebuilt by transformers and saved as an HF tokenizer
  directory (``save_tokenizer``).

Every refusal is a ``CheckpointError`` naming the file, and the key or tensor and its value.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from megatron_tempnet.checkpoint.checkpoint_format import CheckpointError
from megatron_tempnet.inference.hf_weights import model_config_from_hf

_INSTALL = "pip install -e '.[gguf]'"
_REQUIRED = object()
_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""GGUF's ``blk.{i}.{key}.weight`` -> HF's ``model.layers.{i}.{value}.weight``."""


def llama3_rope_scaling(
    factors: np.ndarray, theta: float, original: float | None = None
) -> dict | None:
    """HF's ``rope_scaling`` of LLaMA-3.1's kind from llama.cpp's ``rope_freqs`` table (what
    each of the ``dim / 2`` RoPE frequencies ``theta ** (-2 i / dim)`` is divided by); None when
    every factor is 1. Raises ``ValueError`` for a table that is not that scaling.

    LLaMA-3's rule divides the frequencies whose wavelength is above ``original / low`` by
    ``factor``, keeps those below ``original / high`` and, between, divides by ``r`` with
    ``1 / r = (1 - s) / factor + s`` and ``s = (original / wavelength - low) / (high - low)``:
    ``s`` is linear in ``1 / wavelength``, so two or more factors between 1 and ``factor`` give
    its slope and intercept, which fix the parameters up to one common scale (the frequencies do
    not depend on it): ``original`` from the file's original context length when given, else
    ``low = 1`` (LLaMA-3.1 and 3.2's). The parameters found are checked against every factor."""
    r = np.asarray(factors, dtype=np.float64)
    dim = 2 * len(r)
    inv_wavelength = theta ** (-np.arange(0, dim, 2) / dim) / (2 * np.pi)
    factor = float(r.max())
    if np.allclose(r, 1.0, rtol=0, atol=1e-6):
        return None
    between = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    if between.sum() < 2 or r.min() < 1 - 1e-6:
        raise ValueError(
            "its factors are not LLaMA-3's scaling (too few between 1 and the largest)"
        )
    smooth = (1 / r[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelength[between], smooth, 1)  # s = slope x + intercept
    if not (slope > 0 and intercept < 0):
        raise ValueError("its factors are not LLaMA-3's scaling")
    if original is None:
        low = 1.0
        original = -slope / intercept * low
        if abs(original - round(original)) < 1e-3 * original:
            original = float(round(original))
    width = original / slope  # high - low
    low = -intercept * width
    exact = {"factor": factor, "low_freq_factor": low, "high_freq_factor": low + width}
    exact["original_max_position_embeddings"] = original
    short = {k: float(f"{v:.6g}") for k, v in exact.items()}  # the float32 table's precision
    for params in (short, exact):
        if np.allclose(llama3_factors(params, theta, dim), r, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", **{k: float(v) for k, v in params.items()}}
    raise ValueError(f"its factors are not LLaMA-3's scaling (nearest: {short})")


def llama3_factors(params: dict, theta: float, dim: int) -> np.ndarray:
    """What LLaMA-3's scaling with ``params`` (HF's names) divides each frequency by."""
    wavelength = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / factor + smooth)


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order -> HF's, per head: ``[heads * d, ...]`` (a weight ``[heads d,
    h]`` or a bias ``[heads d]``), row ``2 i + j`` of a head -> row ``j * d/2 + i``."""
    d = weight.shape[0] // heads
    pairs = weight.reshape(heads, d // 2, 2, *weight.shape[1:])  # [heads, i, j, ...]
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()  # [heads, j, i, ...]


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """One tensor's stored data (a memory-mapped view) -> float32 ``[out, in]`` (or ``[n]``)."""
    from gguf import quants

    return quants.dequantize(data, qtype)


class GGUFWeights:
    """Lazy HF-named float32 tensors and an HF-style ``config`` of a llama.cpp LLaMA GGUF file."""

    def __init__(self, path: str):
        try:
            import gguf
        except ImportError:
            raise CheckpointError(
                f"--gguf {path}: reading GGUF files needs the `gguf` package: {_INSTALL}"
            ) from None
        self.path = path
        self.flag = f"--gguf {path}"
        if not os.path.isfile(path):
            raise CheckpointError(f"{self.flag}: no such file")
        try:
            self._reader = gguf.GGUFReader(path)  # memory-mapped: reads no tensor yet
        except (ValueError, OSError) as e:  # not GGUF, a version or type id the reader lacks
            raise CheckpointError(f"{self.flag}: not a GGUF file gguf can read ({e})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = self._hf_config()
        try:  # what the model here does not compute, refused naming the file
            model_config_from_hf(self.config)
        except CheckpointError as e:
            message = f"{self.flag}: {e} (its llama.* metadata in HF's names)"
            raise CheckpointError(message) from None
        self._hf_names = self._name_map()
        self._check_tensors()

    # -- metadata ----------------------------------------------------------------------------

    def _value(self, key: str, default=_REQUIRED):
        field = self._reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.flag}: the metadata lacks {key}")
            return default
        return field.contents()

    def _one(self, key: str, default=_REQUIRED):
        """A per-model value; a per-layer list is accepted when every layer has the same."""
        value = self._value(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise CheckpointError(
                    f"{self.flag}: {key}={value}: only one value for every layer is supported"
                )
            value = value[0]
        return value

    def _hf_config(self) -> dict:
        """``config.json`` of the HF LLaMA this file holds (the keys ``model_config_from_hf``
        reads; settings the model here does not compute are carried over for it to refuse)."""
        arch = self._value("general.architecture")
        if arch != "llama":
            raise CheckpointError(
                f"{self.flag}: general.architecture {arch!r}: only 'llama' is supported"
            )
        experts = self._one("llama.expert_count", 0)
        if experts:
            raise CheckpointError(
                f"{self.flag}: llama.expert_count={experts}: mixture-of-experts layers are not "
                "supported"
            )
        if "token_embd.weight" not in self._tensors:
            raise CheckpointError(f"{self.flag}: no tensor token_embd.weight (the embedding)")
        hidden, heads = self._one("llama.embedding_length"), self._one("llama.attention.head_count")
        config = {
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": self._one("llama.block_count"),
            "hidden_size": hidden,
            "intermediate_size": self._one("llama.feed_forward_length"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._one("llama.attention.head_count_kv", heads),
            "max_position_embeddings": self._one("llama.context_length"),
            "rms_norm_eps": self._one("llama.attention.layer_norm_rms_epsilon"),
            "rope_theta": self._one("llama.rope.freq_base", 10000.0),
            "vocab_size": int(self._tensors["token_embd.weight"].shape[1]),  # ne: [h, V]
            "tie_word_embeddings": "output.weight" not in self._tensors,
        }
        head_dim = hidden // heads
        key_length = self._one("llama.attention.key_length", None)
        if key_length is not None:
            config["head_dim"] = key_length
        rotary = self._one("llama.rope.dimension_count", None)
        if rotary is not None and rotary != head_dim:
            config["partial_rotary_factor"] = rotary / head_dim
        scaling = self._one("llama.rope.scaling.type", "none")
        if "rope_freqs.weight" in self._tensors and scaling == "none":
            config["rope_scaling"] = self._rope_freqs(config["rope_theta"])
            if config["rope_scaling"] is None:
                del config["rope_scaling"]
        elif scaling != "none":
            factor = self._one("llama.rope.scaling.factor", None)
            config["rope_scaling"] = {"rope_type": scaling, "factor": factor}
        elif self._one("llama.rope.scale_linear", 1.0) != 1.0:  # the older spelling
            factor = self._one("llama.rope.scale_linear")
            config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        for name in ("bos", "eos", "padding"):
            token = self._value(f"tokenizer.ggml.{name}_token_id", None)
            if token is not None:
                config["pad_token_id" if name == "padding" else f"{name}_token_id"] = token
        return config

    def _rope_freqs(self, theta: float) -> dict | None:
        """LLaMA-3's RoPE scaling from the ``rope_freqs`` table llama.cpp stores for it."""
        table = self._read("rope_freqs.weight").reshape(-1).double().numpy()
        original = self._one("llama.rope.scaling.original_context_length", None)
        try:
            return llama3_rope_scaling(table, theta, original)
        except ValueError as e:
            raise CheckpointError(f"{self.flag}: tensor rope_freqs.weight: {e}") from None

    # -- tensors -----------------------------------------------------------------------------

    def _name_map(self) -> dict[str, str]:
        """HF name -> GGUF name, for every tensor the model reads."""
        names = {
            "model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight",
        }
        if not self.config["tie_word_embeddings"]:
            names["lm_head.weight"] = "output.weight"
        for i in range(self.config["num_hidden_layers"]):
            for part in _HF_LAYER:
                names[f"model.layers.{i}.{_HF_LAYER[part]}.weight"] = f"blk.{i}.{part}.weight"
        return names

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> its shape as HF's ``[out, in]``."""
        c = self.config
        h, f, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        d = h // c["num_attention_heads"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        layer = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h)}
        layer.update(attn_v=(kv, h), attn_output=(h, q), ffn_gate=(f, h), ffn_up=(f, h))
        layer["ffn_down"] = (h, f)
        shapes = {"token_embd.weight": (V, h), "output_norm.weight": (h,), "output.weight": (V, h)}
        for i in range(c["num_hidden_layers"]):
            shapes.update({f"blk.{i}.{p}.weight": s for p, s in layer.items()})
        return shapes

    def _check_tensors(self) -> None:
        """Refuse, before anything is written: a missing, unexpected or misshapen tensor, and a
        quantisation type ``gguf.quants`` cannot dequantise."""
        wanted = set(self._hf_names.values())
        for name in self._tensors.keys() - wanted - {"rope_freqs.weight"}:  # read in config
            raise CheckpointError(
                f"{self.flag}: tensor {name} (not part of the LLaMA model imported here) is not "
                "supported"
            )
        shapes = self._expected_shapes()
        readable: dict = {}
        for name in sorted(wanted):
            tensor = self._tensors.get(name)
            if tensor is None:
                raise CheckpointError(f"{self.flag}: no tensor {name}")
            shape = tuple(int(n) for n in reversed(tensor.shape))  # ne order -> [out, in]
            if shape != shapes[name]:
                raise CheckpointError(
                    f"{self.flag}: tensor {name} has shape {list(shape)}, the metadata says "
                    f"{list(shapes[name])}"
                )
            kind = tensor.tensor_type
            if kind not in readable:
                readable[kind] = _dequantizable(kind)
            if not readable[kind]:
                raise CheckpointError(
                    f"{self.flag}: tensor {name} has type {kind.name}, which gguf cannot dequantise"
                )

    def get(self, *names: str) -> torch.Tensor:
        """The first of ``names`` (HF names) that the file holds, float32, HF's layout."""
        for name in names:
            if name in self._hf_names:
                return self._read(self._hf_names[name])
        raise CheckpointError(f"{self.flag}: no tensor maps to {names[0]!r}")

    def _read(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(
                f"{self.flag}: tensor {name} ({tensor.tensor_type.name}) cannot be dequantised "
                f"({e})"
            ) from None
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if not array.flags.writeable:  # F32 is a view of the read-only mapping
            array = array.copy()
        weight = torch.from_numpy(array.astype(np.float32, copy=False)).reshape(shape)
        if ".attn_q." in name:
            return unpermute_rows(weight, self.config["num_attention_heads"])
        if ".attn_k." in name:
            return unpermute_rows(weight, self.config["num_key_value_heads"])
        return weight

    # -- tokenizer ---------------------------------------------------------------------------

    def save_tokenizer(self, out_dir: str) -> str | None:
        """The file's tokenizer as an HF tokenizer directory ``out_dir`` (absolute path
        returned); None when the file carries none."""
        if self._value("tokenizer.ggml.model", None) is None:
            return None
        from transformers import AutoTokenizer

        directory, name = os.path.split(os.path.abspath(self.path))
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"{self.flag}: transformers cannot build its tokenizer "
                f"(tokenizer.ggml.model {self._value('tokenizer.ggml.model')!r}: {e})"
            ) from None
        tokenizer.save_pretrained(out_dir)
        return os.path.abspath(out_dir)


def _dequantizable(kind) -> bool:
    """Whether ``gguf.quants`` dequantises ``kind``: tried on one zero block."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    try:
        dequantize(np.zeros((1, size), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True
