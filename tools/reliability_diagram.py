"""Reliability diagrams of ``tools/evaluate.py --calibration`` outputs: per tau source, the
accuracy of the top-1 prediction against its confidence in each bin.

    python tools/reliability_diagram.py --input "CE=ce.json" "DRO TempNet=dro.json" \
        --output reliability.png [--sources tau_1 scored best_fixed tempnet]

One panel per input (``NAME=FILE``, or a file, named by its file name), one line per tau source
in its ``calibration`` (tau = 1, the scored tau, TempNet's beside ``newton``, the grid's best
fixed tau), its ECE in the legend; points are the non-empty bins (equal-width bins of the
top-1 probability), the diagonal is perfect calibration. Prints each line's points.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_tempnet.utils.cli import UserError, run_tool

SOURCES = ("tau_1", "scored", "best_fixed", "tempnet")


class DiagramError(UserError, ValueError):
    """Bad input; names the file or the flag."""


def read_input(spec: str) -> tuple[str, dict]:
    """``NAME=FILE`` or ``FILE`` -> (the panel's name, the evaluate output)."""
    name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
    if not os.path.isfile(path):
        raise DiagramError(f"--input {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except json.JSONDecodeError as e:
        raise DiagramError(f"--input {path}: not valid JSON ({e.msg})") from None
    if not isinstance(summary, dict) or "calibration" not in summary:
        raise DiagramError(f"--input {path}: no calibration in it (run tools/evaluate.py with "
                           "--calibration)")  # fmt: skip
    return name or os.path.basename(path), summary


def label(source: str, summary: dict) -> str:
    """The legend's name of a tau source of one evaluate output."""
    if source == "tau_1":
        return "tau = 1"
    if source == "best_fixed":
        return f"best fixed tau ({summary['best_fixed_tau']:g})"
    if source == "tempnet":
        return "TempNet"
    kind = summary.get("tau_source", "tempnet")
    if kind == "fixed":
        return f"tau = {summary['tau_mean']:g}"
    return {"tempnet": "TempNet", "newton": "per-token DRO optimum"}.get(kind, kind)


def series(summary: dict, sources: tuple[str, ...]) -> list[dict]:
    """Per tau source present: its label, ECE and the bins' confidence, accuracy and count."""
    out = []
    for source in sources:
        values = summary["calibration"].get(source)
        fixed_at_1 = summary.get("tau_source") == "fixed" and summary.get("tau_mean") == 1
        if values is None or (source == "scored" and fixed_at_1 and "tau_1" in sources):
            continue  # (a fixed tau of 1 is the tau = 1 line)
        bins = values["bins"]
        out.append({
            "source": source,
            "label": label(source, summary),
            "ece": values["ece"],
            "confidence": [b["confidence"] for b in bins],
            "accuracy": [b["accuracy"] for b in bins],
            "count": [b["count"] for b in bins],
        })  # fmt: skip
    return out


def figure(panels: list[tuple[str, list[dict]]]):
    """The matplotlib figure: one axes per panel, one line per series (in order), then the
    diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), squeeze=False)
    for ax, (name, lines) in zip(axes[0], panels):
        for line in lines:
            ax.plot(line["confidence"], line["accuracy"], marker="o", markersize=3,
                    label=f"{line['label']}: ECE {line['ece']:.4f}")  # fmt: skip
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
        ax.set(title=name, xlabel="confidence (top-1 probability)", xlim=(0, 1), ylim=(0, 1))
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="tools/evaluate.py --calibration outputs, NAME=FILE or FILE")  # fmt: skip
    p.add_argument("--output", required=True, help="the PNG file to write")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                   help="tau sources to draw where present (default: all)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    panels = []
    for spec in args.input:
        name, summary = read_input(spec)
        lines = series(summary, tuple(args.sources))
        if not lines:
            raise DiagramError(f"--input {spec}: none of --sources {' '.join(args.sources)} "
                               "in its calibration")  # fmt: skip
        panels.append((name, lines))
    try:
        fig = figure(panels)
    except ImportError:
        raise DiagramError("tools/reliability_diagram.py needs matplotlib") from None
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fig.savefig(args.output + ".partial", dpi=100, format="png")
    os.replace(args.output + ".partial", args.output)
    for name, lines in panels:
        for line in lines:
            rows = zip(line["confidence"], line["accuracy"], line["count"])
            points = ", ".join(f"({c:.3f}, {a:.3f}, n={n})" for c, a, n in rows)
            print(f"{name} | {line['label']} | ECE {line['ece']:.4f} | {points}")
    print(f"wrote {args.output}: {len(panels)} panel(s)")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
