"""Output-stage benchmark: time and peak memory per rank of the loss paths, on identical shapes.

Cases (T tokens, hidden h, vocabulary shard V/tp; "+gemm" includes the output layer GEMM):

  a  megatron-core vocab_parallel_cross_entropy
  b  vocab_parallel_dro_loss (in place, learnable tau tensor)
  c  TempNetLM + vocab_parallel_dro_loss
  d  all-gather the full logits, then a dense TempNet and the dense DRO loss (the research code's
     approach, reimplemented minimally)

On CPU the ranks run twice: a timing run (with jemalloc when installed, which reuses freed memory
as a GPU's caching allocator does, instead of page-faulting every fresh tensor) and a memory run
(glibc returning every large tensor to the OS, so that RSS follows live memory).

Each case runs with and without the GEMM; the cases take turns, one repetition each, so drift
of the machine hits them alike. Time: median forward+backward over --reps after --warmup, the
slowest rank. Peak: the rank's peak memory above what it held before the step, with the last
step's gradients freed, so it counts the logits, the loss buffers and the new gradients
(CPU: VmHWM of /proc/self/status, reset through /proc/self/clear_refs; GPU: the caching
allocator's peak), the largest rank. TP ranks on one CPU share its cores: with more ranks than
cores, times are not comparable to a real run (memory still is).

    python benchmarks/loss_bench.py                     # CPU, small default shapes
    python benchmarks/loss_bench.py --tokens 2048 --hidden 768 4096 --tp 1 4 --json out.json
    python benchmarks/loss_bench.py --device cuda       # one GPU per TP rank

Section "stage" (``--section stage``, ``make bench-stage``): the whole output stage, unfused
against the fused one (benchmarks/stage_cases.py), at the ``--stage-shapes`` given as
hidden:padded vocabulary:TP.

    python benchmarks/loss_bench.py --section stage --tokens 8192 --json stage.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import common
import stage_cases
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from torch import nn

from megatron_tempnet.compat import apply_cpu_support
from megatron_tempnet.losses import dro_loss, vocab_parallel_dro_loss
from megatron_tempnet.tempnet import TempNetLM

CASES = ["a", "b", "c", "d"]
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
NAMES = {
    "a": "megatron-core CE",
    "b": "DRO loss",
    "c": "TempNet + DRO",
    "d": "all-gather + dense TempNet + DRO",
}


class DenseTempNet(nn.Module):
    """The research code's TempNet on gathered full logits: plain dense layers, no TP."""

    def __init__(self, vocab_size, d1=256, d2=256, tau_min=1e-3, tau_max=2.0):
        super().__init__()
        self.vocab_size, self.tau_min, self.tau_max = vocab_size, tau_min, tau_max
        self.transform = nn.Linear(vocab_size, d1)
        self.project = nn.Linear(d1, d2, bias=False)
        self.w3 = nn.Parameter(torch.ones(d2))
        self.b = nn.Parameter(torch.zeros(()))
        self.log_phi = nn.Parameter(torch.zeros(()))

    def forward(self, logits):
        x = logits[..., : self.vocab_size]
        x = x / x.norm(dim=-1, keepdim=True)
        u = self.project(torch.sigmoid(self.transform(x)))
        att = torch.softmax(u / self.log_phi.exp(), -1) - 1.0 / u.shape[-1]
        s = (att * self.w3 * u).sum(-1) - self.b
        return (self.tau_max - self.tau_min) * torch.sigmoid(s) + self.tau_min


def _setup(device, tokens, hidden, vocab, tp, rank):
    gen = torch.Generator().manual_seed(0)
    shard = vocab // tp
    h = torch.randn(tokens, hidden, generator=gen).to(device).requires_grad_()
    w_full = torch.randn(vocab, hidden, generator=gen) * (3.0 / hidden**0.5)
    w = w_full[rank * shard : (rank + 1) * shard].contiguous().to(device).requires_grad_()
    target = torch.randint(0, vocab, (tokens, 1), generator=gen).to(device)
    tau = (0.5 + torch.rand(tokens, 1, generator=gen)).to(device).requires_grad_()
    group = parallel_state.get_tensor_model_parallel_group()
    tempnet = TempNetLM(vocab, tp_group=group).to(device)
    dense_tempnet = DenseTempNet(vocab).to(device)
    base_logits = (torch.randn(tokens, 1, shard, generator=gen) * 3).to(device)
    params = [h, w, tau, *tempnet.parameters(), *dense_tempnet.parameters()]

    def gemm():
        return F.linear(copy_to_tensor_model_parallel_region(h), w).view(tokens, 1, shard)

    def loss_fn(case, logits):
        if case == "a":
            return vocab_parallel_cross_entropy(logits, target).mean()
        if case == "b":
            return vocab_parallel_dro_loss(
                logits, target, tau, rho=10.0, vocab_size=vocab, tp_group=group, inplace=True
            ).mean()
        if case == "c":
            t = tempnet(logits)
            return vocab_parallel_dro_loss(
                logits, target, t, rho=10.0, vocab_size=vocab, tp_group=group
            ).mean()
        full = gather_from_tensor_model_parallel_region(logits)
        t = dense_tempnet(full.detach())
        return dro_loss(full, target, t, rho=10.0, vocab_size=vocab).mean()

    def make_step(case, with_gemm):
        def reset():  # last step's gradients are not part of this step's memory
            for p in params:
                p.grad = None

        def inputs():
            return None if with_gemm else base_logits.clone().requires_grad_()

        def step(logits):
            if with_gemm:
                loss_fn(case, gemm()).backward()
            else:  # the gradient is returned, not accumulated into a .grad copy
                torch.autograd.grad(loss_fn(case, logits), [logits])

        return reset, inputs, step

    return make_step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure_once(reset, inputs, step, memory, device):
    """One forward+backward: (seconds, peak MB above what the rank held before it)."""
    reset()
    dist.barrier()
    memory.start()
    x = inputs()
    _sync(device)
    t0 = time.perf_counter()
    step(x)
    _sync(device)
    elapsed = time.perf_counter() - t0
    peak = memory.peak_mb()
    del x
    return elapsed, peak


def _measure_cases(steps, device, reps, warmup):
    """Round-robin over the cases, so that drift of the machine hits every case alike."""
    memory = common.Memory(device)
    times = {case: [] for case in steps}
    peaks = {case: [] for case in steps}
    for i in range(warmup + reps):
        for case, (reset, inputs, step) in steps.items():
            elapsed, peak = _measure_once(reset, inputs, step, memory, device)
            if i >= warmup:
                times[case].append(elapsed)
                peaks[case].append(peak)
    return {case: (statistics.median(times[case]) * 1e3, max(peaks[case])) for case in steps}


def _rank_main(rank, tp, port, args, mode, out_queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=tp)
    apply_cpu_support()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    oversubscribed = not cuda and tp > (os.cpu_count() or 1)
    reps, warmup = (1, 1) if mode == "memory" else (args.reps, args.warmup)
    rows = []
    for hidden, vocab, steps in _step_sets(args, device, tp, rank):
        measured = _measure_cases(steps, device, reps, warmup)
        for key, (ms, mb) in measured.items():
            t = torch.tensor([ms, mb], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            case, gemm = key if isinstance(key, tuple) else (key, True)
            rows.append(
                dict(
                    tp=tp,
                    hidden=hidden,
                    vocab=vocab,
                    shard=vocab // tp,
                    gemm=gemm,
                    case=case,
                    time_ms=float(t[0]),
                    peak_mb=float(t[1]),
                    oversubscribed=oversubscribed,
                )
            )
    if rank == 0:
        out_queue.put(rows)
    dist.destroy_process_group()


def _step_sets(args, device, tp, rank):
    """(hidden, vocabulary, {case: step}) per shape this TP size runs."""
    if args.section == "stage":
        for hidden, vocab, shape_tp in _stage_shapes(args):
            if shape_tp == tp:
                make_step = stage_cases.setup_stage(device, args.tokens, hidden, vocab, tp, rank)
                yield hidden, vocab, {case: make_step(case) for case in stage_cases.STAGE_CASES}
        return
    for hidden in args.hidden:
        make_step = _setup(device, args.tokens, hidden, args.vocab, tp, rank)
        for with_gemm in (True, False):
            yield hidden, args.vocab, {(c, with_gemm): make_step(c, with_gemm) for c in args.cases}


def _stage_shapes(args) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in shape.split(":")) for shape in args.stage_shapes]


def _allocator_env(allocator: str) -> dict:
    if allocator == "glibc":
        return {}
    return {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}


def _spawn(tp, args, mode, env):
    """Run the ranks with ``env`` added to their environment; return rank 0's rows."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        out_queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(
            _rank_main,
            args=(tp, _free_port(), args, mode, out_queue),
            nprocs=tp,
            start_method="spawn",
        )
        return out_queue.get()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_ratios(rows):
    base = {(r["tp"], r["hidden"], r["gemm"]): r for r in rows if r["case"] == "a"}
    for r in rows:
        a = base.get((r["tp"], r["hidden"], r["gemm"]))
        timed = a and r["time_ms"] is not None and a["time_ms"] is not None
        r["time_vs_a"] = r["time_ms"] / a["time_ms"] if timed else None
        r["peak_vs_a"] = r["peak_mb"] / a["peak_mb"] if a and a["peak_mb"] > 0 else None
    return rows


def _print_header(args, machine, what: str, column: str, base: str) -> None:
    pages = "" if args.device == "cuda" else f", CPU allocator for timing: {args.allocator}"
    print(f"# {machine}; T = {args.tokens} tokens, {what}, reps = {args.reps}{pages}")
    header = (
        f"{'tp':>2} {'h':>5} {column:>6}  {'case':<36} {'ms':>9} {'x ' + base:>6} "
        f"{'peak MB':>9} {'x ' + base:>6}"
    )
    print(header)
    print("-" * len(header))


def _print_stage_table(rows, args, machine):
    _print_header(args, machine, "float32", "V/tp", "u")
    base = {(r["tp"], r["hidden"]): r for r in rows if r["case"] == "u"}
    for r in rows:
        u = base[(r["tp"], r["hidden"])]
        ms = "-" if r["time_ms"] is None else f"{r['time_ms']:.0f}"
        tv = "-" if r["time_ms"] is None else f"{r['time_ms'] / u['time_ms']:.3f}"
        label = f"{r['case']}  {stage_cases.STAGE_NAMES[r['case']]}"
        print(
            f"{r['tp']:>2} {r['hidden']:>5} {r['shard']:>6}  {label:<36} {ms:>9} {tv:>6} "
            f"{r['peak_mb']:>9.1f} {r['peak_mb'] / u['peak_mb']:>6.3f}"
        )


def _print_table(rows, args, machine):
    _print_header(args, machine, f"V = {args.vocab}", "gemm", "a")
    for r in rows:
        tv = f"{r['time_vs_a']:.3f}" if r["time_vs_a"] else "-"
        pv = f"{r['peak_vs_a']:.3f}" if r["peak_vs_a"] else "-"
        label = f"{r['case']}  {NAMES[r['case']]}"
        ms = "-" if r["time_ms"] is None else f"{r['time_ms']:.1f}"
        print(
            f"{r['tp']:>2} {r['hidden']:>5} {'yes' if r['gemm'] else 'no':>6}  {label:<36} "
            f"{ms:>9} {tv:>6} {r['peak_mb']:>9.1f} {pv:>6}"
        )


def _targets(rows):
    """The targets of the foundation issue, as (description, value, limit, passed)."""
    idx = {(r["tp"], r["hidden"], r["gemm"], r["case"]): r for r in rows}
    checks = []
    for (tp, h, gemm, case), r in sorted(idx.items()):
        timed = not r["oversubscribed"]  # more ranks than cores: no valid time
        if case == "b" and not gemm:
            if timed:
                checks.append((f"tp={tp} h={h}: DRO alone / CE alone, time", r["time_vs_a"], 1.3))
            checks.append((f"tp={tp} h={h}: DRO alone / CE alone, peak", r["peak_vs_a"], 1.05))
        if case == "b" and gemm and timed:
            checks.append((f"tp={tp} h={h}: (b)/(a) time", r["time_vs_a"], 1.05))
        if case == "c" and gemm and timed:
            limit = 1.3 if h <= 768 else 1.06
            checks.append((f"tp={tp} h={h}: (c)/(a) time", r["time_vs_a"], limit))
        if case == "d" and tp == 4 and (tp, h, gemm, "c") in idx:
            ours = idx[(tp, h, gemm, "c")]["peak_mb"]
            label = "with GEMM" if gemm else "loss alone"
            checks.append(
                (f"tp=4 h={h}: (d) peak / (c) peak, {label} (>= 4)", r["peak_mb"] / ours, -4.0)
            )
    return [
        (d, v, abs(lim), v <= lim if lim > 0 else v >= -lim)
        for d, v, lim in checks
        if v is not None
    ]


def main():
    args = _parse_args()
    rows = []
    for tp in args.tp:
        rows.extend(_measure(tp, args))
    machine = common.machine(args.device)
    if args.section == "stage":
        _print_stage_table(rows, args, machine)
        checks = stage_cases.stage_targets(rows)
    else:
        rows = _with_ratios(rows)
        _print_table(rows, args, machine)
        checks = _targets(rows)
    if any(r["oversubscribed"] for r in rows):
        print("-: more TP ranks than CPU cores, so no time is measured (memory is)")
    if checks:
        print("\ntargets")
        for desc, value, limit, ok in checks:
            print(f"  {'PASS' if ok else 'MISS'}  {desc}: {value:.3f} (limit {limit})")
    if args.json:
        targets = [dict(check=d, value=v, limit=lim, passed=ok) for d, v, lim, ok in checks]
        with open(args.json, "w") as f:
            json.dump(
                {"machine": machine, "args": vars(args), "rows": rows, "targets": targets},
                f,
                indent=2,
            )


def _measure(tp: int, args) -> list[dict]:
    """The rows of one TP size: time and peak memory, each in processes of their own."""
    if args.device == "cuda":
        return _spawn(tp, args, "both", {})
    # glibc returning every tensor of 1 MiB or more to the OS: RSS follows live memory.
    memory = _spawn(tp, args, "memory", common.GLIBC_RETURNS_MEMORY)
    if tp > (os.cpu_count() or 1):  # ranks would share cores: no meaningful time
        for row in memory:
            row["time_ms"] = None
        return memory
    timed = _spawn(tp, args, "time", _allocator_env(args.allocator))
    for row, mem in zip(timed, memory):
        row["peak_mb"] = mem["peak_mb"]
    return timed


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="T = sequence x micro-batch")
    parser.add_argument("--hidden", type=int, nargs="+", default=[768], help="hidden sizes h")
    parser.add_argument("--vocab", type=int, default=50304, help="padded vocabulary V")
    parser.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes")
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument(
        "--section",
        choices=["cases", "stage"],
        default="cases",
        help="cases: the loss paths a-d; stage: the whole output stage, unfused vs fused",
    )
    parser.add_argument(
        "--stage-shapes",
        nargs="+",
        default=stage_cases.STAGE_SHAPES,
        metavar="H:V:TP",
        help="section stage: hidden size, padded vocabulary and TP size of each shape",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--allocator",
        choices=["jemalloc", "glibc"],
        default="jemalloc" if os.path.exists(JEMALLOC) else "glibc",
        help="CPU timing runs: jemalloc keeps freed memory for reuse, as a GPU's caching "
        "allocator does (Debian: apt-get install libjemalloc2); glibc maps and page-faults "
        "every large tensor afresh",
    )
    args = parser.parse_args()
    for tp in args.tp if args.section == "cases" else ():
        if args.vocab % tp:
            parser.error(f"--vocab ({args.vocab}) must be divisible by every --tp ({tp})")
    if args.device == "cuda" and max(args.tp) > torch.cuda.device_count():
        parser.error(
            f"--tp {max(args.tp)} needs that many GPUs; {torch.cuda.device_count()} visible"
        )
    if args.section == "stage":
        args.tp = sorted({tp for _, _, tp in _stage_shapes(args)})
    return args


if __name__ == "__main__":
    main()
