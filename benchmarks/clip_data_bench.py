"""CLIP data benchmark: memory per image-text pair, and a tar shard's index scanned vs cached.

Memory: ``--pairs`` (default 1M) pairs with CC3M-like captions (8 to 14 words drawn from a
2,000-word vocabulary, about 60 bytes) and labels, half from tar shards (a member offset and
size, a sample key) and half from manifests (an image path), are held by ``PairTable`` and,
for comparison, as one Python object per pair (a dataclass with the where/image/caption/label
strings and a ``(shard, offset, size)`` tuple: the representation before ``PairTable``). Bytes
are what ``tracemalloc`` counts as allocated by building each (Python objects and buffers).

Index: a shard of ``--shard-samples`` samples (an 8 x 8 PNG and a caption each) is indexed
by a scan of its headers and then read back from its cached index (``SHARD.tar.idx.json``).

    python benchmarks/clip_data_bench.py                   # 1M pairs, a 20,000-sample shard
    python benchmarks/clip_data_bench.py --pairs 100000 --json clip_data.json
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import random
import tarfile
import tempfile
import time
import tracemalloc
from dataclasses import dataclass

from megatron_tempnet.models.clip.data.pair_table import PairTable, scan_shard, shard_index


@dataclass
class ObjectPair:  # one Python object per pair (the representation PairTable replaced)
    where: str
    image: str | tuple[str, int, int]
    caption: str
    label: str


def _captions(n: int, seed: int = 0):
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10**6):06d}"[: rng.randrange(3, 9)] for _ in range(2000)]
    for i in range(n):
        yield i, " ".join(rng.choice(words) for _ in range(rng.randrange(8, 15)))


def _build_table(n: int) -> PairTable:
    table = PairTable()
    shard, manifest = table.source("/data/cc3m/00000.tar"), table.source("/data/cc3m/train.csv")
    for i, caption in _captions(n):
        if i % 2:
            table.add(manifest, str(i + 2), f"/data/cc3m/images/{i:09d}.jpg", caption, "")
        else:
            table.add(shard, f"{i:09d}", (1024 * i, 20000), caption, "")
    return table.freeze()


def _build_objects(n: int) -> list[ObjectPair]:
    out = []
    for i, caption in _captions(n):
        if i % 2:
            out.append(ObjectPair(f"/data/cc3m/train.csv:{i + 2}",
                                  f"/data/cc3m/images/{i:09d}.jpg", caption, ""))  # fmt: skip
        else:
            image = ("/data/cc3m/00000.tar", 1024 * i, 20000)
            out.append(ObjectPair(f"/data/cc3m/00000.tar:{i:09d}", image, caption, ""))
    return out


def _allocated(build, n: int) -> tuple[int, float]:
    gc.collect()
    tracemalloc.start()
    tic = time.perf_counter()
    held = build(n)
    seconds = time.perf_counter() - tic
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del held
    return current, seconds


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 30, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def _shard(path: str, samples: int) -> None:
    png = _png()
    with tarfile.open(path, "w") as tar:
        for i, caption in _captions(samples, seed=1):
            for suffix, data in ((".png", png), (".txt", caption.encode())):
                info = tarfile.TarInfo(f"{i:09d}{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=1_000_000)
    p.add_argument("--shard-samples", type=int, default=20_000)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    table_bytes, table_s = _allocated(_build_table, args.pairs)
    object_bytes, object_s = _allocated(_build_objects, args.pairs)
    with tempfile.TemporaryDirectory() as tmp:
        shard = os.path.join(tmp, "shard.tar")
        _shard(shard, args.shard_samples)
        tic = time.perf_counter()
        scan_shard(shard)
        scan_s = time.perf_counter() - tic
        shard_index(shard)  # writes the index
        tic = time.perf_counter()
        shard_index(shard)
        cached_s = time.perf_counter() - tic
        shard_mb = os.path.getsize(shard) / 1e6
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "pairs": args.pairs,
        "pair_table_bytes_per_pair": table_bytes / args.pairs,
        "python_objects_bytes_per_pair": object_bytes / args.pairs,
        "pair_table_build_s": table_s,
        "python_objects_build_s": object_s,
        "shard_samples": args.shard_samples,
        "shard_mb": shard_mb,
        "index_scan_s": scan_s,
        "index_cached_s": cached_s,
    }
    print(
        f"| pairs | PairTable B/pair | Python objects B/pair |\n|---|---|---|\n"
        f"| {args.pairs:,} | {table_bytes / args.pairs:.0f} | {object_bytes / args.pairs:.0f} |"
    )
    print(
        f"\n| shard samples | shard MB | header scan s | cached index s |\n|---|---|---|---|\n"
        f"| {args.shard_samples:,} | {shard_mb:.0f} | {scan_s:.2f} | {cached_s:.2f} |"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
