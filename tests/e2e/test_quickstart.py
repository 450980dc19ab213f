"""The README's quickstart: corpus -> tokenizer -> preprocessing -> TP = 2 training with TempNet."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "qs"
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "quickstart.py"), "--out", str(out),
         "--train-iters", "60"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [row for row in rows if "loss" in row]
    val = [row for row in rows if "val_ppl" in row]
    assert [row["iteration"] for row in train] == [25, 50, 60]
    assert train[-1]["ce_loss"] < train[0]["ce_loss"] and train[-1]["loss"] < train[0]["loss"]
    assert 0.05 <= train[-1]["tau_min"] <= train[-1]["tau_max"] <= 2.0
    assert len(val) == 3 and val[-1]["val_ppl"] < val[0]["val_ppl"]
    assert (out / "tokenizer.model").is_file()
    assert (out / "corpus_text_document.bin").stat().st_size > 100_000
    assert (out / "checkpoints" / "latest").read_text() == "iter_0000060"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    for line in ("[4/4] trained 60 iterations", "cross-entropy", "tau ", "TensorBoard",
                 str(out / "checkpoints" / "iter_0000060")):  # fmt: skip
        assert line in r.stdout, line
