"""The fused output stage's chunk size and its logit passes: time against memory, side by side.

One process, one rank (TP 1): the fused output stage (``fused_output_stage``, float32) with
TempNet (d1 = d2 = 256, the stop-gradient) and the DRO loss, forward + backward as a training
step runs it (the masked-mean upstream gradient given, so nothing is recomputed), for every
chunk budget (logits per chunk: ``--chunk-elements``, as ``output_stage.CHUNK_ELEMENTS`` sets the
default) with the logit passes compiled and eager (``MEGATRON_TEMPNET_COMPILE``, read on every
call). The configurations take turns, one repetition each, so drift hits them alike; the median
of ``--reps`` after ``--warmup``.

Memory: the chunk's logits ``[c, V]`` float32 are the stage's one vocabulary-sized buffer (its
other tensors are ``[T]`` vectors, ``[T, d1]`` and the gradients it must return), so a chunk
budget of E elements costs 4 E bytes above them; printed as computed. On a GPU the caching
allocator's peak above the inputs is printed too.

    python benchmarks/chunk_bench.py                              # SmolLM2's stage, 1024 tokens
    python benchmarks/chunk_bench.py --hidden 768 --vocab 50304 --tokens 2048 --json out.json
    python benchmarks/chunk_bench.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import common
import torch

from megatron_tempnet.losses import TempNetTau, fused_output_stage, logit_passes
from megatron_tempnet.losses.output_stage import CHUNK_ELEMENTS
from megatron_tempnet.tempnet import TempNetLM

BUDGETS = [1 << 21, 1 << 22, 1 << 23, 1 << 24, 1 << 25, 1 << 26]


def _inputs(args, device):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, generator=gen) * (3.0 / args.hidden**0.5)
    weight = weight.to(device).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    tempnet = TempNetLM(args.vocab).to(device)
    return hidden, weight, target, tempnet


def _step(inputs, chunk: int, compiled: bool, device) -> tuple[float, float | None]:
    """One forward + backward: seconds and (GPU) peak MiB above what was held before."""
    hidden, weight, target, tempnet = inputs
    os.environ[logit_passes.ENV] = "1" if compiled else "0"
    for p in [hidden, weight, *tempnet.parameters()]:
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = fused_output_stage(
        hidden, weight, target, loss="dro", rho=10.0, vocab_size=weight.shape[0],
        tau=TempNetTau(tempnet), chunk_size=chunk,
        upstream_mask=torch.ones_like(target, dtype=hidden.dtype),
    )  # fmt: skip
    out.loss.mean().backward()
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return time.perf_counter() - start, peak


def _configs(args):
    modes = [True, False] if logit_passes.compiler_missing(args.device == "cuda") is None else []
    modes = modes or [False]
    return [(budget, compiled) for budget in args.chunk_elements for compiled in modes]


def _table(rows, args) -> str:
    head = f"{'chunk logits':>12} {'tokens':>6} {'MiB':>6} {'passes':>8} {'ms':>9} {'tok/s':>8}"
    head += f" {'x default':>9}" + (" peak MiB" if args.device == "cuda" else "")
    lines = [head, "-" * len(head)]
    default = {r["compiled"]: r["ms"] for r in rows if r["elements"] == CHUNK_ELEMENTS}
    for r in rows:
        ref = default.get(r["compiled"])
        ratio = f"{r['ms'] / ref:9.3f}" if ref else f"{'-':>9}"
        line = (
            f"{r['elements']:>12,} {r['chunk']:>6} {r['buffer_mib']:>6.0f} "
            f"{'compiled' if r['compiled'] else 'eager':>8} {r['ms']:>9.1f} "
            f"{r['tokens_per_s']:>8.0f} {ratio}"
        )
        if args.device == "cuda":
            line += f" {r['peak_mib']:>8.1f}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M's")
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2-135M's")
    p.add_argument("--chunk-elements", type=int, nargs="+", default=BUDGETS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    device = torch.device(args.device)
    inputs = _inputs(args, device)
    configs = _configs(args)
    times = {c: [] for c in configs}
    peaks = {}
    for rep in range(args.warmup + args.reps):
        for budget, compiled in configs:
            chunk = max(1, min(args.tokens, budget // args.vocab))
            seconds, peaks[budget, compiled] = _step(inputs, chunk, compiled, device)
            if rep >= args.warmup:
                times[budget, compiled].append(seconds)
    rows = []
    for budget, compiled in configs:
        chunk = max(1, min(args.tokens, budget // args.vocab))
        ms = statistics.median(times[budget, compiled]) * 1e3
        rows.append(
            dict(
                elements=budget, chunk=chunk, compiled=compiled, ms=ms,
                buffer_mib=chunk * args.vocab * 4 / 2**20,
                tokens_per_s=args.tokens / ms * 1e3, peak_mib=peaks[budget, compiled],
            )
        )  # fmt: skip
    machine = common.machine(device)
    print(f"{machine}\nT = {args.tokens}, h = {args.hidden}, V = {args.vocab}, TempNet + DRO")
    print(_table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
