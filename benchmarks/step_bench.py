"""Training-step benchmark: fused vs unfused attention, DRO + TempNet vs cross-entropy, the planner.

One step = forward, loss, backward and a fused-AdamW update of the whole model (and TempNet),
through the same objective as pretrain_gpt.py (``TrainModule``) on GPT-2 125M's shapes
(``--num-layers`` may cut the 12 layers on a slow machine), micro-batch 1, float32.

1. Backends, per ``--seq-lengths``: ``--attention-backend auto`` (fused scaled_dot_product_
   attention with megatron-core's bias fusions) against ``unfused`` (megatron-core's
   DotProductAttention, no fusions), both with DRO + TempNet and the same weights and batches, in
   one process, taking turns step by step. Reports the median step time of ``--steps`` steps
   after one warm-up (compilation) step, and every step's loss on both paths.
2. Losses: cross-entropy against DRO + TempNet on the fused path (at the first sequence length),
   taking turns in one process; median and spread (min-max) of ``--steps`` steps.
3. Memory, per backend and sequence length, each in its own process: the peak above the level
   after the warm-up step (weights, gradients and optimizer states, all resident as in
   DeepSpeed), i.e. what a step adds: activations, the output stage's buffers, the attention's
   working set. CPU: VmHWM with glibc returning freed tensors (``common.GLIBC_RETURNS_MEMORY``);
   GPU: the caching allocator's peak. Next to it, the planner's figure for the same step
   (``models/gpt/memory.py``: its total less weights, gradients and optimizer states).

4. ``--sequence-parallel-memory`` (only this): one step's memory at TP 2 (two gloo processes)
   with and without --sequence-parallel, beside the planner's figure (``sp_memory.py``).

    python benchmarks/step_bench.py --json benchmarks/results/step_bench_cpu.json
    python benchmarks/step_bench.py --device cuda --num-layers 12
    python benchmarks/step_bench.py --sequence-parallel-memory --num-layers 4 --seq-lengths 2048
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

import common
import sp_memory

SLOW = dict(
    attention_backend="unfused",
    bias_gelu_fusion=False,
    bias_swiglu_fusion=False,
    bias_dropout_fusion=False,
)
LOSSES = {"ce": dict(loss="ce", tau_source="fixed"), "dro+tempnet": dict(loss="dro")}


def _model_config(args, seq_length: int, backend: str):
    from megatron_tempnet.models.gpt import ModelConfig

    model = ModelConfig.from_preset(
        "gpt2-125m",
        vocab_size=args.vocab_size,
        num_layers=args.num_layers,
        seq_length=seq_length,
        max_position_embeddings=max(seq_length, 1024),
        # no dropout: both backends then compute the same losses (their dropout masks differ),
        # and CPU attention with dropout keeps [b, heads, s, s] whatever the backend
        hidden_dropout=args.hidden_dropout,
        attention_dropout=0.0,
    )
    return _backend(model, backend)


def _backend(model, backend: str):
    import dataclasses

    return dataclasses.replace(model, **(SLOW if backend == "unfused" else {}))


def _setup(device: str):
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_tempnet.compat import apply_cpu_support

    apply_cpu_support()
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    return torch.device(device)


def _trainer(model_cfg, loss: str, device):
    """A ``step(tokens [b, s+1]) -> loss`` closure over a fresh model, TempNet and fused AdamW."""
    import torch

    from megatron_tempnet.models.gpt import build_gpt_model
    from megatron_tempnet.models.gpt.objective import LossConfig, TrainModule
    from megatron_tempnet.tempnet import TempNetLM
    from megatron_tempnet.trainer.config import OptimizerConfig
    from megatron_tempnet.trainer.engine import build_optimizer
    from megatron_tempnet.trainer.task import ParamGroup

    loss_cfg = LossConfig(rho=10.0, **LOSSES[loss])
    lm = build_gpt_model(model_cfg, seed=1234)
    tempnet = None
    if loss_cfg.uses_tempnet:
        vocab = model_cfg.vocab_size
        tempnet = TempNetLM(vocab, padded_vocab_size=model_cfg.padded_vocab_size(1))
    module = TrainModule(lm, tempnet, loss_cfg, model_cfg.vocab_size, freeze_lm=False).to(device)
    group = ParamGroup("all", list(module.parameters()), 1e-4, 1e-5, 0.0, "lm")
    optimizer = build_optimizer([group], OptimizerConfig(adam_beta2=0.95))
    s = model_cfg.seq_length

    def step(tokens) -> float:
        positions = torch.arange(s, device=device)[None].expand(tokens.shape[0], s)
        out = module(tokens[:, :-1], positions, tokens[:, 1:])
        value = out.loss.mean()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # resident, as DeepSpeed's gradient buffers
        return float(value)

    return step, sum(p.numel() for p in module.parameters())


def _batches(args, seq_length: int, device):
    import torch

    gen = torch.Generator().manual_seed(1)
    shape = (1, seq_length + 1)
    return [
        torch.randint(0, args.vocab_size, shape, generator=gen).to(device)
        for _ in range(args.steps + 1)
    ]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _take_turns(steps: dict, batches, device) -> dict:
    """Every case runs every batch, the cases taking turns (the order flips each step)."""
    names = list(steps)
    out = {name: {"losses": [], "times": []} for name in names}
    for i, batch in enumerate(batches):
        for name in names if i % 2 == 0 else names[::-1]:
            _sync(device)
            t0 = time.perf_counter()
            out[name]["losses"].append(steps[name](batch))
            _sync(device)
            out[name]["times"].append(time.perf_counter() - t0)
    for r in out.values():
        timed = r["times"][1:]  # after the warm-up (compilation, first allocations)
        r.update(median_s=statistics.median(timed), min_s=min(timed), max_s=max(timed))
    return out


def run_backends(args, seq_length: int) -> dict:
    device = _setup(args.device)
    steps = {}
    for backend in ("unfused", "fused"):
        steps[backend], params = _trainer(
            _model_config(args, seq_length, backend), "dro+tempnet", device
        )
    return {"params": params, **_take_turns(steps, _batches(args, seq_length, device), device)}


def run_losses(args, seq_length: int) -> dict:
    device = _setup(args.device)
    model = _model_config(args, seq_length, "fused")
    steps = {loss: _trainer(model, loss, device)[0] for loss in LOSSES}
    return _take_turns(steps, _batches(args, seq_length, device), device)


def run_memory(args, seq_length: int, backend: str) -> dict:
    device = _setup(args.device)
    step, _ = _trainer(_model_config(args, seq_length, backend), "dro+tempnet", device)
    warmup, measured = _batches(args, seq_length, device)[:2]
    step(warmup)  # optimizer state and one-off allocations; its gradients are freed
    memory = common.Memory(device)
    memory.start()
    step(measured)
    return {"peak_mb": memory.peak_mb(), "steady_mb": memory.base / 2**20}


def planned_step_mb(args, seq_length: int, backend: str) -> float:
    """The planner's memory for one step above the weights, gradients and optimizer states."""
    from megatron_tempnet.models.gpt.memory import Layout, estimate

    (stage,) = estimate(_model_config(args, seq_length, backend), Layout(), seq_length)
    parts = dict(stage.parts)
    for kept in ("weights", "gradients", "optimizer states"):
        parts.pop(kept)
    return sum(parts.values()) / 2**20


def _child(args, phase: str, env: dict | None = None, **kw) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--phase", phase]
    for key, value in kw.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{phase} {kw} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _report(args, results: dict) -> list[tuple]:
    """Print the tables; return the targets as (description, value, limit, passed)."""
    lengths = args.seq_lengths
    print(
        f"# GPT-2 125M shapes, {args.num_layers} layers, vocabulary {args.vocab_size}, "
        f"micro-batch 1, float32, {args.device}: {common.machine(args.device)}"
    )
    print(f"# median of {args.steps} steps after 1 warm-up step, cases taking turns\n")
    print(f"{'tokens':>6} {'backend':<8} {'step (s)':>9} {'min-max (s)':>13} {'x unfused':>9} "
          f"{'peak MB':>8} {'x unfused':>9} {'planned MB':>10} {'planned/peak':>12}")  # fmt: skip
    targets = []
    for s in lengths:
        b = results["backends"][str(s)]
        mem = {k: results["memory"][f"{s}-{k}"] for k in ("unfused", "fused")}
        for k in ("unfused", "fused"):
            t, m = b[k], mem[k]
            print(
                f"{s:>6} {k:<8} {t['median_s']:>9.3f} {t['min_s']:>6.2f}-{t['max_s']:<6.2f} "
                f"{t['median_s'] / b['unfused']['median_s']:>9.3f} {m['peak_mb']:>8.0f} "
                f"{m['peak_mb'] / mem['unfused']['peak_mb']:>9.3f} {m['planned_mb']:>10.0f} "
                f"{m['planned_mb'] / m['peak_mb']:>12.3f}"
            )
            targets.append(
                (f"planner / measured peak, {k}, {s} tokens", m["planned_mb"] / m["peak_mb"],
                 "0.9-1.1", 0.9 <= m["planned_mb"] / m["peak_mb"] <= 1.1)
            )  # fmt: skip
        ratio = b["fused"]["median_s"] / b["unfused"]["median_s"]
        targets.append((f"fused / unfused step time, {s} tokens", ratio, "<= 0.9", ratio <= 0.9))
        worst = max(
            abs(f - u) / abs(u) for f, u in zip(b["fused"]["losses"], b["unfused"]["losses"])
        )
        targets.append(
            (f"fused vs unfused loss, first {len(b['fused']['losses'])} iterations, {s} tokens, "
             "max relative difference", worst, "<= 1e-5", worst <= 1e-5)
        )  # fmt: skip
        print(f"{'':>6} losses fused   " + " ".join(f"{x:.6f}" for x in b["fused"]["losses"]))
        print(f"{'':>6} losses unfused " + " ".join(f"{x:.6f}" for x in b["unfused"]["losses"]))
    s = max(lengths)
    fused, unfused = (results["memory"][f"{s}-{k}"]["peak_mb"] for k in ("fused", "unfused"))
    ratio = fused / unfused
    targets.append((f"fused / unfused peak memory, {s} tokens", ratio, "<= 0.5", ratio <= 0.5))
    losses = results["losses"]
    ce, dro = losses["ce"], losses["dro+tempnet"]
    print(f"\n# fused backend, {lengths[0]} tokens: cross-entropy vs DRO + TempNet")
    print(f"{'loss':<12} {'step (s)':>9} {'min-max (s)':>13} {'x ce':>6}")
    for name, r in losses.items():
        print(f"{name:<12} {r['median_s']:>9.3f} {r['min_s']:>6.2f}-{r['max_s']:<6.2f} "
              f"{r['median_s'] / ce['median_s']:>6.3f}")  # fmt: skip
    ratio = dro["median_s"] / ce["median_s"]
    targets.append((f"DRO + TempNet / CE step time, fused, {lengths[0]} tokens", ratio, "<= 1.06",
                    ratio <= 1.06))  # fmt: skip
    print("paper anchor (Table 14, GPT-2 + TempNet on GPUs): +5.8% step time\n\ntargets")
    for desc, value, limit, ok in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {desc}: {value:.4g} (target {limit})")
    return targets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--num-layers", type=int, default=12, help="GPT-2 125M has 12")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 1 warm-up)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument(
        "--sequence-parallel-memory",
        action="store_true",
        help="only: a step's memory at TP 2 with and without --sequence-parallel (first "
        "--seq-lengths value)",
    )
    phases = ["backends", "losses", "memory", "sp-memory"]
    p.add_argument("--phase", choices=phases, help=argparse.SUPPRESS)
    p.add_argument("--sequence-parallel", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hidden-dropout", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--seq-length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase == "backends":
        print("RESULT " + json.dumps(run_backends(args, args.seq_length)), flush=True)
        return
    if args.phase == "losses":
        print("RESULT " + json.dumps(run_losses(args, args.seq_length)), flush=True)
        return
    if args.phase == "memory":
        print("RESULT " + json.dumps(run_memory(args, args.seq_length, args.backend)), flush=True)
        return
    if args.phase == "sp-memory":
        sp_memory.child_main(args)
        return
    if args.sequence_parallel_memory:
        results = sp_memory.run(args, os.path.abspath(__file__), sys.argv[1:])
        sp_memory.report(args, results, common.machine(args.device))
        if args.json:
            machine = common.machine(args.device)
            out = {"machine": machine, "args": vars(args), "sequence_parallel_memory": results}
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return
    results = {"backends": {}, "memory": {}}
    memory_env = common.GLIBC_RETURNS_MEMORY if args.device == "cpu" else {}
    for s in args.seq_lengths:
        for backend in ("unfused", "fused"):
            row = _child(args, "memory", memory_env, seq_length=s, backend=backend)
            row["planned_mb"] = planned_step_mb(args, s, backend)
            results["memory"][f"{s}-{backend}"] = row
        results["backends"][str(s)] = _child(args, "backends", seq_length=s)
    results["losses"] = _child(args, "losses", seq_length=args.seq_lengths[0])
    targets = _report(args, results)
    if args.json:
        common.write_json(args.json, args, targets, results=results)


if __name__ == "__main__":
    main()
