"""The README's demo command (``scripts/demo.py``), on two of the example workflows: each beside
its plain baseline, in fresh servers, outputs copied, the table printed and written as Markdown
(what ``docs/demo.md`` is). The two are small ones: the demo's 2 GiB stand-in model and the
photograph's decode are the full demo's (``make demo``), not CI's."""
from __future__ import annotations

import json
import subprocess
import sys

from harness import paths


def test_demo_runs_examples_beside_their_baselines(tmp_path, fixture_models):
    # an animated WEBP from a sampled video (peak from the first step on), and the sharded loaders
    # (peak over the whole run: loading is their technique)
    names = ["tiled_vae_wan21_t2v", "sharded_loaders_sd15"]
    out = tmp_path / "out"
    md = tmp_path / "demo.md"
    proc = subprocess.run([sys.executable, str(paths.REPO / "scripts" / "demo.py"), "--only", *names,
                           "--out", str(out), "--json", str(tmp_path / "rows.json"), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=900, cwd=paths.REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "rows.json").read_text())
    rows = result["rows"]
    assert [r["name"] for r in rows] == names
    for r in rows:
        assert r["plain"]["status"] == r["memorykit"]["status"] == "success", r
        assert r["figures"], f"{r['name']}: no node figures in the table"
        for side in ("plain", "memorykit"):
            assert any((out / r["name"] / side).iterdir()), f"{r['name']}: no {side} output copied"
    tiled, sharded = rows
    assert (tiled["peak_kind"], sharded["peak_kind"]) == ("S", "W")
    for side in ("plain", "memorykit"):  # the window from the first sampling step is read, and lies inside the run
        assert 0 < tiled[side]["peak_sampling_bytes"] <= tiled[side]["peak_rss_bytes"]
    assert tiled["error"] not in ("-", "shape differs"), tiled["error"]  # the frames were compared
    assert list((out / names[0] / "memorykit").glob("*.webp")), "the animated WEBP was not copied"
    assert "random weights" in proc.stdout and "MK/plain" in proc.stdout and "RAM does the work VRAM does" in proc.stdout
    text = md.read_text()
    assert "| workflow |" in text and f"| `{names[0]}` |" in text and text.count("\nMeasured: ") == 1
