"""The README's demo command (``scripts/demo.py``), on two of the example workflows: each beside
its plain baseline, in fresh servers, outputs copied, the table printed and written as Markdown
(what ``docs/demo.md`` is). The two are small ones: the demo's 2 GiB stand-in model and the
photograph's decode are the full demo's (``make demo``), not CI's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness import paths


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """Run ``scripts/demo.py`` with ``args`` in its own process group; on a timeout the whole group
    (the demo and the ComfyUI servers it started) is killed, so no server outlives the test."""
    import os
    import signal
    proc = subprocess.Popen([sys.executable, str(paths.REPO / "scripts" / "demo.py"), *args], cwd=paths.REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the demo ran past {timeout} s\n{out[-3000:]}{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_demo_runs_examples_beside_their_baselines(tmp_path, fixture_models):
    # an animated WEBP from a sampled video (peak from the first step on), and the sharded loaders
    # (peak over the whole run: loading is their technique)
    names = ["tiled_vae_wan21_t2v", "sharded_loaders_sd15"]
    out = tmp_path / "out"
    md = tmp_path / "demo.md"
    proc = _run(["--only", *names, "--out", str(out), "--json", str(tmp_path / "rows.json"), "--markdown", str(md)],
                timeout=900)
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


def test_demo_skips_a_template_this_comfyui_cannot_run():
    """``make demo`` runs every template: one this ComfyUI cannot run (the Flux 2 template before
    0.33) is skipped with the reason, not failed. No server starts when nothing is left to run."""
    from harness import examples
    name = "memory_plan_flux2_dev_16gb_vram_64gb_ram"
    why = examples.unavailable(name)
    if not why:
        pytest.skip("this ComfyUI runs the Flux 2 template (the demo runs it)")
    proc = _run(["--only", name], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{name}: skipped on this ComfyUI" in proc.stdout and "Nothing to run" in proc.stdout


@pytest.mark.core_independent
def test_docs_demo_shows_each_technique_saving():
    """``docs/demo.md`` (the demo's own output, quoted in the README) shows what each technique is for:
    Group Offload to disk, the device map with disk and Tiled VAE at most 0.75× the plain peak, the same
    output as plain (bit-exact, or within 0.05 for tiling), FP8's weight bytes at most 0.55× and a
    Memory Plan that chose something other than 'as loaded' for a machine the model is too big for."""
    import re
    text = (paths.REPO / "docs" / "demo.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if m:
            cells = [c.strip() for c in m.group(2).split("|")]
            rows[m.group(1)] = dict(ratio=float(cells[5].rstrip("×")), error=cells[7])
    for name in ("group_offload_wan21_t2v", "balanced_device_map_wan21_t2v", "tiled_vae_sd15"):
        assert rows[name]["ratio"] <= 0.75, (name, rows[name])
        err = rows[name]["error"]
        assert err == "bit-exact" or float(err) <= 0.05, (name, err)
    fp8 = re.search(r"FP8 Layerwise Cast: ([\d.]+) → ([\d.]+) MiB", text)
    assert fp8 and float(fp8.group(2)) <= 0.55 * float(fp8.group(1)), fp8
    plan = re.search(r"`memory_plan_wan22_16gb_vram_32gb_ram`: Memory Plan: ([^;]*)", text)
    assert plan and "as loaded" not in plan.group(1), plan
    assert "a photograph" in text and "trained TAEF2" in text
