"""Read what an offline Weights & Biases run recorded (its ``run-<id>.wandb`` file).

The file is a ``:W&B`` header (7 bytes) followed by LevelDB-log framed records in 32 KiB blocks:
each fragment has a 4-byte checksum, a 2-byte little-endian length and a 1-byte type (1 whole,
2 first, 3 middle, 4 last); a block's tail shorter than a fragment header is padding. Each record
is a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import glob
import json
import os
import struct

_BLOCK, _HEADER = 32768, 7


def _records(path: str):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # padding at the end of a block
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if length == 0 and kind == 0:  # zero padding
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        pending += chunk
        if kind in (1, 4):
            yield pending
            pending = b""


def read_offline_run(save_dir: str) -> dict:
    """``{"name", "project", "config": {key: value}, "history": [{key: value}],
    "histograms": {key: [counts per logged step]}}`` of the one offline run under
    ``save_dir/wandb``."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs
    out: dict = {"config": {}, "history": [], "histograms": {}}
    for raw in _records(runs[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["project"] = record.run.display_name, record.run.project
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            out["history"].append(_histograms(row, out["histograms"]))
    return out


def _histograms(row: dict, histograms: dict) -> dict:
    """``row`` without its histograms' fields (``tau/histogram/{_type,values,bins}``); each
    histogram's counts are appended to ``histograms[key]``."""
    for key in [k[: -len("/_type")] for k, v in row.items() if v == "histogram"]:
        histograms.setdefault(key, []).append(row[f"{key}/values"])
        row = {k: v for k, v in row.items() if not k.startswith(key + "/")}
    return row
