"""`python -m benchmarks.run --quick` runs on CPU and its JSON is complete and within tolerance.

On the runbook dry run's narrow Flux-shaped model (``--tiny``: hidden 128, same classes, same cases
and code paths): what is checked here is the harness (every case a row, exact paths bit-exact, fp8
within its tolerance, table and plot), which the 2.2 GB model only made slower (214 s in CI)."""
from __future__ import annotations

import json
import subprocess
import sys

from harness import paths


def test_quick_benchmark_json(tmp_path, fixture_models):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--tiny", "--out", str(out)],
                          cwd=paths.REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    sys.path.insert(0, str(paths.REPO))
    try:
        from benchmarks.cases import all_cases
    finally:
        sys.path.remove(str(paths.REPO))
    by_case = {}
    for r in data["results"]:
        by_case.setdefault(r["case"], []).append(r)
    for case in all_cases():
        rows = by_case.get(case.name)
        assert rows, f"case {case.name} missing from the JSON"
        if case.gpu_only:
            assert rows[0]["skipped"] == case.gpu_only
            continue
        for r in rows:
            assert "error" not in r, r
            assert r["s_per_forward"] > 0 and r["rss_bytes"] > 0
            assert r["within_tolerance"] in (True, None), r
            if r["tolerance"] == 0.0:
                assert r["rel_err_vs_resident"] == 0.0, r
    assert (out.with_suffix(".png")).stat().st_size > 1000
    assert "resident" in proc.stdout
