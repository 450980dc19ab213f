"""The README's quickstart, as `make quickstart` runs it: corpus -> tokenizer -> preprocessing ->
a TP = 2 LM -> TempNet + LM under the DRO loss -> held-out perplexities and per-token tau."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(REPO, "examples", "quickstart.py")


def test_quickstart_trains_tempnet_whose_tau_varies_on_held_out_text(tmp_path):
    out = tmp_path / "qs"
    r = subprocess.run(
        [sys.executable, QUICKSTART, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the held-out spread, recomputed from every scored token's tau
    passages = [json.loads(line) for line in open(out / "heldout_tau.jsonl")]
    taus = [t for p in passages for t in p["tau"]]
    mean, std = statistics.fmean(taus), statistics.pstdev(taus)
    assert std / mean >= 0.05, (mean, std)
    printed = re.search(
        r"tau per token +mean ([\d.]+), std ([\d.]+) \(std / mean ([\d.]+)\)", r.stdout
    )
    assert printed, r.stdout
    assert [float(x) for x in printed.groups()] == [
        round(mean, 3),
        round(std, 3),
        round(std / mean, 2),
    ]
    # both perplexities, as tools/evaluate.py measured them, side by side
    summary = json.loads((out / "heldout_eval.json").read_text())
    assert summary["tokens"] == len(taus) and summary["tau_std"] > 0
    assert f"perplexity       {summary['ppl']:.1f} at tau = 1" in r.stdout
    assert f"T-LLM perplexity {summary['tllm_ppl']:.1f} with TempNet's tau" in r.stdout
    # the visualised passage: every token of it in the HTML, a PNG
    shown = int(
        re.search(r"tau of every token of passage (\d+): qs/tau.html, qs/tau.png", r.stdout)[1]
    )
    page = (out / "tau.html").read_text()
    assert page.count("<span style='background:") == len(passages[shown]["tau"]) + 2  # + legend
    assert (out / "tau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # two runs: the LM with cross-entropy, then TempNet with it under the DRO loss
    lm = [json.loads(line) for line in open(out / "lm.metrics.jsonl")]
    tempnet = [json.loads(line) for line in open(out / "tempnet.metrics.jsonl")]
    assert [row["iteration"] for row in lm] == [75, 150, 225, 300]
    assert lm[-1]["loss"] < lm[0]["loss"] and {row["tau_std"] for row in lm} == {0}
    assert [row["iteration"] for row in tempnet] == [50, 100, 150, 200]
    assert tempnet[-1]["tau_std"] > 0.05  # on training batches too
    assert tempnet[0]["tempnet_lr"] == 10 * tempnet[0]["lr"]  # --tempnet-lr 1e-2, --lr 1e-3
    assert (out / "lm" / "latest").read_text() == "iter_0000300"
    assert (out / "tempnet" / "latest").read_text() == "iter_0000200"
    # a short console: the framework's warnings are in the logs only
    logs = "".join((out / "logs" / f).read_text() for f in os.listdir(out / "logs"))
    assert "UserWarning" in logs  # megatron-core's, kept in the logs
    for noise in ("UserWarning", "Megatron-FSDP"):
        assert noise not in r.stdout + r.stderr, noise
    assert "[WARNING]" not in r.stdout + r.stderr  # DeepSpeed's (without DS_ACCELERATOR set)
    assert len(r.stdout.splitlines()) <= 25 and r.stderr == ""
    for line in (
        "[4/6] language model",
        "[5/6] TempNet + LM",
        "DRO loss",
        "tau 0.",
        "tensorboard --logdir qs/tensorboard",
        "qs/tempnet/iter_0000200",
    ):
        assert line in r.stdout, line


def test_a_failing_step_shows_its_error_and_the_end_of_its_log(tmp_path):
    """TP 3 cannot split the tiny model's 4 heads: pretrain_gpt.py's error reaches the console."""
    r = subprocess.run(
        [sys.executable, QUICKSTART, "--out", str(tmp_path / "qs"), "--nproc", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 1
    assert "error: --num-attention-heads (4)" in r.stdout, r.stdout
    assert "failed (exit 1); the end of qs/logs/lm.log:" in r.stdout
    assert "[5/6]" not in r.stdout
