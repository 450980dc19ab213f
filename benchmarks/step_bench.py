"""Training-step benchmark: cross-entropy vs the DRO loss with TempNet on a GPT-2-shaped model.

One step = forward, loss, backward and an AdamW update of the whole model (and TempNet), the same
code path as pretrain_gpt.py's objective (``TrainModule``). Each case runs in its own process, so
that the peak memory of one does not hide in the other's: on CPU the peak is the process's
resident high-water mark (VmHWM) minus its level before the first step; on GPU it is the caching
allocator's peak above the level before the first step.

    python benchmarks/step_bench.py                                   # CPU defaults
    python benchmarks/step_bench.py --device cuda --seq-length 1024 --micro-batch-size 8
    python benchmarks/step_bench.py --json docs/step_bench_cpu.json

The paper reports +5.8% step time for GPT-2 trained jointly with TempNet (Table 14).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

CASES = {
    "ce": {"loss": "ce", "tau_source": "fixed"},
    "dro+tempnet": {"loss": "dro", "tau_source": "tempnet"},
}


def _proc_status_mb(field: str) -> float:
    """A memory line of /proc/self/status (VmHWM: peak resident, VmRSS: resident now), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_case(args) -> dict:
    """Build, warm up, time; runs inside the per-case subprocess."""
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import ModelConfig, build_gpt_model
    from megatron_tempnet.models.gpt.objective import LossConfig, TrainModule
    from megatron_tempnet.tempnet import TempNetLM

    cuda = args.device == "cuda"
    apply_cpu_support()
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model_cfg = ModelConfig.from_preset(
        args.model, vocab_size=args.vocab_size, seq_length=args.seq_length
    )
    loss_cfg = LossConfig(rho=10.0, **CASES[args.case])
    lm = build_gpt_model(model_cfg)
    tempnet = None
    if loss_cfg.uses_tempnet:
        tempnet = TempNetLM(args.vocab_size, padded_vocab_size=model_cfg.padded_vocab_size(1))
    module = TrainModule(lm, tempnet, loss_cfg, args.vocab_size, freeze_lm=False)
    device = torch.device("cuda" if cuda else "cpu")
    module.to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1)
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, args.vocab_size, (b, s + 1), generator=gen).to(device)
    positions = torch.arange(s, device=device)[None].expand(b, s)

    def step():
        out = module(tokens[:, :-1], positions, tokens[:, 1:])
        out.loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocates optimizer state and gradients once
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _proc_status_mb("VmRSS")
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else _proc_status_mb("VmHWM")) - base
    n_params = sum(p.numel() for p in module.parameters())
    return {
        "case": args.case,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "peak_above_steady_mb": peak,
        "steady_mb": base,
        "params": n_params,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="gpt2-125m")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # child process
    args = p.parse_args()
    if args.case:
        print("RESULT " + json.dumps(run_case(args)), flush=True)
        return
    rows = []
    for case in CASES:
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--case", case]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"case {case} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    ce = rows[0]
    shape = f"{args.micro_batch_size} x {args.seq_length} tokens per step"
    print(
        f"# {args.model}, vocab {args.vocab_size}, {shape}, {args.device}, "
        f"median of {args.steps} steps after 1 warm-up"
    )
    print(f"{'case':<13} {'params':>12} {'step (s)':>9} {'x ce':>6} {'peak MB':>8} {'x ce':>6}")
    for r in rows:
        print(
            f"{r['case']:<13} {r['params']:>12,} {r['median_s']:>9.3f} "
            f"{r['median_s'] / ce['median_s']:>6.3f} {r['peak_above_steady_mb']:>8.0f} "
            f"{r['peak_above_steady_mb'] / ce['peak_above_steady_mb']:>6.3f}"
        )
    print("paper anchor (Table 14, GPT-2 + TempNet): +5.8% step time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
