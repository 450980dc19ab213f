"""Checkpoint benchmark: what a save and a load cost, per rank, on two gloo processes.

A GPT (GPT-2 style, ``--hidden``/``--layers``/``--vocab``, DRO + TempNet) is trained one step so
AdamW's state exists, then saved (synchronously, then again with --async-save), loaded into a
fresh engine at the same layout, and loaded into a fresh engine at the other layout. Cases
(``--cases``):

    dp2-fp32  DP 2 / ZeRO 1, float32 weights    (other layout: TP 2)
    dp2-bf16  DP 2 / ZeRO 1, bf16 weights, float32 masters
    tp2-fp32  TP 2, DP 1 (ZeRO 1), float32 weights    (other layout: DP 2)
    tp2-bf16  TP 2, DP 1 (ZeRO 1), bf16 weights, float32 masters

Per rank: the bytes it writes (``wchar`` of /proc/self/io) and reads (``rchar``: mmap'ed reads
do not show there; the checkpointer counts the bytes it copies out of the files and the bytes
it reads to check digests), the host memory a save or load adds (VmHWM after it less VmRSS
before it, with VmHWM reset first; glibc returns freed tensors, ``common.GLIBC_RETURNS_MEMORY``)
and the wall time between barriers; with --async-save, the time training is blocked and the host
buffer its copies live in against the bytes of the rank's boxes (target <= 1.05x). The loss
of a fixed batch after the step and after every load shows that the load restored the trained
weights. Each phase runs in its own launch (fresh processes); the checkpoint lives in a
temporary directory under ``--tmp``, deleted after each case.

Only ``save`` and ``load`` know the checkpoint format; the rest measures any format (the
numbers of the earlier format, DeepSpeed's files with ``portable/``, are in
docs/performance.md, measured with this harness).

    python benchmarks/checkpoint_bench.py
    python benchmarks/checkpoint_bench.py --cases dp2-fp32 --hidden 1024 --layers 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import common

CASES = {  # name: (layout, bf16)
    "dp2-fp32": ("dp2", False),
    "dp2-bf16": ("dp2", True),
    "tp2-fp32": ("tp2", False),
    "tp2-bf16": ("tp2", True),
}
LAYOUTS = {"dp2": (1, 2), "tp2": (2, 1)}  # name: (TP, DP); 2 processes either way
OTHER = {"dp2": "tp2", "tp2": "dp2"}
WORLD = 2
IO_NOTE = (
    "# /proc/self/io: wchar and rchar count every write()/read() call, the gloo collectives' "
    "socket traffic included; mmap'ed reads (torch.load(mmap=True)) are not in rchar; "
    "write_bytes/read_bytes count what reached storage (read_bytes ~0: page cache)"
)
GLOBAL_BATCH = 2
ITERATION = 1
HOST_TARGET = 1.05  # --async-save's host buffer / the bytes of the rank's boxes


@dataclass
class Built:
    """The benchmark's model: the task's ``TrainModel`` and the run config that built it."""

    train: object  # trainer.task.TrainModel
    config: object  # models.gpt.config.GPTRunConfig
    tp: int
    dp: int


# ---- the checkpoint format: the only two functions that know it ----------------------------


def _checkpointer(engine, model: Built, directory: str, async_save: bool = False):
    from megatron_tempnet.checkpoint.checkpointer import Checkpointer

    ckpt = model.config.checkpoint
    ckpt.save, ckpt.load, ckpt.async_save = directory, directory, async_save
    return Checkpointer(engine, model.train, model.config)


def save(
    engine, model: Built, directory: str, iteration: int, async_save=False, checkpointer=None
) -> dict:
    """Save the training state under ``directory`` (collective); returns {part: (s, wchar)}.
    ``async_save``: the part that blocks training and the background write are timed apart."""
    from megatron_tempnet.checkpoint import checkpoint_writer
    from megatron_tempnet.checkpoint.checkpointer import Checkpointer

    checkpointer = checkpointer or _checkpointer(engine, model, directory, async_save)
    client = {"data": None, "config": json.loads(model.config.to_json())}
    parts = [
        (Checkpointer, "save", "save() (blocks training)"),
        (Checkpointer, "wait", "wait() for the background write"),
        (checkpoint_writer, "snapshot", "host copy (--async-save)"),
        (checkpoint_writer, "_write_own_files", "this rank's files, digested as written"),
        (checkpoint_writer, "_publish", "exchange + COMPLETE + latest"),
    ]
    with timed_parts(parts) as record:
        checkpointer.save(iteration, client)
        checkpointer.wait()
    return record


def load(engine, model: Built, directory: str) -> tuple[int, dict]:
    """Load the newest checkpoint under ``directory`` (collective); returns (iteration, parts),
    with the bytes this rank read, checked and holds in ``parts["bytes"]``."""
    from megatron_tempnet.checkpoint import loader

    checkpointer = _checkpointer(engine, model, directory)
    parts = [
        (loader.CheckpointLoader, "_checked_plan", "plan + sizes + digests of what it reads"),
        (loader, "_read", "read its boxes"),
    ]
    with timed_parts(parts) as record:
        client = checkpointer.resume()
    record["bytes"] = {
        "read": checkpointer.bytes_read,
        "checked": checkpointer.bytes_checked,
        "held": checkpointer.bytes_held,
    }
    return int(client["iteration"]), record


# ---- measurement (any format) ---------------------------------------------------------------


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} missing from /proc/self/status")


@contextlib.contextmanager
def timed_parts(targets):
    """Wrap ``owner.attr`` for each (owner, attr, label): {label: [seconds, wchar, rchar]}."""
    record: dict[str, list] = {}
    saved = []
    for owner, attr, label in targets:
        original = getattr(owner, attr)

        def wrapper(*a, _fn=original, _label=label, **k):
            t0, io0 = time.perf_counter(), proc_io()
            try:
                return _fn(*a, **k)
            finally:
                io1, row = proc_io(), record.setdefault(_label, [0.0, 0, 0])
                row[0] += time.perf_counter() - t0
                row[1] += io1["wchar"] - io0["wchar"]
                row[2] += io1["rchar"] - io0["rchar"]

        setattr(owner, attr, wrapper)
        saved.append((owner, attr, original))
    try:
        yield record
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def measured(fn):
    """Run ``fn()`` between barriers: (its result, this rank's time, I/O and added peak RSS)."""
    import torch.distributed as dist

    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    rss0, io0 = status_kb("VmRSS") * 1024, proc_io()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    seconds = time.perf_counter() - t0
    io1 = proc_io()
    row = {k: io1[k] - io0[k] for k in ("wchar", "rchar", "read_bytes", "write_bytes")}
    return out, dict(row, seconds=seconds, peak_added=status_kb("VmHWM") * 1024 - rss0)


def build(args, layout: str, bf16: bool):
    """The GPT task's model and DeepSpeed engine at ``layout``, on this launch's ranks."""
    from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args
    from megatron_tempnet.models.gpt.task import GPTTask
    from megatron_tempnet.trainer.engine import build_engine, init_process_groups
    from megatron_tempnet.trainer.task import TaskData

    tp, dp = LAYOUTS[layout]
    argv = ["--model", "gpt2-125m", "--num-layers", args.layers, "--hidden-size", args.hidden,
            "--num-attention-heads", args.heads, "--ffn-hidden-size", 4 * args.hidden,
            "--seq-length", args.seq, "--max-position-embeddings", args.seq,
            "--vocab-size", args.vocab, "--tokenizer-type", "NullTokenizer", "--mock-data",
            "--train-iters", 1, "--lr", "1e-4", "--global-batch-size", GLOBAL_BATCH,
            "--micro-batch-size", GLOBAL_BATCH // dp, "--tensor-model-parallel-size", tp,
            "--zero-stage", 1] + (["--bf16"] if bf16 else [])  # fmt: skip
    config = config_from_args(build_parser().parse_args([str(a) for a in argv]))
    task = GPTTask()
    task.prepare(config, WORLD)
    init_process_groups(config)
    train = task.build_model(config, TaskData(train=None))
    engine, _ = build_engine(train, config, WORLD)
    return engine, Built(train, config, tp, dp)


def trained_counts(engine, model: Built) -> tuple[int, int]:
    """(the model's trained parameters, this rank's): full shapes from the TP shards."""
    import math

    from megatron_tempnet.distributed.sharding import full_shape, tensor_kind

    m = model.config.model
    whole = local = 0
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            kind = tensor_kind(name, swiglu=m.swiglu)
            shape = full_shape(kind, p.shape, model.tp, vocab_size=m.vocab_size)
            whole, local = whole + math.prod(shape), local + p.numel()
    return whole, local


def batch(args, seed: int, rows: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (rows, args.seq + 1), generator=gen)
    positions = torch.arange(args.seq)[None].expand(rows, args.seq)
    return tokens[:, :-1], positions, tokens[:, 1:]


def probe_loss(args, engine) -> float:
    """The mean loss of one fixed batch (the same on every rank), dropout off."""
    import torch

    engine.eval()
    with torch.no_grad():
        value = float(engine(*batch(args, 99, GLOBAL_BATCH)).loss.float().mean())
    engine.train()
    return value


def phase_save(args) -> dict:
    from megatron.core import parallel_state as ps

    engine, model = build(args, args.layout, args.bf16)
    seed = 1 + ps.get_data_parallel_rank()  # each DP rank its sample, TP ranks the same
    engine.backward(engine(*batch(args, seed, GLOBAL_BATCH // model.dp)).loss.mean())
    engine.step()
    whole, local = trained_counts(engine, model)
    loss = probe_loss(args, engine)
    parts, row = measured(lambda: save(engine, model, args.dir, ITERATION))
    # --async-save twice on one checkpointer: the first allocates the host copies, the second
    # (every later save of a run) reuses them
    background, checkpointer = os.path.join(args.dir, "async"), None

    def save_async(iteration: int) -> dict:
        nonlocal checkpointer
        if checkpointer is None:  # as the trainer does after the first step (not timed here)
            checkpointer = _checkpointer(engine, model, background, True)
            checkpointer.prepare_async()
        return save(engine, model, background, iteration, True, checkpointer)

    async_parts, async_row = measured(lambda: save_async(ITERATION))
    steady_parts, _ = measured(lambda: save_async(ITERATION + 1))
    shutil.rmtree(background, ignore_errors=True)
    host = checkpointer.host_copies  # the host buffer against the bytes of the rank's boxes
    return dict(row, parts=parts, loss=loss, trained=whole, local=local, tp=model.tp, dp=model.dp,
                async_parts=async_parts, async_peak_added=async_row["peak_added"],
                steady_parts=steady_parts, async_host_held=host.bytes_held,
                async_host_partition=host.bytes_needed)  # fmt: skip


def phase_load(args) -> dict:
    engine, model = build(args, args.layout, args.bf16)
    before = probe_loss(args, engine)
    (iteration, parts), row = measured(lambda: load(engine, model, args.dir))
    whole, local = trained_counts(engine, model)
    nbytes = parts.pop("bytes")
    return dict(row, parts=parts, bytes=nbytes, iteration=iteration, loss_before=before,
                loss=probe_loss(args, engine), trained=whole, local=local)  # fmt: skip


# ---- launching and reporting ----------------------------------------------------------------


def launch(argv: list[str], phase: str, layout: str, bf16: bool, directory: str) -> list[dict]:
    """``WORLD`` processes of this script in ``phase``; every rank's result, in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--phase", phase, "--layout", layout, "--dir", directory] + ["--bf16"] * bf16
    procs, logs = [], []
    for rank in range(WORLD):
        env = {**os.environ, **common.GLIBC_RETURNS_MEMORY, "RANK": str(rank),
               "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, *flags]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        p.wait()
        log.seek(0)
        text = log.read()
        lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            raise SystemExit(f"{phase} at {layout} failed on rank {rank}:\n{text[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def disk_bytes(directory: str) -> tuple[int, int]:
    """(apparent bytes, files) under ``directory``."""
    sizes = [
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(directory)
        for name in names
    ]
    return sum(sizes), len(sizes)


def run_case(args, argv: list[str], name: str) -> dict:
    layout, bf16 = CASES[name]
    directory = tempfile.mkdtemp(prefix=f"ckpt_bench_{name}_", dir=args.tmp)
    try:
        out = {"save": launch(argv, "save", layout, bf16, directory)}
        out["disk"] = disk_bytes(directory)
        out["load"] = launch(argv, "load", layout, bf16, directory)
        # each load checks what it reads: no verdict remembered from the load before
        shutil.rmtree(os.path.join(directory, ".digests"), ignore_errors=True)
        out["load_other"] = launch(argv, "load", OTHER[layout], bf16, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def _rank_rows(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    mean = sum(values) / len(values)
    cells = " | ".join(gb(v) for v in values)
    return f"{cells} | {f'{max(values) / mean:.2f}' if mean else '-'}"


def _seconds(rows: list[dict]) -> str:
    return " | ".join(f"{r['seconds']:.1f}" for r in rows)


def _parts(rows: list[dict]) -> str:
    labels = {label for r in rows for label in r["parts"]}
    out = []
    for label in sorted(labels, key=lambda lb: -max(r["parts"].get(lb, [0])[0] for r in rows)):
        s = max(r["parts"].get(label, [0, 0, 0])[0] for r in rows)
        w = [r["parts"].get(label, [0, 0, 0])[1] for r in rows]
        rd = [r["parts"].get(label, [0, 0, 0])[2] for r in rows]
        out.append(
            f"  - {label}: {s:.1f} s (max over ranks); wchar per rank {', '.join(map(gb, w))} "
            f"GB; rchar {', '.join(map(gb, rd))} GB"
        )
    return "\n".join(out)


def report(name: str, out: dict) -> None:
    layout, bf16 = CASES[name]
    save_rows, trained = out["save"], out["save"][0]["trained"]
    tp, dp = save_rows[0]["tp"], save_rows[0]["dp"]
    size, files = out["disk"]
    print(f"\n## {name}: TP {tp} x DP {dp} (ZeRO 1), {'bf16' if bf16 else 'float32'} weights\n")
    print(f"- checkpoint on disk: {gb(size)} GB in {files} files = "
          f"{size / (14 * trained):.3f} x (14 B x {trained:,} trained parameters)")  # fmt: skip
    print(
        f"- save wall time (max over ranks, barriers before and after): "
        f"{max(r['seconds'] for r in save_rows):.1f} s; where it goes:\n{_parts(save_rows)}\n"
    )
    head = " | ".join(f"rank {r}" for r in range(WORLD))
    print(f"| save, per rank | {head} | busiest/mean |\n|---|{'---|' * WORLD}---|")
    print(
        f"| bytes written (wchar: files and gloo sockets), GB | {_rank_rows(save_rows, 'wchar')} |"
    )
    print(f"| written to storage (write_bytes), GB | {_rank_rows(save_rows, 'write_bytes')} |")
    print(f"| peak host memory added, GB | {_rank_rows(save_rows, 'peak_added')} |")
    partition = [12 * r["local"] / r["dp"] for r in save_rows]
    ratios = " | ".join(f"{r['peak_added'] / p:.2f}" for r, p in zip(save_rows, partition))
    print(f"| optimizer partition (12 B x own trained / DP), GB | "
          f"{' | '.join(gb(p) for p in partition)} | |")  # fmt: skip
    print(f"| peak added / optimizer partition | {ratios} | |")
    print(f"| wall time, s | {_seconds(save_rows)} | |")
    blocking = max(r["async_parts"]["save() (blocks training)"][0] for r in save_rows)
    steady = max(r["steady_parts"]["save() (blocks training)"][0] for r in save_rows)
    synchronous = max(r["seconds"] for r in save_rows)
    added = " | ".join(f"{r['async_peak_added'] / p:.2f}" for r, p in zip(save_rows, partition))
    print(f"| --async-save: peak added / optimizer partition | {added} | |")
    held = [r["async_host_held"] for r in save_rows]
    share = [r["async_host_partition"] for r in save_rows]
    ratios = " | ".join(f"{h / p:.3f}" for h, p in zip(held, share))
    print(f"| --async-save: host buffer held, GB | {' | '.join(map(gb, held))} | |")
    print(f"| --async-save: partition (its boxes' bytes), GB | {' | '.join(map(gb, share))} | |")
    print(f"| --async-save: host held / partition (target <= {HOST_TARGET}) | {ratios} | |")
    print(
        f"\n- --async-save: training blocked {blocking:.2f} s at the first save (its host copies "
        f"allocated after the first step, as the trainer does) = {blocking / synchronous:.2f} x "
        f"the synchronous save, {steady:.2f} s at the next = {steady / synchronous:.2f} x; the "
        f"first save's parts:\n"
        f"{_parts([{'parts': r['async_parts']} for r in save_rows])}"
    )
    print(f"\nloss of the probe batch after the step: {save_rows[0]['loss']:.6f}\n")
    for key, at in (("load", layout), ("load_other", OTHER[layout])):
        rows = out[key]
        tp2, dp2 = LAYOUTS[at]
        print(f"- load at TP {tp2} x DP {dp2}: {max(r['seconds'] for r in rows):.1f} s (max over "
              f"ranks); iteration {rows[0]['iteration']}; probe loss {rows[0]['loss']:.6f} "
              f"(fresh engine before the load: {rows[0]['loss_before']:.6f}); where it goes:\n"
              f"{_parts(rows)}\n")  # fmt: skip
        print(f"| load at TP {tp2} x DP {dp2}, per rank | {head} | busiest/mean |")
        print(f"|---|{'---|' * WORLD}---|")
        print(f"| bytes read (rchar; mmap'ed reads uncounted), GB | {_rank_rows(rows, 'rchar')} |")
        print(f"| read from storage (read_bytes), GB | {_rank_rows(rows, 'read_bytes')} |")
        print(f"| peak host memory added, GB | {_rank_rows(rows, 'peak_added')} |")
        print(f"| wall time, s | {_seconds(rows)} | |")
        held = [r["bytes"]["held"] for r in rows]
        read = " | ".join(f"{r['bytes']['read'] / h:.2f}" for r, h in zip(rows, held))
        checked = " | ".join(f"{r['bytes']['checked'] / h:.2f}" for r, h in zip(rows, held))
        print(f"| bytes the rank holds (filled by the load), GB | {' | '.join(map(gb, held))} | |")
        print(f"| bytes read / held | {read} | |")
        print(f"| bytes read to check digests / held | {checked} | |\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000, help="a multiple of 256: no padding at TP 2")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--tmp", default="/tmp", help="where the checkpoints are written")
    p.add_argument("--json", metavar="PATH", help="also write every rank's numbers here")
    p.add_argument("--phase", choices=["save", "load"], help=argparse.SUPPRESS)
    p.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        import warnings

        warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not")
        result = (phase_save if args.phase == "save" else phase_load)(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    argv = [f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "heads", "vocab", "seq")]
    import megatron_tempnet

    print(f"# checkpoint benchmark: {common.machine('cpu')}")
    print(f"# megatron_tempnet from {os.path.dirname(megatron_tempnet.__file__)}")
    print(f"# GPT hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocabulary "
          f"{args.vocab}, {args.seq} tokens, DRO + TempNet; 2 gloo processes, 1 thread each; "
          f"checkpoints under {args.tmp} (page cache warm: loads follow the save)")  # fmt: skip
    print(IO_NOTE)
    results = {}
    for name in names:
        t0 = time.perf_counter()
        results[name] = run_case(args, argv, name)
        if len(results) == 1:
            print(f"# trained parameters: {results[name]['save'][0]['trained']:,}")
        report(name, results[name])
        print(f"(case {name}: {time.perf_counter() - t0:.0f} s end to end)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": common.machine("cpu"), "args": vars(args), "results": results},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
