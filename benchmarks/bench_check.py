"""``make bench-check``: the ratio benchmarks at small sizes, each ratio against its record.

Each benchmark below runs a short version of itself (together about 5 minutes on 2 cores) and
writes its JSON; its ratios are read from it and compared with the last recorded ones
(``benchmarks/results/bench_check.json``). A ratio is marked ``REGRESSION`` when it moved the
wrong way by more than the noise band (``NOISE`` of the recorded value, at least ``FLOOR``), or
when a limit its benchmark states was met in the record and is not met now. Which way is worse
comes from the benchmark's own limit (``<= x``: up is worse; ``>= x``: down; a range: away from
its middle); the gate's own ratios say it themselves.

The ratios are side-by-side measurements of one run (fused against unfused, TempNet against
cross-entropy, ours against Hugging Face), so they move less than the times themselves; on a
busy or different machine they still move. The table says which machine made the record.

    python benchmarks/bench_check.py                 # measure, compare, print the table
    python benchmarks/bench_check.py --only loss step
    python benchmarks/bench_check.py --record        # also write the measured ratios as the record

Exit status: 1 when a ratio regressed (or a benchmark failed), else 0. A record moves only with a
measured reason: a change that makes a ratio worse on purpose says so in its commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(REPO, "benchmarks", "results", "bench_check.json")
NOISE = 0.10
"""Relative noise band: side-by-side ratios on the 2-core VM moved by up to ~8 % between runs."""
FLOOR = 0.02
"""Absolute noise band under ratios near 0."""
RANGE = re.compile(r"\s*([\d.e+-]+)\s*-\s*([\d.e+-]+)\s*")
"""A limit ``low-high``."""
BOUND = re.compile(r"\s*(<=|>=)?\s*([\d.e+-]+)\s*")
"""A limit ``<= x``, ``>= x`` or ``x`` (``<=``)."""


@dataclass(frozen=True)
class Ratio:
    value: float
    worse: str
    """``up``, ``down`` or ``away`` (from ``centre``)."""
    limit: str = ""
    """The benchmark's own limit, as it states it (empty: none)."""
    centre: float = 1.0

    def meets_limit(self) -> bool | None:
        """Whether the value meets the benchmark's limit (None: no limit)."""
        low_high = RANGE.fullmatch(self.limit)
        if low_high:
            return float(low_high[1]) <= self.value <= float(low_high[2])
        bound = BOUND.fullmatch(self.limit)
        if not bound:
            return None
        if bound[1] == ">=":
            return self.value >= float(bound[2])
        return self.value <= float(bound[2])


def from_limit(value: float, limit) -> Ratio:
    """A target row's ratio; which way is worse follows its limit."""
    text = str(limit)
    low_high = RANGE.fullmatch(text)
    if low_high:
        centre = (float(low_high[1]) + float(low_high[2])) / 2
        return Ratio(value, "away", text, centre)
    return Ratio(value, "down" if text.strip().startswith(">=") else "up", text)


def verdict(recorded: Ratio | None, now: Ratio) -> str:
    """``REGRESSION``, ``better``, ``same`` (within the noise band) or ``new``."""
    if recorded is None:
        return "new"
    band = max(NOISE * abs(recorded.value), FLOOR)
    if recorded.worse == "away":
        moved = abs(now.value - now.centre) - abs(recorded.value - recorded.centre)
    else:
        moved = (now.value - recorded.value) * (1 if recorded.worse == "up" else -1)
    if recorded.meets_limit() and now.meets_limit() is False:
        return "REGRESSION"
    if moved > band:
        return "REGRESSION"
    return "better" if moved < -band else "same"


def _targets(result: dict) -> dict[str, Ratio]:
    return {t["check"]: from_limit(t["value"], t["limit"]) for t in result.get("targets", [])}


def _generation(result: dict) -> dict[str, Ratio]:
    out = {}
    for row in result["speed"]:
        name = f"ours / HF tokens per second, batch {row['batch']}"
        out[name] = Ratio(row["ratio"], "down")
    for engine, row in result["flat"].items():
        out[f"{engine}: late / early tokens' time"] = Ratio(row["ratio"], "up")
    return out


def _preprocessing(result: dict) -> dict[str, Ratio]:
    out = {}
    for row in result["rows"]:
        n = row["workers"]
        out[f"MB/s per worker, {n} worker(s)"] = Ratio(row["mb_per_s_per_worker"], "down")
        out[f"peak RSS MB, {n} worker(s)"] = Ratio(row["peak_rss_mb"], "up")
    return out


def _checkpoint(result: dict) -> dict[str, Ratio]:
    out = {}
    for case, parts in result["results"].items():
        save, load = parts["save"], parts["load"]
        synchronous = max(r["seconds"] for r in save)
        blocked = max(r["async_parts"]["save() (blocks training)"][0] for r in save)
        out[f"{case}: --async-save blocking / synchronous save"] = Ratio(
            blocked / synchronous, "up"
        )
        held = max(r["async_host_held"] / r["async_host_partition"] for r in save)
        out[f"{case}: host buffer / partition"] = Ratio(held, "up", "<= 1.05")
        read = max(r["bytes"]["read"] / r["bytes"]["held"] for r in load)
        out[f"{case}: load, bytes read / held"] = Ratio(read, "up")
        other = max(r["seconds"] for r in parts["load_other"]) / max(r["seconds"] for r in load)
        out[f"{case}: load at the other layout / same layout, time"] = Ratio(other, "up")
    return out


@dataclass(frozen=True)
class Bench:
    argv: tuple[str, ...]
    ratios: Callable[[dict], dict[str, Ratio]]


# fmt: off
BENCHES = {
    "loss": Bench(("loss_bench.py", "--tokens", "512", "--hidden", "768", "--vocab", "50304",
                   "--reps", "4"), _targets),
    "stage": Bench(("loss_bench.py", "--section", "stage", "--tokens", "512", "--stage-shapes",
                    "768:50304:1", "--reps", "1"), _targets),
    "step": Bench(("step_bench.py", "--num-layers", "2", "--seq-lengths", "256", "--steps", "2"),
                  _targets),
    "frozen LM": Bench(("frozen_lm_bench.py", "--micro-batch", "2", "--seq-length", "128",
                        "--steps", "5", "--profile-steps", "0"), _targets),
    "generation": Bench(("generate_bench.py", "--num-layers", "4", "--new-tokens", "32",
                         "--long-tokens", "64", "--recompute-tokens", "16", "--batch-sizes", "1",
                         "--repeats", "1"), _generation),
    "preprocessing": Bench(("preprocess_bench.py", "--size-mb", "4", "--workers", "1"),
                           _preprocessing),
    "checkpoint": Bench(("checkpoint_bench.py", "--cases", "dp2-fp32", "--hidden", "512",
                         "--layers", "2", "--heads", "8", "--vocab", "8192", "--seq", "64"),
                        _checkpoint),
}
# fmt: on


def measure(name: str, bench: Bench, workdir: str) -> dict[str, Ratio]:
    """Run one benchmark's short version; its ratios (its output goes to ``workdir``)."""
    out = os.path.join(workdir, f"{name.replace(' ', '_')}.json")
    log = os.path.join(workdir, f"{name.replace(' ', '_')}.log")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", bench.argv[0]), *bench.argv[1:]]
    with open(log, "w") as f:
        done = subprocess.run([*cmd, "--json", out], stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cmd)} exited {done.returncode}; see {log}")
    with open(out) as f:
        return bench.ratios(json.load(f))


def load_record(path: str) -> dict:
    if not os.path.exists(path):
        return {"machine": None, "ratios": {}}
    with open(path) as f:
        data = json.load(f)
    data["ratios"] = {
        bench: {k: Ratio(**v) for k, v in rows.items()} for bench, rows in data["ratios"].items()
    }
    return data


def table(record: dict, measured: dict[str, dict[str, Ratio]]) -> tuple[list[str], int]:
    """The comparison table's lines and the number of regressions."""
    lines = ["| benchmark | ratio | recorded | now | limit | |", "|---|---|---:|---:|---|---|"]
    regressions = 0
    for bench, ratios in measured.items():
        for name, now in ratios.items():
            before = record["ratios"].get(bench, {}).get(name)
            mark = verdict(before, now)
            regressions += mark == "REGRESSION"
            shown = "-" if before is None else f"{before.value:.3f}"
            lines.append(f"| {bench} | {name} | {shown} | {now.value:.3f} | {now.limit} | "
                         f"{'**REGRESSION**' if mark == 'REGRESSION' else mark} |")  # fmt: skip
    return lines, regressions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(BENCHES), help="default: every benchmark")
    p.add_argument("--record", action="store_true", help="write the measured ratios as the record")
    p.add_argument("--record-file", default=RECORD, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    record = load_record(args.record_file)
    measured, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="bench_check_") as workdir:
        for name in args.only or list(BENCHES):
            tic = time.perf_counter()
            try:
                measured[name] = measure(name, BENCHES[name], workdir)
            except RuntimeError as e:
                failed.append(str(e))
                with open(os.path.join(workdir, f"{name.replace(' ', '_')}.log")) as f:
                    print(f.read()[-3000:], file=sys.stderr)
            print(f"# {name}: {time.perf_counter() - tic:.0f} s", flush=True)
    machine = common.machine("cpu")
    print(f"\nrecorded on: {record['machine']}\nnow on:      {machine}\n")
    lines, regressions = table(record, measured)
    print("\n".join(lines))
    print(f"\nnoise band: {NOISE:.0%} of the recorded value, at least {FLOOR}")
    for problem in failed:
        print(f"FAILED: {problem}")
    if args.record and not failed:
        ratios = {**record["ratios"], **measured}
        data = {"machine": machine, "ratios": {b: {k: vars(v) for k, v in r.items()}
                                               for b, r in ratios.items()}}  # fmt: skip
        with open(args.record_file, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        print(f"recorded: {args.record_file}")
    return 1 if regressions or failed else 0


if __name__ == "__main__":
    sys.exit(main())
