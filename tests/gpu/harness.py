"""What the GPU acceptance checks share: the mode, the sizes, the metrics and checkpoints.

On a CUDA machine the checks run at their real sizes (a ~100M-parameter LLaMA at 1024 tokens,
NCCL). ``GPU_CHECK_ON_CPU=1`` runs the very same checks on CPU with gloo and shrunk sizes, so the
harness itself can be smoke-tested where there is no GPU; only the assertions that need CUDA
(which attention kernel ran) are skipped there. The programs are started by ``programs.py``, the
data made by ``data.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ON_CPU_ENV = "GPU_CHECK_ON_CPU"
"""Set to 1: run every check on CPU (gloo, shrunk sizes): the harness's own smoke test."""
REPORT_ENV = "GPU_CHECK_REPORT"
"""A path: the summary table is also written there as markdown (for docs/performance.md)."""
COMPILE_CACHE_ENV = "GPU_CHECK_COMPILE_CACHE"
"""A directory: the programs' TorchInductor and Triton cache, kept between runs (default: a new
one in the run's directory, so every run compiles cold)."""


def on_cpu() -> bool:
    return os.environ.get(ON_CPU_ENV, "").strip() not in ("", "0")


def compile_cache() -> Path | None:
    """``GPU_CHECK_COMPILE_CACHE``'s directory, or None."""
    value = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    return Path(value).expanduser().resolve() if value else None


def skip_reason() -> str | None:
    """Why the checks cannot run here (None: they can)."""
    import torch

    if on_cpu() or torch.cuda.is_available():
        return None
    return (
        "no CUDA device (torch.cuda.is_available() is False); "
        f"{ON_CPU_ENV}=1 smoke-tests the harness on CPU"
    )


def gpu_count() -> int:
    """Devices for the multi-GPU layouts: 2 CPU processes stand in for 2 GPUs on CPU."""
    import torch

    return 2 if on_cpu() else torch.cuda.device_count()


def device_name() -> str:
    import torch

    if on_cpu():
        return f"CPU ({os.cpu_count()} cores)"
    return torch.cuda.get_device_name(0)


@dataclass(frozen=True)
class Sizes:
    """Everything the mode changes: model shapes, batches, iterations, data."""

    vocab: int
    """Words of the tokenizer, special tokens included (the true vocabulary)."""
    documents: int
    words_per_document: int
    attention: dict[str, tuple[int, int, int, int, int]]
    """name: (batch, heads, key/value groups, head dim, sequence), causal."""
    llama: dict
    """pretrain_gpt.py flags of the LLaMA of checks 2, 3 and 5."""
    llama_batch: tuple[int, int]
    """(micro-batch, global batch) in sequences."""
    iters: int
    """Iterations of the timed run (check 2)."""
    resume_iters: int
    """Iterations of the exact-resume pair (check 3), saved half-way: enough to resume inside
    the learning-rate warm-up and go past it; each run's cost is its start-up, not these."""
    warmup: int
    """Logged iterations left out of the timings."""
    ce_drop: float
    """How far the LLaMA's cross-entropy must fall over the timed run (nats)."""
    tempnet: dict
    clip: dict
    clip_iters: int
    gpt: dict
    """The small float32 GPT of the layout check (6)."""
    gpt_batch: tuple[int, int]
    gpt_iters: int
    max_new_tokens: int
    workers: int
    """tools/preprocess_data.py's tokenizer processes (each imports transformers: at 1M tokens
    more of them cost more than they save)."""
    timeout: float = 600
    """Seconds one program may run."""


GPU_SIZES = Sizes(
    vocab=32000,
    documents=1600,
    words_per_document=600,
    attention={
        "GPT-2 (12 heads x 64, seq 1024)": (8, 12, 12, 64, 1024),
        "LLaMA GQA (32 heads / 8 groups x 128, seq 4096)": (1, 32, 8, 128, 4096),
    },
    llama={
        "num-layers": 12,
        "hidden-size": 768,
        "num-attention-heads": 12,
        "num-query-groups": 4,
        "group-query-attention": True,
        "ffn-hidden-size": 2048,
        "seq-length": 1024,
        "max-position-embeddings": 1024,
    },
    llama_batch=(16, 16),
    iters=40,
    resume_iters=8,
    warmup=5,
    ce_drop=1.0,
    tempnet={"tempnet-hidden-size": 256, "tempnet-proj-size": 256, "tempnet-rho": 10},
    clip={
        "embed-dim": 128,
        "vision-hidden-size": 128,
        "vision-layers": 4,
        "vision-heads": 4,
        "text-hidden-size": 128,
        "text-layers": 4,
        "text-heads": 4,
        "tempnet-proj-size": 64,
        "micro-batch-size": 64,
        "global-batch-size": 64,
    },
    clip_iters=40,
    gpt={
        "num-layers": 4,
        "hidden-size": 256,
        "num-attention-heads": 8,
        "seq-length": 256,
        "max-position-embeddings": 256,
    },
    gpt_batch=(4, 16),
    gpt_iters=10,
    max_new_tokens=32,
    workers=2,
)

CPU_SIZES = Sizes(
    vocab=4096,
    documents=160,
    words_per_document=200,
    attention={
        "GPT-2-like (4 heads x 16, seq 64)": (2, 4, 4, 16, 64),
        "LLaMA-like GQA (8 heads / 2 groups x 16, seq 128)": (1, 8, 2, 16, 128),
    },
    llama={
        "num-layers": 2,
        "hidden-size": 64,
        "num-attention-heads": 4,
        "num-query-groups": 2,
        "group-query-attention": True,
        "ffn-hidden-size": 128,
        "seq-length": 64,
        "max-position-embeddings": 64,
    },
    llama_batch=(2, 4),
    iters=12,
    resume_iters=8,
    warmup=2,
    ce_drop=0.1,
    tempnet={"tempnet-hidden-size": 32, "tempnet-proj-size": 32, "tempnet-rho": 4},
    clip={
        "embed-dim": 32,
        "vision-hidden-size": 32,
        "text-hidden-size": 32,
        "tempnet-proj-size": 16,
        "micro-batch-size": 8,
        "global-batch-size": 8,
    },
    clip_iters=10,
    gpt={
        "num-layers": 2,
        "hidden-size": 64,
        "num-attention-heads": 4,
        "seq-length": 32,
        "max-position-embeddings": 32,
    },
    gpt_batch=(2, 8),
    gpt_iters=6,
    max_new_tokens=8,
    workers=1,
)


def sizes() -> Sizes:
    return CPU_SIZES if on_cpu() else GPU_SIZES


def flags(values: dict) -> list[str]:
    """``{"bf16": True, "lr": 1e-3, "load": None}`` -> ``["--bf16", "--lr", "0.001"]``."""
    out = []
    for key, value in values.items():
        if value is True:
            out.append(f"--{key}")
        elif value is not None and value is not False:
            out += [f"--{key}", str(value)]
    return out


def metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_rows(path: Path) -> list[dict]:
    return [r for r in metrics(path) if "loss" in r]


def _link(src: str, dst: str) -> None:
    """A hard link (no copy of gigabytes), or a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_checkpoint(save_dir: Path, iteration: int, to: Path) -> Path:
    """A new --load directory holding only ``save_dir``'s checkpoint of ``iteration`` (named by
    ``latest``), as a run that had stopped there would have left it. The checkpoint's files are
    hard links (loading only reads them, a run saves into a new directory); the config files,
    which a run rewrites, are copies."""
    from megatron_tempnet.checkpoint.checkpoint_format import (
        CONFIG,
        CONFIG_YAML,
        publish_latest,
        tag_for,
    )

    to.mkdir(parents=True)
    tag = tag_for(iteration)
    shutil.copytree(save_dir / tag, to / tag, copy_function=_link)
    for name in (CONFIG, CONFIG_YAML):
        if (save_dir / name).exists():
            shutil.copy2(save_dir / name, to / name)
    publish_latest(str(to), tag)
    return to
