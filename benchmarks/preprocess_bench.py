"""Preprocessing benchmark: throughput and peak memory of tools/preprocess_data.py per worker count.

The input is a generated ``.jsonl.zst`` file of a given compressed size (default 200 MB): every
document is a random sequence of real English words (drawn, with their frequencies, from the
prose of Python's ``pydoc_data`` topics), 200 to 2000 words long, with a newline after some
sentences; records are ``{"text": ..., "meta": {"id": i}}``. It is written once into --workdir
by a streaming zstd writer (level 3) and reused while the size and seed match; a JSON sidecar
next to it records its uncompressed size and document count. The tokenizer is a GPT-2-format
byte-level BPE (vocabulary 8192) trained in-process on the same pydoc text.

For every --workers N the tool runs as a subprocess (``--append-eod --workers N --overwrite``)
while this process samples, every 0.1 s, the tool's whole process tree (the tool, its worker
pool and any other descendant) and records the peak of the tree's summed RSS and summed PSS
(PSS shares each page among the processes mapping it, so shared libraries count once; RSS
counts them in every process). Time is the wall time of the subprocess, interpreter start,
tokenizer loading and worker start-up included. Documents and tokens come from the tool's final
log lines. MB = 10^6 bytes throughout; "MB/s" is uncompressed input per second. The target is a
peak tree RSS below 1 GB (10^9 bytes, --rss-target-mb).

The JSON output also has, per run, the CPU seconds of the whole tree and the largest
single-process RSS high-water mark (VmHWM, kept by the kernel, so it catches peaks shorter than
the sampling interval), and the number of processes in the tree.

    python benchmarks/preprocess_bench.py                           # 200 MB, workers 1 and 2
    python benchmarks/preprocess_bench.py --size-mb 5 --workers 1 2 # a quick check
    python benchmarks/preprocess_bench.py --workers 1 2 4 8 --json preprocess.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
import zstandard

MB = 1e6
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "preprocess_data.py")
GENERATOR_VERSION = 1  # bump when the generated text changes, so that old files are not reused
DOCS_PER_BATCH = 256
MIN_WORDS, MAX_WORDS = 200, 2000
NEWLINE_AFTER_SENTENCE = 0.15
VOCAB_SIZE = 8192
SAMPLE_INTERVAL = 0.1
WORD = re.compile(r"[A-Za-z.,;:!?'\"()\-]*[A-Za-z][A-Za-z.,;:!?'\"()\-]*")
WROTE = re.compile(r"wrote (\S+?)\.bin/\.idx\S*: (\d+) documents, (\d+) tokens, (\w+)")


def _pydoc_texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def _word_list() -> list[str]:
    """pydoc's words with their repetitions, so that sampling follows their frequencies."""
    return [w for text in _pydoc_texts() for w in text.split() if WORD.fullmatch(w)]


def _input_paths(workdir: str, size_mb: float, seed: int) -> tuple[str, str]:
    stem = os.path.join(workdir, f"words_{size_mb:g}MB_seed{seed}")
    return stem + ".jsonl.zst", stem + ".json"


def _reusable(path: str, sidecar: str, size_mb: float, seed: int) -> dict | None:
    try:
        with open(sidecar) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    same = (meta.get("size_mb"), meta.get("seed"), meta.get("generator")) == (
        size_mb,
        seed,
        GENERATOR_VERSION,
    )
    # an interrupted or altered file has another size than the one recorded when it was finished
    if same and os.path.isfile(path) and os.path.getsize(path) == meta.get("compressed_bytes"):
        return meta
    return None


def generate_input(workdir: str, size_mb: float, seed: int) -> dict:
    """Write (or reuse) the corpus; return its sidecar metadata."""
    path, sidecar = _input_paths(workdir, size_mb, seed)
    meta = _reusable(path, sidecar, size_mb, seed)
    if meta is not None:
        print(f"# reusing {path}")
        return {**meta, "reused": True}
    words = _word_list()
    # each word twice: followed by a space, or by a newline where it ends a sentence
    pieces = np.array([[w + " " for w in words], [w + "\n" for w in words]], dtype=object)
    ends_sentence = np.array([w.rstrip("\"')").endswith((".", "!", "?")) for w in words])
    rng = np.random.default_rng(seed)
    target = int(size_mb * MB)
    raw_bytes = docs = 0
    t0 = time.perf_counter()
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        with zstandard.ZstdCompressor(level=3).stream_writer(f, closefd=False) as writer:
            while writer.tell() < target:  # compressed bytes handed to the file so far
                lengths = rng.integers(MIN_WORDS, MAX_WORDS + 1, size=DOCS_PER_BATCH)
                idx = rng.integers(0, len(words), size=int(lengths.sum()))
                newline = ends_sentence[idx] & (rng.random(idx.size) < NEWLINE_AFTER_SENTENCE)
                batch = pieces[newline.astype(np.intp), idx].tolist()
                bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
                lines = []
                for k in range(DOCS_PER_BATCH):
                    text = "".join(batch[bounds[k] : bounds[k + 1]])[:-1]  # drop the last separator
                    record = {"text": text, "meta": {"id": docs + k}}
                    lines.append(json.dumps(record).encode() + b"\n")
                data = b"".join(lines)
                writer.write(data)
                raw_bytes += len(data)
                docs += DOCS_PER_BATCH
    os.replace(tmp, path)
    meta = dict(
        path=path,
        size_mb=size_mb,
        seed=seed,
        generator=GENERATOR_VERSION,
        compressed_bytes=os.path.getsize(path),
        uncompressed_bytes=raw_bytes,
        documents=docs,
        distinct_words=len(set(words)),
        generation_s=round(time.perf_counter() - t0, 2),
    )
    # the sidecar is written last: its presence means the file is complete
    with open(sidecar, "w") as f:
        json.dump(meta, f, indent=2)
    print(
        f"# generated {path}: {meta['compressed_bytes'] / MB:.1f} MB zst, "
        f"{raw_bytes / MB:.1f} MB raw, {docs:,} documents in {meta['generation_s']:.1f} s"
    )
    return {**meta, "reused": False}


def build_tokenizer(workdir: str) -> dict:
    """Train the byte-level BPE on pydoc's text; save vocab.json and merges.txt in ``workdir``."""
    # the same recipe as the tests' tiny GPT-2 vocabulary, at a realistic size
    sys.path.insert(0, REPO)
    from tests.helpers.corpus import train_gpt2_bpe

    vocab_file, merge_file = train_gpt2_bpe(workdir, VOCAB_SIZE)
    with open(vocab_file) as f:
        vocab_size = len(json.load(f))
    return dict(vocab_file=vocab_file, merge_file=merge_file, vocab_size=vocab_size)


def _hwm_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_memory(root: psutil.Process, hwm: dict[int, int]) -> tuple[int, int, int]:
    """(summed RSS, summed PSS, processes) of ``root`` and its descendants, now."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:  # the tool has exited since the last poll
        return 0, 0, 0
    rss = pss = n = 0
    for p in procs:
        try:
            try:
                full = p.memory_full_info()
                r, s = full.rss, getattr(full, "pss", full.rss)
            except psutil.AccessDenied:  # no smaps for this process: PSS falls back to RSS
                r = s = p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone between listing and reading
            continue
        rss, pss, n = rss + r, pss + s, n + 1
        hwm[p.pid] = max(hwm.get(p.pid, 0), _hwm_bytes(p.pid))
    return rss, pss, n


def run_tool(input_path: str, tokenizer: dict, workdir: str, workers: int) -> dict:
    prefix = os.path.join(workdir, f"out_w{workers}")
    log_path = prefix + ".log"
    cmd = [
        sys.executable,
        TOOL,
        "--input",
        input_path,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        tokenizer["vocab_file"],
        "--merge-file",
        tokenizer["merge_file"],
        "--append-eod",
        "--workers",
        str(workers),
        "--overwrite",
    ]
    peak_rss = peak_pss = max_procs = samples = 0
    hwm: dict[int, int] = {}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the log goes to a file, not a pipe, so that a chatty tool can never block on a full pipe
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            rss, pss, n = _tree_memory(root, hwm)
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            max_procs, samples = max(max_procs, n), samples + 1
            time.sleep(SAMPLE_INTERVAL)
        seconds = time.perf_counter() - t0
    # the tool reaps its workers, so its children's CPU time is in its own rusage
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log_path) as f:
        log_text = f.read()
    if proc.returncode != 0:
        tail = "\n".join(log_text.splitlines()[-20:])
        raise SystemExit(
            f"preprocess_data.py --workers {workers} failed ({proc.returncode}):\n{tail}"
        )
    wrote = WROTE.findall(log_text)
    if len(wrote) != 1:
        raise SystemExit(f"expected one 'wrote ...' line in {log_path}, found {len(wrote)}")
    out_prefix, docs, tokens, dtype = wrote[0]
    return dict(
        workers=workers,
        documents=int(docs),
        tokens=int(tokens),
        dtype=dtype,
        seconds=seconds,
        cpu_seconds=(cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        peak_rss_mb=peak_rss / MB,
        peak_pss_mb=peak_pss / MB,
        max_process_hwm_mb=max(hwm.values(), default=0) / MB,
        max_processes=max_procs,
        samples=samples,
        output_prefix=out_prefix,
        log=log_path,
    )


def _remove_outputs(prefix: str) -> None:
    for suffix in (".bin", ".idx"):
        if os.path.exists(prefix + suffix):
            os.remove(prefix + suffix)


def _machine() -> dict:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return dict(
        cpu=model,
        cores=os.cpu_count(),
        usable_cores=usable,
        ram_gb=psutil.virtual_memory().total / 2**30,
        python=platform.python_version(),
        platform=platform.platform(),
    )


def _print_table(rows: list[dict], corpus: dict, tokenizer: dict, machine: dict, target_mb):
    print(
        f"# {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"{machine['ram_gb']:.1f} GiB RAM, Python {machine['python']}"
    )
    print(
        f"# input {corpus['path']}: {corpus['documents']:,} documents, seed {corpus['seed']}; "
        f"GPT-2 BPE vocabulary {tokenizer['vocab_size']}; MB = 10^6 bytes"
    )
    header = (
        f"{'workers':>7} {'docs':>9} {'tokens':>12} {'MB zst':>7} {'MB raw':>7} {'s':>7} "
        f"{'docs/s':>8} {'MB/s':>6} {'docs/s/w':>8} {'MB/s/w':>6} {'RSS MB':>7} {'PSS MB':>7} "
        f"{'<' + format(target_mb / 1000, 'g') + ' GB':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['workers']:>7} {r['documents']:>9,} {r['tokens']:>12,} {r['input_mb_zst']:>7.1f} "
            f"{r['input_mb_raw']:>7.1f} {r['seconds']:>7.1f} {r['docs_per_s']:>8,.0f} "
            f"{r['mb_per_s']:>6.2f} {r['docs_per_s_per_worker']:>8,.0f} "
            f"{r['mb_per_s_per_worker']:>6.2f} {r['peak_rss_mb']:>7.0f} {r['peak_pss_mb']:>7.0f} "
            f"{'PASS' if r['rss_target_passed'] else 'FAIL':>7}"
        )
    print("RSS/PSS: peak over 0.1 s samples of the sum over the tool's process tree")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=200.0, help="compressed input size")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="--workers values")
    parser.add_argument(
        "--workdir",
        default=os.path.join(tempfile.gettempdir(), "preprocess_bench"),
        help="holds the generated input (reused between runs), the tokenizer and the outputs",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated input")
    parser.add_argument(
        "--rss-target-mb", type=float, default=1000.0, help="peak tree RSS target (10^6 bytes)"
    )
    parser.add_argument("--keep-outputs", action="store_true", help="keep the output datasets")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if args.size_mb <= 0:
        parser.error("--size-mb must be positive")
    if min(args.workers) < 1:
        parser.error("--workers values must be >= 1")
    os.makedirs(args.workdir, exist_ok=True)
    corpus = generate_input(args.workdir, args.size_mb, args.seed)
    tokenizer = build_tokenizer(args.workdir)
    rows = []
    for n in args.workers:
        row = run_tool(corpus["path"], tokenizer, args.workdir, n)
        zst, raw = corpus["compressed_bytes"] / MB, corpus["uncompressed_bytes"] / MB
        row.update(
            input_mb_zst=zst,
            input_mb_raw=raw,
            docs_per_s=row["documents"] / row["seconds"],
            mb_per_s=raw / row["seconds"],
            rss_target_passed=row["peak_rss_mb"] < args.rss_target_mb,
        )
        row["docs_per_s_per_worker"] = row["docs_per_s"] / n
        row["mb_per_s_per_worker"] = row["mb_per_s"] / n
        if row["documents"] != corpus["documents"]:
            print(
                f"warning: --workers {n} wrote {row['documents']:,} documents, "
                f"the input has {corpus['documents']:,}"
            )
        if not args.keep_outputs:
            _remove_outputs(row["output_prefix"])
        rows.append(row)
    machine = _machine()
    _print_table(rows, corpus, tokenizer, machine, args.rss_target_mb)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    machine=machine, args=vars(args), input=corpus, tokenizer=tokenizer, rows=rows
                ),
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
