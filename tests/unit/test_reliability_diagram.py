"""tools/reliability_diagram.py: the lines drawn are the evaluate output's bins, one per tau
source, the PNG is written, and bad inputs are named."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "reliability_diagram.py")


def _summary(source: str, seed: int) -> dict:
    """An evaluate output's shape: per tau source, ECE and bins."""

    def bins(k):
        return [dict(low=i / 15, high=(i + 1) / 15, count=10 + i + k,
                     confidence=(i + 0.5) / 15, accuracy=min(1.0, (i + 0.3 * k) / 15))
                for i in range(seed, 15, 3)]  # fmt: skip

    calibration = {
        "tau_1": {"ece": 0.05, "bins": bins(0)},
        "scored": {"ece": 0.02, "bins": bins(1)},
    }
    if source == "newton":
        calibration["tempnet"] = {"ece": 0.03, "bins": bins(2)}
    return {"tau_source": source, "tau_mean": 0.9, "calibration": calibration}


def test_the_lines_are_the_bins_of_every_tau_source(tmp_path):
    spec = importlib.util.spec_from_file_location("reliability_diagram", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    a, b = _summary("tempnet", 0), _summary("newton", 1)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    panels = [("A", tool.series(a, tool.SOURCES)), ("B", tool.series(b, tool.SOURCES))]
    fig = tool.figure(panels)
    for ax, (summary, labels) in zip(
        fig.axes,
        [(a, ["tau = 1: ECE 0.0500", "TempNet: ECE 0.0200"]),
         (b, ["tau = 1: ECE 0.0500", "per-token DRO optimum: ECE 0.0200", "TempNet: ECE 0.0300"])],
    ):  # fmt: skip
        assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
        sources = [s for s in ("tau_1", "scored", "tempnet") if s in summary["calibration"]]
        for line, source in zip(ax.lines, sources):
            want = summary["calibration"][source]["bins"]
            assert line.get_xydata().tolist() == [[x["confidence"], x["accuracy"]] for x in want]
        assert ax.lines[len(sources)].get_xydata().tolist() == [[0, 0], [1, 1]]  # the diagonal
    out = tmp_path / "d" / "r.png"
    r = subprocess.run([sys.executable, TOOL, "--input", f"CE={tmp_path / 'a.json'}",
                        str(tmp_path / "b.json"), "--output", str(out)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "CE | tau = 1 | ECE 0.0500 | (0.033, 0.000, n=10)," in r.stdout
    assert "b.json | TempNet | ECE 0.0300" in r.stdout
    (tmp_path / "plain.json").write_text(json.dumps({"ppl": 3.0}))
    for args, expect in (
        (["--input", str(tmp_path / "nope.json")], "--input " + str(tmp_path / "nope.json")),
        (["--input", str(tmp_path / "plain.json")], "no calibration in it"),
        (["--input", str(tmp_path / "a.json"), "--sources", "best_fixed"], "none of --sources"),
    ):
        r = subprocess.run([sys.executable, TOOL, *args, "--output", str(tmp_path / "x.png")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 1 and expect in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "x.png").exists()
