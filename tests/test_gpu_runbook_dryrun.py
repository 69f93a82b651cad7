"""The GPU runbook's ``DEVICE=cpu`` dry run, end to end, as the GPU machine would run it (same
shell script, same 510 s budget) on the tiny model: a broken runbook is caught here, before a
GPU is ever lent.

One run with an injected failing case and an injected worker crash, a rerun into the same
folder, and a run whose budget is already spent.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import paths

sys.path.insert(0, str(paths.REPO))
from benchmarks.rb_plan import PLAN  # noqa: E402

sys.path.remove(str(paths.REPO))

FAIL, CRASH = "mk_fp8_resident_1024", "comfy_fp8_resident_1024"


def runbook(out, tmp_path, **env):
    e = {**os.environ, "DEVICE": "cpu", "OUT": str(out), "PYTHON": sys.executable,
         "RUNBOOK_SCRATCH": str(tmp_path / "scratch"), **env}
    for k in ("MK_RUNBOOK_FAIL", "MK_RUNBOOK_CRASH"):
        if k not in env:
            e.pop(k, None)
    proc = subprocess.run(["bash", str(paths.REPO / "benchmarks" / "gpu_runbook.sh")], env=e, cwd=paths.REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = {r["case"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    lines = [json.loads(ln) for ln in (out / "runbook.jsonl").read_text().splitlines()]
    return proc, rows, lines


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runbook")
    out = tmp / "out"
    return (tmp, out) + runbook(out, tmp, MK_RUNBOOK_FAIL=FAIL, MK_RUNBOOK_CRASH=CRASH)


def test_every_case_one_row_as_it_goes(first_run):
    tmp, out, proc, rows, lines = first_run
    assert [r["case"] for r in lines] == [c.name for c in PLAN]  # one line per case, in plan order
    assert set(rows) == {c.name for c in PLAN}
    assert len(list(out.iterdir())) <= 8, sorted(p.name for p in out.iterdir())
    assert {p.name for p in out.iterdir()} >= {"results.json", "runbook.jsonl", "runbook.log", "table.md"}
    assert "[runbook.sh] done rc=0" in (out / "runbook.log").read_text()


def test_injected_failure_and_crash_are_error_rows_and_the_run_goes_on(first_run):
    _, _, _, rows, _ = first_run
    assert "injected failure" in rows[FAIL]["error"]
    assert "worker died" in rows[CRASH]["error"]
    errors = {n for n, r in rows.items() if "error" in r}
    assert errors == {FAIL, CRASH}, {n: rows[n]["error"] for n in errors - {FAIL, CRASH}}
    after = [c.name for c in PLAN][[c.name for c in PLAN].index(FAIL) + 1]
    assert "s_per_forward" in rows[after]  # the restarted worker measured the cases after the crash


def test_dry_run_figures(first_run):
    _, _, _, rows, _ = first_run
    for name, r in rows.items():
        if name.startswith("ring_") and "skipped" not in r:
            assert r["ok"] and r["exact"], r
    assert rows["resident_1024"]["rel_err_vs_resident"] == 0.0
    for name in ("mk_offload_ring_cap25_1024", "comfy_lowvram_cap25_1024", "mk_device_map_cuda0_cpu_1024"):
        assert rows[name]["skipped"].startswith("needs cuda"), rows[name]
        assert rows[name]["rel_err_vs_resident"] == 0.0, rows[name]  # its code path ran, exactly
    assert rows["mk_offload_fp8_cap25_1024"]["rel_err_vs_resident"] < 0.25
    comp = rows["compile_offload_recompiles_1024"]
    assert comp["skipped"].startswith("needs cuda") and comp["cycles"] > comp["recompile_limit"], comp
    assert comp["rel_err_last_vs_first"] == 0.0, comp
    for name in ("core_dynamic_cap25_1024", "fp8_dynamic_cap25_1024", "optout_group_offload_dynamic",
                 "fp8_lora_dynamic_vs_full", "dynamic_budgets", "anchor_flux"):
        assert rows[name]["skipped"].startswith("needs cuda"), rows[name]
    for name in ("vae_untiled_2048", "vae_core_tiled_2048_512_64", "vae_mk_tiled_2048_512_64"):
        assert rows[name]["inference_mode"] and not rows[name]["requires_grad"], rows[name]
    assert rows["vae_mk_tiled_2048_512_64"]["rel_err_vs_untiled"] < 0.5


def test_rerun_runs_only_what_is_not_done(first_run):
    tmp, out, _, _, lines_before = first_run
    proc, rows, lines = runbook(out, tmp)
    new = lines[len(lines_before):]
    assert sorted(r["case"] for r in new) == sorted([FAIL, CRASH])
    assert not any("error" in r for r in rows.values())
    assert rows["resident_1024"].get("from_earlier_run")
    assert "2 of" in proc.stdout and "to run" in proc.stdout


def test_spent_budget_skips_everything(tmp_path):
    proc, rows, lines = runbook(tmp_path / "out", tmp_path, BUDGET_S="5")
    assert len(lines) == len(PLAN)
    assert all(r["skipped"].startswith(("budget", "needs cuda")) for r in rows.values()), rows
