"""What setting (iii) costs: TempNet trained on a frozen LM against the LM's plain forward pass.

Setting (iii) of the TempNet paper (``pretrain_gpt.py --freeze-lm --pretrained-checkpoint DIR``)
trains TempNet only. Its step is built here as pretrain_gpt.py builds it, in one process: the
run config from pretrain_gpt.py's own flags (``--freeze-lm --loss dro --tau-source tempnet``,
the default rho, d1 = d2 = 256), ``GPTTask``'s model (``TrainModule`` with ``freeze_lm``), the
DeepSpeed engine (ZeRO 0, float32), the checkpointer's load of the frozen LM, and
``GPTTask.build_step``'s iteration (forward, masked mean, backward, gradient clipping, fused
AdamW) with its statistics read back. Cases, on the same LM and the same batches, taking turns
step by step (the order rotates every step), the median of ``--steps`` after one warm-up step:

- ``train``: one such training iteration (one micro-batch);
- ``forward``: the LM's own forward pass under ``torch.no_grad()``, logits of every token from
  its output layer: what running the frozen LM costs at all;
- ``forward+ce``: the LM's final hidden states, then the fused output stage with plain
  cross-entropy (``--loss ce``, fixed tau): the same objective module without TempNet;
- ``body``: the LM up to its final norm (no output layer), to split each case into the body and
  its output stage (per step: case minus body, same batch);
- ``train-cached``: ``train`` with ``--frozen-lm-cache``, every batch's hidden states already
  stored (filled before the timed steps): the iteration that reads them and runs only the output
  stage. ``train / train-cached`` is the cache's speed-up per TempNet iteration.

Times on two clocks: wall-clock, and on a CPU run this process's CPU time (all threads). On a
machine shared with other jobs run ``--threads 1`` and read the CPU time: a single thread's CPU
time does not count the time other processes hold the core, whereas with several threads the
ones waiting at a barrier for a descheduled one spin, and that spinning is counted.

Then ``--profile-steps`` profiled steps of ``train`` and of ``forward``, taking turns
(``torch.profiler``, self time of every operator; the median per piece), the operators sorted
into pieces by name and input shapes (``c`` tokens per chunk of the fused output stage): the
output layer's GEMM ``[c, h] x [h, V]``, TempNet's W1 product ``[c, V] x [V, d1]``, W1's gradient
``[d1, c] x [c, V]``, the elementwise passes over ``[c, V]`` (row maximum, norm, the loss's exp
sums; eager only), the compiled regions (the compiled logit passes, which record no shapes,
and megatron-core's compiled fusions: ``train`` minus ``forward`` is the passes), the ``[d1, V]``
passes (W1's gradient zeroed and scaled, the clipping norm), TempNet's layers after W1, fused
AdamW, and the LM body with everything else.

Model: SmolLM2-135M's shape (LLaMA: 30 layers, hidden 576, FFN 1536, 9 heads, 3 query groups,
vocabulary 49152, tied embeddings, RMSNorm, SwiGLU, RoPE base 100000, no biases) with random
weights (speed does not depend on them), or ``--load DIR``: a converted LM checkpoint of this
project, loaded as ``--pretrained-checkpoint`` (its architecture from the checkpoint).

    python benchmarks/frozen_lm_bench.py --json runs/frozen_lm_bench.json
    python benchmarks/frozen_lm_bench.py --threads 1    # a shared machine
    python benchmarks/frozen_lm_bench.py --load /path/to/ckpt --micro-batch 8 --seq-length 512
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
import warnings

import common
import torch

SMOLLM2_135M = ["--num-layers", 30, "--hidden-size", 576, "--ffn-hidden-size", 1536,
                "--num-attention-heads", 9, "--group-query-attention", "--num-query-groups", 3,
                "--normalization", "RMSNorm", "--norm-epsilon", 1e-5, "--swiglu",
                "--disable-bias-linear", "--position-embedding-type", "rope",
                "--rotary-base", 100000, "--max-position-embeddings", 8192]  # fmt: skip
TARGET = 1.10


def _argv(args, vocab_size: int) -> list[str]:
    """pretrain_gpt.py's command line for setting (iii) on one process."""
    load = []
    if args.load:  # --load: where the run's own (TempNet) checkpoints would be; none yet
        load = ["--pretrained-checkpoint", args.load, "--load", tempfile.mkdtemp()]
    argv = SMOLLM2_135M + load + [
        # NullTokenizer adds an end-of-document id to --vocab-size (as Megatron-LM's does)
        "--seq-length", args.seq_length, "--vocab-size", vocab_size - 1,
        "--hidden-dropout", 0, "--attention-dropout", 0,
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--train-iters", 1, "--lr", 1e-3,
        "--micro-batch-size", args.micro_batch, "--global-batch-size", args.micro_batch,
        "--freeze-lm", "--loss", "dro", "--tau-source", "tempnet",
    ]  # fmt: skip
    return [str(a) for a in argv]


def _config(args):
    """The run config pretrain_gpt.py would build (``--load``: the checkpoint's architecture
    replaces SmolLM2's)."""
    import dataclasses

    from megatron_tempnet.models.gpt.arguments import build_parser, config_from_args

    saved = None
    if args.load:
        from megatron_tempnet.inference.checkpoint_io import CheckpointReader

        saved = CheckpointReader(args.load, "--load").model
    vocab = saved.vocab_size if saved is not None else args.vocab_size
    config = config_from_args(build_parser().parse_args(_argv(args, vocab)))
    if saved is not None:
        positions = max(saved.max_position_embeddings, args.seq_length)
        config.model = dataclasses.replace(
            saved, seq_length=args.seq_length, max_position_embeddings=positions
        )
    return config


def _engine(args):
    """pretrain_gpt.py's setup on one process: (config, engine, the iteration's step)."""
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and )?Apex (is|are) not")
    from megatron_tempnet.checkpoint.checkpointer import Checkpointer
    from megatron_tempnet.distributed.launch import launch_environment
    from megatron_tempnet.models.gpt.task import GPTTask
    from megatron_tempnet.trainer.engine import build_engine, init_process_groups
    from megatron_tempnet.trainer.task import TaskData

    os.environ.update(launch_environment(os.environ))  # a lone process, as pretrain() does
    config, task = _config(args), GPTTask()
    task.prepare(config, 1)
    init_process_groups(config)
    model = task.build_model(config, TaskData(train=None))
    engine, optimizer = build_engine(model, config, 1)
    Checkpointer(engine, model, config).resume()  # --pretrained-checkpoint: the frozen LM
    if args.load:
        os.rmdir(config.checkpoint.load)  # the empty --load of _argv
    return config, engine, task.build_step(engine, optimizer, config, TaskData(train=None))


def build(args) -> dict:
    """The training step of setting (iii) and the baselines' closures over the same LM."""
    from megatron_tempnet.models.gpt.hidden_cache import FrozenHiddenCache
    from megatron_tempnet.models.gpt.objective import LossConfig, TrainModule, masked_mean
    from megatron_tempnet.trainer.stats import read_step

    config, engine, step = _engine(args)
    lm, m = engine.module.lm, config.model
    ce = TrainModule(lm, None, LossConfig(loss="ce", tau_source="fixed"), m.vocab_size, True)

    def train(batch: dict) -> float:
        return read_step(step([batch])).metrics["loss"]  # the iteration's one host read

    def forward(batch: dict) -> float:
        with torch.no_grad():
            logits = lm(batch["tokens"], batch["position_ids"])  # [b, s, V_pad]
        return float(logits[0, 0, 0])

    def forward_ce(batch: dict) -> float:
        out = ce(batch["tokens"], batch["position_ids"], batch["labels"])
        return float(masked_mean(out.loss, batch["loss_mask"], batch["loss_mask"].sum()))

    def body(batch: dict) -> float:
        with torch.no_grad():
            hidden = lm.final_hidden(batch["tokens"], batch["position_ids"]).hidden
        return float(hidden[0, 0, 0])

    shape = dict(
        vocab_size=m.vocab_size,
        padded_vocab_size=m.padded_vocab_size(1),
        hidden_size=m.hidden_size,
        d1=config.loss.tempnet.tempnet_hidden_size,
        num_layers=m.num_layers,
        rho=config.loss.rho,
        trained_params=sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        frozen_params=sum(p.numel() for p in lm.parameters()),
        threads=torch.get_num_threads(),
    )
    # --frozen-lm-cache: the same iteration with the hidden states read from a filled store
    store = FrozenHiddenCache(tempfile.mkdtemp(prefix="frozen_lm_cache_"), lm, {}, 0, 1)
    module = engine.module

    def train_cached(batch: dict) -> float:
        module.hidden_cache = store
        try:
            return train(batch)
        finally:
            module.hidden_cache = None

    def fill(data: list[dict]) -> None:
        for batch in data:
            tokens, positions = batch["tokens"], batch["position_ids"]
            store.hidden(tokens, positions, functools.partial(body_hidden, tokens, positions))
        assert store.computed == sum(len(b["tokens"]) for b in data) and store.read == 0

    def body_hidden(tokens, positions):
        with torch.no_grad():
            return lm.final_hidden(tokens, positions).hidden

    cases = {"train": train, "train-cached": train_cached, "forward": forward,
             "forward+ce": forward_ce, "body": body}  # fmt: skip
    return {"cases": cases, "shape": shape, "fill": fill, "store": store.directory}


def batches(args, vocab_size: int, device) -> list[dict]:
    """``--steps`` + 1 micro-batches of random tokens, every token counted in the loss."""
    gen = torch.Generator().manual_seed(1)
    b, s = args.micro_batch, args.seq_length
    out = []
    for _ in range(args.steps + 1):
        tokens = torch.randint(0, vocab_size, (b, s + 1), generator=gen)
        batch = {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s)[None].expand(b, s),
        }
        out.append({k: v.to(device) for k, v in batch.items()})
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def take_turns(cases: dict, data: list[dict]) -> dict:
    """Every case runs every batch; the cases take turns, the first one rotating each step.
    Per clock (``wall``; ``cpu``: this process's CPU time, all threads, on a CPU run) and case,
    the seconds of each step after the warm-up step."""
    clocks = {"wall": time.perf_counter}
    if not torch.cuda.is_available():
        clocks["cpu"] = time.process_time  # what other processes on the machine do not add
    names = list(cases)
    times = {clock: {name: [] for name in names} for clock in clocks}
    for i, batch in enumerate(data):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            _sync()
            t0 = {clock: now() for clock, now in clocks.items()}
            cases[name](batch)
            _sync()
            for clock, now in clocks.items():
                times[clock][name].append(now() - t0[clock])
    return {c: {name: t[1:] for name, t in by.items()} for c, by in times.items()}


def _summary(values: list[float]) -> dict:
    return dict(median_s=statistics.median(values), min_s=min(values), max_s=max(values))


def summarise(times: dict, tokens: int) -> dict:
    """Per case: median and spread, tokens/s, the ratio to ``forward``; per case with an output
    stage: the stage alone (the case minus the body on the same batch), its ratio to the
    forward pass's output layer."""
    out = {"cases": {}, "stages": {}}
    forward = statistics.median(times["forward"])
    for name, t in times.items():
        row = _summary(t)
        row["tokens_per_s"] = tokens / row["median_s"]
        row["x_forward"] = row["median_s"] / forward
        out["cases"][name] = dict(row, times_s=t)
    for name in ("train", "forward", "forward+ce"):
        out["stages"][name] = _summary([a - b for a, b in zip(times[name], times["body"])])
    head = out["stages"]["forward"]["median_s"]
    for row in out["stages"].values():
        row["x_forward_output_layer"] = row["median_s"] / head
    ratios = [a / b for a, b in zip(times["train"], times["forward"])]
    out["train_over_forward_per_step"] = _summary(ratios)
    ratios = [a / b for a, b in zip(times["train"], times["train-cached"])]
    out["cache_speedup_per_step"] = _summary(ratios)
    out["cache_speedup"] = out["cases"]["train"]["median_s"] / statistics.median(
        times["train-cached"]
    )
    return out


GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")
COMPILED = ("## Call CompiledFxGraph", "Torch-Compiled Region", "TorchDynamo", "Pregraph", "AOT")


def _piece(name: str, shapes: list, dims: dict) -> str:
    """The piece of a step an operator belongs to, by its name and input shapes."""
    vocab, d1, h = {dims["padded_vocab_size"], dims["vocab_size"]}, dims["d1"], dims["hidden_size"]
    sizes = [tuple(s) for s in shapes if isinstance(s, list) and s]
    by_vocab = [s for s in sizes if len(s) >= 2 and s[-1] in vocab]  # [.., V] operands
    if "adam" in name:
        return "fused AdamW (TempNet)"
    if name.startswith(COMPILED):  # no shapes recorded: the train - forward difference is ours
        return "compiled regions (logit passes; megatron-core's fusions)"
    if name == "_FusedOutputStage":
        return "output stage's Python (autograd Function)"
    if name in GEMMS and by_vocab:
        if any(d1 in s for s in sizes):
            # the gradient accumulates into [d1, V] (addmm_); the product writes [c, d1]
            grad = name.startswith("aten::addmm") and sizes[0][0] == d1
            return "W1 gradient [d1, c] x [c, V]" if grad else "W1 product [c, V] x [V, d1]"
        return "output layer GEMM [c, h] x [h, V]"
    if any(len(s) == 3 for s in by_vocab):
        return "logits' layout copy [s, b, V] -> [b, s, V]"
    if any(s[0] == d1 and len(s) == 2 for s in by_vocab):
        return "[d1, V] passes (W1 grad zero/scale, clip norm)"
    if by_vocab:
        return "passes over [c, V] (max, norm, exp sums)"
    two_d = [s for s in sizes if len(s) <= 2]
    if two_d and len(two_d) == len(sizes) and any(s[-1] == d1 for s in two_d):
        if not any(h in s for s in sizes):
            return "TempNet after W1 (sigmoid, W2, pooling)"
    return "LM body and the rest"


def _profiled(case, batch: dict, dims: dict) -> dict[str, float]:
    """One profiled call of ``case``: milliseconds per piece (self time on the CPU; on a GPU,
    the kernels' time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    attribute = "self_device_time_total" if gpu else "self_cpu_time_total"
    with torch_profile(activities=activities, record_shapes=True) as prof:
        case(batch)
        _sync()
    pieces: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        key = _piece(event.key, event.input_shapes, dims)
        pieces[key] = pieces.get(key, 0.0) + getattr(event, attribute) / 1e3
    pieces["total"] = sum(pieces.values())
    return pieces


def profile(cases: dict, data: list[dict], dims: dict, rounds: int) -> dict:
    """``rounds`` profiled steps of ``train`` and ``forward`` taking turns: per piece the
    median over the rounds (ms), the total last."""
    names = ("train", "forward")
    seen: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            seen[name].append(_profiled(cases[name], data[i % len(data)], dims))
    out = {}
    for name, runs in seen.items():
        keys = {k for run in runs for k in run} - {"total"}
        medians = {k: statistics.median(run.get(k, 0.0) for run in runs) for k in keys}
        out[name] = dict(sorted(medians.items(), key=lambda kv: -kv[1]))
        out[name]["total"] = statistics.median(run["total"] for run in runs)
    return out


CLOCKS = {"wall": "wall-clock", "cpu": "this process's CPU time, all threads"}


def _print_clock(clock: str, results: dict) -> None:
    print(f"## {CLOCKS[clock]}")
    print(f"{'case':<12} {'step (s)':>9} {'min-max (s)':>13} {'tokens/s':>9} {'x forward':>9}")
    for name, r in results["cases"].items():
        print(f"{name:<12} {r['median_s']:>9.3f} {r['min_s']:>6.2f}-{r['max_s']:<6.2f} "
              f"{r['tokens_per_s']:>9.0f} {r['x_forward']:>9.3f}")  # fmt: skip
    r = results["train_over_forward_per_step"]
    print(f"train / forward, step by step: median {r['median_s']:.3f}, {r['min_s']:.3f}-"
          f"{r['max_s']:.3f}")  # fmt: skip
    r = results["cache_speedup_per_step"]
    print(f"train / train-cached (--frozen-lm-cache's speed-up per iteration): "
          f"{results['cache_speedup']:.2f}; step by step: median {r['median_s']:.2f}, "
          f"{r['min_s']:.2f}-{r['max_s']:.2f}")  # fmt: skip
    print(f"{'output stage (case - body)':<27} {'median (s)':>10} {'min-max (s)':>13} "
          f"{'x forward output layer':>22}")  # fmt: skip
    for name, r in results["stages"].items():
        print(f"{name:<27} {r['median_s']:>10.3f} {r['min_s']:>6.2f}-{r['max_s']:<6.2f} "
              f"{r['x_forward_output_layer']:>22.3f}")  # fmt: skip
    print()


def report(args, shape: dict, results: dict, pieces: dict | None) -> list[tuple]:
    """Print the tables; return the targets as (description, value, limit, passed)."""
    tokens = args.micro_batch * args.seq_length
    weights = f"--load {args.load}" if args.load else "random weights"
    print(f"# setting (iii): TempNet (d1 {shape['d1']}, DRO rho {shape['rho']}) on a frozen LM "
          f"({shape['num_layers']} layers, hidden {shape['hidden_size']}, vocabulary "
          f"{shape['vocab_size']}, {shape['frozen_params'] / 1e6:.1f}M frozen, "
          f"{shape['trained_params'] / 1e6:.2f}M trained; {weights}), micro-batch "
          f"{args.micro_batch} x {args.seq_length} = {tokens} tokens, float32")  # fmt: skip
    print(f"# {common.machine(args.device)}, {shape['threads']} thread(s); median of {args.steps} "
          "steps after 1 warm-up, cases taking turns\n")  # fmt: skip
    for clock, r in results.items():
        _print_clock(clock, r)
    if pieces:
        print(f"# profiled steps: self time per piece (ms), median of {args.profile_steps}")
        names = list(dict.fromkeys(list(pieces["train"]) + list(pieces["forward"])))
        names = [k for k in names if k != "total"] + ["total"]
        print(f"{'piece':<48} {'train':>8} {'forward':>8}")
        for key in names:
            tr, fw = pieces["train"].get(key, 0.0), pieces["forward"].get(key, 0.0)
            print(f"{key:<48} {tr:>8.0f} {fw:>8.0f}")
    targets = []
    for clock, r in results.items():
        ratio = r["cases"]["train"]["x_forward"]
        targets.append((f"train / forward step time ({clock}), {tokens} tokens", ratio,
                        f"<= {TARGET}", ratio <= TARGET))  # fmt: skip
    print("\ntargets")
    for desc, value, limit, ok in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {desc}: {value:.4g} (target {limit})")
    return targets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--load", metavar="DIR", help="a converted LM checkpoint (default: random)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=49152, help="without --load")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 1 warm-up)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps (0: none)")
    p.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"  # where pretrain_gpt.py runs
    built = build(args)
    device = torch.device(args.device)
    shape = built["shape"]
    data = batches(args, shape["vocab_size"], device)
    tokens = args.micro_batch * args.seq_length
    built["fill"](data)  # the store holds every batch's hidden states: train-cached reads them
    times = take_turns(built["cases"], data)
    shutil.rmtree(built["store"])
    results = {clock: summarise(by_case, tokens) for clock, by_case in times.items()}
    pieces = None
    if args.profile_steps:
        pieces = profile(built["cases"], data, shape, args.profile_steps)
    targets = report(args, shape, results, pieces)
    if args.json:
        common.write_json(args.json, args, targets, shape=shape, results=results,
                          profile_ms=pieces)  # fmt: skip


if __name__ == "__main__":
    main()
