"""The acceptance run's summary, ready for docs/performance.md.

Per training run: the device, the layout, the step time, the throughput, the model FLOPs
utilisation and the peak memory against the memory planner's estimate for the same
configuration (``models/gpt/memory.py``, what tools/estimate_memory.py prints); per attention
shape: the kernels that ran; per check and per program: its wall time. The checks add their
results here (``TRAINING``, ``ATTENTION``; a check records its row before its assertions, so a
failing check keeps its numbers), programs.py its programs' times (``PROGRAMS``) and conftest.py
each check's (``CHECKS``); conftest.py prints the tables at the end of the session and writes
them as markdown.

Model FLOPs per token are the training log's (--log-throughput): Megatron-LM's count of a GPT,
``models.gpt.flops.flops_per_token`` (6 x the weights in matrix products, TempNet's W1 and W2
included, plus the causal attention's 6 x layers x sequence x heads x head size). The
utilisation of a bf16 run divides the achieved rate by the device's dense bf16 peak
(``PEAK_BF16_TFLOPS``) times the GPUs of the run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from megatron_tempnet.models.gpt.flops import flops_per_token
from megatron_tempnet.tempnet.config import saved_loss_settings

PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 SXM", 989.0),
    ("H100 80GB HBM3", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)
"""Dense bf16 TFLOP/s by device name (the first name contained in the device's), from NVIDIA's
data sheets; other devices have no utilisation ("n/a")."""

MIB = 2**20


def peak_tflops(device: str) -> float | None:
    for name, peak in PEAK_BF16_TFLOPS:
        if name.lower() in device.lower():
            return peak
    return None


@dataclass
class TrainingRun:
    """One row of the training table."""

    name: str
    device: str
    layout: str
    step_ms: float
    throughput: float
    unit: str
    """What ``throughput`` counts per second: tokens (GPT) or samples (CLIP)."""
    mfu: float | None
    memory_mib: float
    estimate_mib: float | None

    def cells(self) -> list[str]:
        ratio = "n/a"
        if self.estimate_mib:
            ratio = f"{self.memory_mib / self.estimate_mib:.2f}"
        return [
            self.name,
            self.device,
            self.layout,
            f"{self.step_ms:.1f}",
            f"{self.throughput:,.0f} {self.unit}/s",
            "n/a" if self.mfu is None else f"{100 * self.mfu:.1f}%",
            f"{self.memory_mib:,.0f}",
            "n/a" if self.estimate_mib is None else f"{self.estimate_mib:,.0f}",
            ratio,
        ]


@dataclass
class ProgramTime:
    """One program of the run (programs.py), started as a user starts it."""

    name: str
    check: str
    """The check (test, and its phase: a fixture's programs run in ``setup``) that started it."""
    seconds: float
    """Wall time from its start to its end."""
    outcome: str
    """ok, exit N, timed out, stopped (another program of its batch failed)."""
    first_iteration: float | None = None
    """Seconds from its start to its first logged training iteration (start-up: imports,
    distributed and DeepSpeed init, model, data, compilation, the first iteration); None: it
    logs none."""

    def cells(self) -> list[str]:
        first = "-" if self.first_iteration is None else f"{self.first_iteration:.1f}"
        return [self.name, self.check, f"{self.seconds:.1f}", first, self.outcome]


@dataclass
class CheckTime:
    """One test's wall time, fixtures (data, shared runs) in ``setup``."""

    name: str
    outcome: str = "passed"
    setup: float = 0.0
    call: float = 0.0
    teardown: float = 0.0

    def cells(self) -> list[str]:
        total = self.setup + self.call + self.teardown
        return [self.name, self.outcome, f"{self.setup:.1f}", f"{self.call:.1f}", f"{total:.1f}"]


TRAINING: list[TrainingRun] = []
ATTENTION: list[list[str]] = []
"""Rows: shape, dtype, forward ops, backward ops, CUDA kernels."""
PROGRAMS: list[ProgramTime] = []
CHECKS: dict[str, CheckTime] = {}
"""By test name, in the order they ran."""


def check_phase(name: str, when: str, seconds: float, outcome: str) -> None:
    """Add one phase (setup, call, teardown) of test ``name`` to its time; its outcome is the
    worst of its phases' (pytest's: passed, failed, skipped; a failed setup is an error)."""
    check = CHECKS.setdefault(name, CheckTime(name))
    setattr(check, when, getattr(check, when) + seconds)
    if outcome == "failed":
        check.outcome = "error" if when == "setup" else "failed"
    elif outcome == "skipped" and check.outcome == "passed":
        check.outcome = "skipped"


def _timing(rows: list[dict], warmup: int, per_iteration: float, unit: str):
    """(ms per iteration, units per second): medians over the logged iterations after
    ``warmup`` (a median leaves out the iterations slowed by a validation or a save)."""
    steady = [r[f"{unit}_per_sec"] for r in rows if r["iteration"] > warmup]
    if not steady:
        raise ValueError(f"no logged iteration after the {warmup} warm-up iterations")
    rate = statistics.median(steady)
    return 1000.0 * per_iteration / rate, rate


def _layout(config: dict, world_size: int, batch: str) -> str:
    p, t = config["parallel"], config["training"]
    tp, pp = p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"]
    precision = "bf16" if t["bf16"] else "fp16" if t["fp16"] else "fp32"
    return (
        f"TP {tp} x PP {pp} x DP {world_size // (tp * pp)}, ZeRO-{p['zero_stage']}, {precision}, "
        f"{batch}"
    )


def _batch_layout(config: dict, world_size: int) -> dict:
    """The planner layout's parallel sizes, batch and precision from a run's saved config."""
    t, p = config["training"], config["parallel"]
    tp, pp = p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"]
    return {
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "data_parallel": world_size // (tp * pp),
        "zero_stage": p["zero_stage"],
        "micro_batch_size": t["micro_batch_size"],
        "global_batch_size": t["global_batch_size"]
        or t["micro_batch_size"] * world_size // (tp * pp),
        "precision": "bf16" if t["bf16"] else "fp16" if t["fp16"] else "fp32",
    }


def gpt_run(
    name: str, config: dict, rows: list[dict], world_size: int, warmup: int, device: str
) -> TrainingRun:
    """A pretrain_gpt.py run's row from its saved config (``SAVE/config.json``) and metrics."""
    from megatron_tempnet.models.gpt.config import ModelConfig
    from megatron_tempnet.models.gpt.memory import Layout, estimate

    model = ModelConfig(**config["model"])
    t, loss = config["training"], saved_loss_settings(config["loss"])
    tempnet = loss["tau_source"] == "tempnet"
    batch = _batch_layout(config, world_size)
    gbs = batch["global_batch_size"]
    layout = Layout(
        **batch,
        freeze_lm=t["freeze_lm"],
        recompute_granularity=t["recompute_granularity"],
        recompute_method=t["recompute_method"],
        recompute_num_layers=t["recompute_num_layers"],
        tempnet=tempnet,
        tempnet_hidden_size=loss["tempnet_hidden_size"],
        tempnet_proj_size=loss["tempnet_proj_size"],
        fused_output_stage=loss["fused_output_stage"],
        output_stage_chunk_size=loss["output_stage_chunk_size"],
    )
    # the metrics file is rank 0's: the first pipeline stage's memory
    planned = estimate(model, layout)[0].total / MIB
    step_ms, rate = _timing(rows, warmup, gbs * model.seq_length, "tokens")
    shape = (loss["tempnet_hidden_size"], loss["tempnet_proj_size"]) if tempnet else None
    peak = peak_tflops(device)
    mfu = None
    if peak is not None and t["bf16"]:  # against the bf16 peak: bf16 runs only
        tp = config["parallel"]["tensor_model_parallel_size"]
        flops = flops_per_token(model, shape, tp, frozen_lm=t["freeze_lm"])
        mfu = flops * rate / (world_size * peak * 1e12)
    batch = f"{gbs} x {model.seq_length} tokens/iteration"
    return TrainingRun(
        name,
        device,
        _layout(config, world_size, batch),
        step_ms,
        rate,
        "tokens",
        mfu,
        max(r["memory_mb"] for r in rows),
        planned,
    )


def clip_run(
    name: str,
    config: dict,
    rows: list[dict],
    world_size: int,
    warmup: int,
    device: str,
    num_samples: int,
) -> TrainingRun:
    """A pretrain_clip.py run's row (no utilisation: the FLOP count above is the LM's)."""
    from megatron_tempnet.models.clip import memory as clip_memory
    from megatron_tempnet.models.clip.config import CLIPModelConfig

    batch = _batch_layout(config, world_size)
    gbs = batch["global_batch_size"]
    layout = clip_memory.CLIPLayout(
        **batch,
        clip_loss=config["loss"]["clip_loss"],
        num_samples=num_samples,
        tempnet_proj_size=config["loss"]["tempnet"]["tempnet_proj_size"],
    )
    planned = clip_memory.estimate(CLIPModelConfig(**config["model"]), layout)[0].total / MIB
    step_ms, rate = _timing(rows, warmup, gbs, "samples")
    return TrainingRun(
        name,
        device,
        _layout(config, world_size, f"{gbs} pairs/iteration"),
        step_ms,
        rate,
        "samples",
        None,
        max(r["memory_mb"] for r in rows),
        planned,
    )


TRAINING_HEADER = [
    "run",
    "device",
    "layout",
    "ms/iteration",
    "throughput",
    "MFU",
    "peak MiB (rank 0)",
    "planner MiB",
    "peak / planner",
]
ATTENTION_HEADER = ["shape", "dtype", "forward", "backward", "CUDA kernels"]
CHECK_HEADER = ["check", "result", "setup s", "call s", "wall s"]
PROGRAM_HEADER = ["program", "started by", "wall s", "to 1st iteration s", "result"]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _times() -> list[str]:
    """The checks' and the programs' wall times, with the session's total."""
    checks = list(CHECKS.values())
    total = sum(c.setup + c.call + c.teardown for c in checks)
    rows = [c.cells() for c in checks] + [["total", "", "", "", f"{total:.1f}"]]
    parts = [table(CHECK_HEADER, rows)]
    if PROGRAMS:
        parts.append(table(PROGRAM_HEADER, [p.cells() for p in PROGRAMS]))
    parts.append(
        "Wall times in seconds; a check's setup holds the fixtures it is the first to use (the "
        "data, check 2's run, check 6's runs). Programs: every one a fresh process; to 1st "
        "iteration: start-up, data, compilation and the first iteration, from its log."
    )
    return parts


def markdown() -> str:
    """The tables (the empty ones left out), or '' when no check ran (all skipped)."""
    ran = any(c.outcome != "skipped" for c in CHECKS.values())
    parts = []
    if TRAINING:
        parts.append(table(TRAINING_HEADER, [run.cells() for run in TRAINING]))
        parts.append(
            "Timings: medians over the logged iterations after the warm-up. MFU: model FLOPs "
            "(6 x matrix-product parameters, output layer and TempNet included, + 12 x layers x "
            "seq x hidden per token) / (GPUs x dense bf16 peak), for bf16 runs on known devices. "
            "Peak memory: rank 0's `torch.cuda.max_memory_allocated` (on CPU: the resident "
            "high-water mark); planner: models/gpt/memory.py (tools/estimate_memory.py) for "
            "rank 0's pipeline stage."
        )
    if ATTENTION:
        parts.append(table(ATTENTION_HEADER, ATTENTION))
    if ran or PROGRAMS:
        parts += _times()
    return "\n\n".join(parts)


def finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
