"""tools/visualize_tau.py: token colours from the colormap, escaping, PNG output, errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "visualize_tau.py")
RECORDS = [
    {
        "index": 0,
        "prompt": "a <p>",
        "tokens": [" x", "<b>", " &", "\n", "y"],
        "token_ids": [5, 6, 7, 8, 9],
        "tau": [0.5, 1.0, 1.5, 0.75, 1.25],
    },
    {"index": 3, "prompt": "q", "tokens": [" z"], "token_ids": [1], "tau": [1.1]},
]


def _run(tmp_path, *args, lines=None):
    path = tmp_path / "gen.jsonl"
    path.write_text(lines if lines is not None else "".join(json.dumps(r) + "\n" for r in RECORDS))
    prefix = tmp_path / "out" / "tau"
    cmd = [sys.executable, TOOL, "--input", str(path), "--output-prefix", str(prefix)]
    cmd += map(str, args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_html_colours_every_token_by_its_tau_and_png_is_drawn(tmp_path):
    import matplotlib
    from matplotlib.image import imread

    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "out" / "tau.html").read_text()
    spans = re.findall(
        r"<span style='background:(#[0-9a-f]{6})' title='id (\d+), tau "
        r"([0-9.]+)'>(.*?)</span>",
        page,
        flags=re.S,
    )
    tokens = [t for rec in RECORDS for t in rec["tokens"]]
    taus = [t for rec in RECORDS for t in rec["tau"]]
    assert [s[3] for s in spans] == [" x", "&lt;b&gt;", " &amp;", "\n", "y", " z"]
    cmap = matplotlib.colormaps["coolwarm"]
    for (hex_colour, _, shown, _), tau in zip(spans, taus):
        r_, g, b, _ = cmap((tau - 0.5) / (1.5 - 0.5))
        want = "#" + "".join(f"{round(c * 255):02x}" for c in (r_, g, b))
        assert hex_colour == want
        assert shown == f"{tau:.4f}"
    assert len(spans) == len(tokens) and "a &lt;p&gt;" in page
    image = imread(tmp_path / "out" / "tau.png")
    assert image.shape[0] > 50 and image.shape[1] > 200
    assert image[..., :3].reshape(-1, 3).std(0).max() > 0.05  # not one flat colour


def test_index_selection_and_fixed_range(tmp_path):
    r = _run(tmp_path, "--index", 3, "--format", "html", "--vmin", 1.0, "--vmax", 2.0)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "out" / "tau.html").read_text()
    assert "response 3: 1 tokens" in page and "response 0" not in page
    assert not (tmp_path / "out" / "tau.png").exists()


@pytest.mark.parametrize(
    "lines,args,message",
    [
        ('{"tokens": ["a"], "tau": [1.0]}\n{bad\n', [], "gen.jsonl:2"),
        ('{"tokens": ["a", "b"], "tau": [1.0]}\n', [], "2 tokens but 1 tau"),
        ('{"prompt": "x"}\n', [], "needs 'tokens' and 'tau'"),
        ('{"tokens": ["a"], "tau": [NaN]}\n', [], "not a finite number"),
        ("\n", [], "no responses"),
        (None, ["--index", 7], "--index 7"),
        (None, ["--cmap", "nope"], "--cmap 'nope'"),
    ],
)
def test_bad_input_is_named_and_writes_nothing(tmp_path, lines, args, message):
    r = _run(tmp_path, *args, lines=lines)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "tau.html").exists()
    assert not (tmp_path / "out" / "tau.png").exists()
