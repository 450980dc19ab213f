"""step_bench.py's --sequence-parallel-memory mode: one training step's memory at TP 2 with and
without --sequence-parallel, beside the planner's figure.

Two gloo processes on the CPU (``--device`` is not used) run the GPT-2 shapes of step_bench
(``--num-layers``, ``--vocab-size``, one ``--seq-lengths`` value), DRO + TempNet through the fused
output stage and AdamW, one warm-up step then the measured one. The memory of a step is the peak of
live tensor bytes during it (torch's ``MemTracker``) less what stays between steps (weights,
gradients, optimizer states): activations, the output stage's buffers, the all-gather buffer. The
planner's figure is its total less the same three parts (``models/gpt/memory.py``); its "norm
regions" are the ``4h`` of every layer (the inputs of the two norms and of the two column-parallel
linears), which sequence parallelism divides by TP. The rows with hidden dropout 0.1 (Megatron-LM's
default) add the dropout state, which the planner does not count, on the same shards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

TP = 2
CASES = [(False, 0.0), (True, 0.0), (False, 0.1), (True, 0.1)]
"""(sequence parallel, hidden dropout) of the table's rows."""


def _model(args, seq_length: int, hidden_dropout: float):
    from megatron_tempnet.models.gpt import ModelConfig

    return ModelConfig.from_preset(
        "gpt2-125m",
        vocab_size=args.vocab_size,
        num_layers=args.num_layers,
        seq_length=seq_length,
        max_position_embeddings=max(seq_length, 1024),
        hidden_dropout=hidden_dropout,
        attention_dropout=0.0,  # CPU attention with dropout keeps [b, heads, s, s]: not this
    )


def measure(args, seq_length: int, sequence_parallel: bool, hidden_dropout: float) -> dict:
    """On every rank of the launch (torch.distributed's environment): the step's memory."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed._tools.mem_tracker import MemTracker

    from megatron_tempnet.compat import apply_cpu_support
    from megatron_tempnet.models.gpt import build_gpt_model
    from megatron_tempnet.models.gpt.objective import LossConfig, TrainModule
    from megatron_tempnet.tempnet import TempNetLM

    apply_cpu_support()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    group = parallel_state.get_tensor_model_parallel_group()
    model = _model(args, seq_length, hidden_dropout)
    lm = build_gpt_model(model, tensor_parallel_size=TP, sequence_parallel=sequence_parallel)
    padded = model.padded_vocab_size(TP)
    tempnet = TempNetLM(model.vocab_size, padded_vocab_size=padded, tp_group=group)
    loss = LossConfig(rho=10.0)
    module = TrainModule(lm, tempnet, loss, model.vocab_size, freeze_lm=False, tp_group=group)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab_size, (1, seq_length + 1), generator=gen)
    positions = torch.arange(seq_length)[None]

    def step() -> None:
        module(tokens[:, :-1], positions, tokens[:, 1:]).loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # resident, as DeepSpeed's gradient buffers

    step()  # optimizer states exist from here on
    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    kept = sum(2 * p.numel() * p.element_size() for p in module.parameters())  # with the grads
    kept += sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    dist.destroy_process_group()
    return {"step_mb": (peak - kept) / 2**20}


def planned(args, seq_length: int, sequence_parallel: bool) -> dict:
    """The planner's step memory (its total less weights, gradients, optimizer states) and its
    norm regions, MiB."""
    from megatron_tempnet.models.gpt.memory import PRECISIONS, Layout, estimate

    model = _model(args, seq_length, 0.0)
    layout = Layout(tensor_parallel=TP, sequence_parallel=sequence_parallel)
    (stage,) = estimate(model, layout, seq_length)
    step = sum(
        v for k, v in stage.parts.items() if k not in ("weights", "gradients", "optimizer states")
    )
    e, h = PRECISIONS[layout.precision], model.hidden_size
    norm = model.num_layers * seq_length * e * 4 * h // (TP if sequence_parallel else 1)
    return {"planned_mb": step / 2**20, "norm_regions_mb": norm / 2**20}


def launch(script: str, argv: list[str], seq_length: int, sp: bool, dropout: float) -> dict:
    """``TP`` processes of ``script --phase sp-memory``; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [
        "--phase",
        "sp-memory",
        "--seq-length",
        str(seq_length),
        "--hidden-dropout",
        str(dropout),
    ] + (["--sequence-parallel"] if sp else [])
    procs = []
    for rank in range(TP):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(TP),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, script, *argv, *flags]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"sp-memory {seq_length} sp={sp} failed:\n{outputs[0][1][-3000:]}")
    lines = [ln for ln in outputs[0][0].splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :])


def run(args, script: str, argv: list[str]) -> dict:
    """Every row of the table (each case in its own launch)."""
    s = args.seq_lengths[0]
    rows = []
    for sp, dropout in CASES:
        row = {"sequence_parallel": sp, "hidden_dropout": dropout}
        row.update(launch(script, argv, s, sp, dropout), **planned(args, s, sp))
        rows.append(row)
    return {"seq_length": s, "rows": rows}


def report(args, results: dict, machine: str) -> None:
    s = results["seq_length"]
    print(
        f"# GPT-2 125M shapes, {args.num_layers} layers, vocabulary {args.vocab_size}, {s} tokens, "
        f"micro-batch 1, float32, TP {TP} (gloo, {machine}); DRO + TempNet, fused output stage"
    )
    print("# step memory: peak live tensors in the step less weights, gradients, AdamW states\n")
    print(
        f"{'SP':<4} {'dropout':>7} {'step MB':>8} {'planned MB':>10} {'planned/step':>12} "
        f"{'norm regions MB (planner)':>26}"
    )
    base = {}
    for r in results["rows"]:
        sp = "on" if r["sequence_parallel"] else "off"
        print(
            f"{sp:<4} {r['hidden_dropout']:>7.1f} {r['step_mb']:>8.1f} {r['planned_mb']:>10.1f} "
            f"{r['planned_mb'] / r['step_mb']:>12.3f} {r['norm_regions_mb']:>26.1f}"
        )
        base.setdefault(r["hidden_dropout"], {})[sp] = r
    print()
    for dropout, pair in base.items():
        saved = pair["off"]["step_mb"] - pair["on"]["step_mb"]
        planned_saving = pair["off"]["planned_mb"] - pair["on"]["planned_mb"]
        print(
            f"hidden dropout {dropout}: --sequence-parallel saves {saved:.1f} MB per rank "
            f"(planner: {planned_saving:.1f} MB: the norm regions / {TP}, less the all-gather "
            "buffer)"
        )


def child_main(args) -> None:
    result = measure(args, args.seq_length, args.sequence_parallel, args.hidden_dropout)
    if os.environ.get("RANK", "0") == "0":
        print("RESULT " + json.dumps(result), flush=True)
