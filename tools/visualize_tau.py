"""Render generated responses with every token coloured by its temperature (paper's Figure 10).

    python tools/visualize_tau.py --input gen.jsonl --output-prefix out/tau [--index 0 2] \
        [--format html png] [--cmap coolwarm] [--vmin 0.5 --vmax 1.5] [--width-chars 100]

Input: ``tools/generate.py``'s JSONL (``prompt``, ``tokens``, ``tau`` per line) or
``tools/evaluate.py``'s ``--per-token-output`` (held-out text: its first token as the prompt, each
later token coloured by the tau it was predicted with). Writes
``PREFIX.html`` (one page: the prompt in grey, each generated token on a background coloured by
its tau over [vmin, vmax], its id and tau on hover, a legend) and ``PREFIX.png`` (all selected
responses stacked, tokens wrapped at --width-chars, with a colour bar). vmin/vmax default to the
smallest and largest tau shown.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys


class VisualizeError(ValueError):
    """Bad input; names the file and line or the flag."""


def read_records(path: str, indices: list[int] | None) -> list[dict]:
    if not os.path.isfile(path):
        raise VisualizeError(f"--input {path}: no such file")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise VisualizeError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(r, dict) or "tokens" not in r or "tau" not in r:
                raise VisualizeError(f"{path}:{number}: needs 'tokens' and 'tau'")
            if len(r["tokens"]) != len(r["tau"]):
                raise VisualizeError(
                    f"{path}:{number}: {len(r['tokens'])} tokens but {len(r['tau'])} tau values"
                )
            if not all(isinstance(t, (int, float)) and math.isfinite(t) for t in r["tau"]):
                raise VisualizeError(f"{path}:{number}: a tau value is not a finite number")
            records.append(dict(r, index=r.get("index", len(records))))
    if not records:
        raise VisualizeError(f"--input {path}: no responses in it")
    if indices is None:
        return records
    by_index = {r["index"]: r for r in records}
    missing = [i for i in indices if i not in by_index]
    if missing:
        raise VisualizeError(f"--index {missing[0]}: no response with that index in {path}")
    return [by_index[i] for i in indices]


def colour(cmap, tau: float, vmin: float, vmax: float) -> str:
    """``#rrggbb`` of ``tau`` on ``cmap`` over [vmin, vmax] (clipped)."""
    x = 0.5 if vmax <= vmin else min(max((tau - vmin) / (vmax - vmin), 0.0), 1.0)
    r, g, b, _ = cmap(x)
    return "#{:02x}{:02x}{:02x}".format(*(round(c * 255) for c in (r, g, b)))


def render_html(records: list[dict], cmap, vmin: float, vmax: float) -> str:
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>tau per token</title>",
        "<style>body{font-family:monospace} .r{white-space:pre-wrap;margin:1em 0}"
        " .p{color:#888}</style></head><body>",
        f"<p>tau: <span style='background:{colour(cmap, vmin, vmin, vmax)}'>{vmin:.4f}"
        f"</span> &hellip; <span style='background:{colour(cmap, vmax, vmin, vmax)}'>"
        f"{vmax:.4f}</span></p>",
    ]
    for r in records:
        taus = r["tau"]
        summary = (
            f"response {r['index']}: {len(taus)} tokens, tau mean "
            f"{sum(taus) / max(len(taus), 1):.4f}, min {min(taus, default=0):.4f}, "
            f"max {max(taus, default=0):.4f}"
        )
        spans = []
        ids = r.get("token_ids") or r.get("targets") or [None] * len(taus)
        for text, tau, tid in zip(r["tokens"], taus, ids):
            title = f"id {tid}, tau {tau:.4f}" if tid is not None else f"tau {tau:.4f}"
            spans.append(
                f"<span style='background:{colour(cmap, tau, vmin, vmax)}' "
                f"title='{title}'>{html.escape(text)}</span>"
            )
        parts.append(
            f"<p>{html.escape(summary)}</p><div class='r'><span class='p'>"
            f"{html.escape(r.get('prompt', ''))}</span>{''.join(spans)}</div>"
        )
    parts.append("</body></html>\n")
    return "".join(parts)


def render_png(records: list[dict], cmap, vmin: float, vmax: float, width: int, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: list[list[tuple[str, float]]] = []
    for r in records:
        lines.append([(f"[{r['index']}] ", math.nan)])
        for text, tau in zip(r["tokens"], r["tau"]):
            for k, piece in enumerate(text.split("\n")):
                if k:
                    lines.append([])
                shown = piece.replace(" ", "\u00b7") or "\u00b7"
                if sum(len(t) for t, _ in lines[-1]) + len(shown) > width:
                    lines.append([])
                lines[-1].append((shown, tau))
    fig, ax = plt.subplots(figsize=(0.11 * width + 1.5, 0.3 * len(lines) + 0.8))
    ax.set_xlim(0, width), ax.set_ylim(len(lines), 0), ax.axis("off")
    for row, line in enumerate(lines):
        x = 0
        for text, tau in line:
            face = "white" if math.isnan(tau) else colour(cmap, tau, vmin, vmax)
            ax.text(
                x,
                row + 0.5,
                text,
                family="monospace",
                fontsize=9,
                va="center",
                bbox=dict(facecolor=face, edgecolor="none", pad=1),
            )
            x += len(text)
    mappable = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(vmin, vmax))
    fig.colorbar(mappable, ax=ax, label="tau", fraction=0.03)
    fig.savefig(path, dpi=100, bbox_inches="tight", format="png")
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, help="tools/generate.py output (JSONL)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.html and PREFIX.png")
    p.add_argument("--index", type=int, nargs="+", help="responses to show (default: all)")
    p.add_argument("--format", nargs="+", choices=["html", "png"], default=["html", "png"])
    p.add_argument("--cmap", default="coolwarm", help="a matplotlib colormap")
    p.add_argument("--vmin", type=float)
    p.add_argument("--vmax", type=float)
    p.add_argument("--width-chars", type=int, default=100, help="PNG line width")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    records = read_records(args.input, args.index)
    taus = [t for r in records for t in r["tau"]] or [0.0]
    vmin = min(taus) if args.vmin is None else args.vmin
    vmax = max(taus) if args.vmax is None else args.vmax
    try:
        import matplotlib
    except ImportError:
        raise VisualizeError(
            "tools/visualize_tau.py needs matplotlib: pip install matplotlib"
        ) from None
    if args.cmap not in matplotlib.colormaps:
        raise VisualizeError(f"--cmap {args.cmap!r} is not a matplotlib colormap")
    cmap = matplotlib.colormaps[args.cmap]
    out = args.output_prefix
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if "html" in args.format:
        with open(out + ".html.partial", "w", encoding="utf-8") as f:
            f.write(render_html(records, cmap, vmin, vmax))
        os.replace(out + ".html.partial", out + ".html")
    if "png" in args.format:
        render_png(records, cmap, vmin, vmax, args.width_chars, out + ".png.partial")
        os.replace(out + ".png.partial", out + ".png")
    print(
        f"wrote {', '.join(out + '.' + f for f in args.format)}: {len(records)} response(s), "
        f"tau in [{vmin:.4f}, {vmax:.4f}]"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except VisualizeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
