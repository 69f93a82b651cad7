"""The GPU runbook's driver: runs the plan (:mod:`benchmarks.rb_plan`) in worker processes
(:mod:`benchmarks.rb_worker`) within one time budget, and reports as it goes.

    python -m benchmarks.runbook --device cuda --out DIR [--budget 510] [--t0 EPOCH] [--cases a,b]
    python -m benchmarks.runbook --device cpu --out DIR          # dry run on the tiny model (CI)

Into ``--out`` (at most 5 files, the device tool brings back 8):
- ``runbook.jsonl``: one JSON line per case, written and flushed as soon as the case ends;
- ``results.json``: ``{"meta", "results"}`` rewritten atomically after every case;
- ``table.md`` and ``plot.png`` at the end; ``runbook.log`` is the shell's merged log.

Every planned case gets exactly one row: its figures, or ``error`` (it raised, or its worker
died: the worker is restarted for the rest), or ``skipped`` (``budget: ...`` when its
estimate no longer fits, ``needs cuda: ...`` in the dry run). A rerun into the same folder
(or with ``--resume FILE``) keeps the rows already measured and runs only the others.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .rb_plan import PLAN, WORKER_START_S, PlannedCase

REPO = Path(__file__).resolve().parents[1]
MARGIN_S = 8.0  # kept back from the budget: the final table and plot, process teardown


def write_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def final(row: dict) -> bool:
    """A row that a rerun keeps: measured, or skipped for a reason other than the budget."""
    return "error" not in row and not str(row.get("skipped", "")).startswith("budget")


class Runbook:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = args.t0 or time.time()
        self.deadline = self.t0 + args.budget - MARGIN_S
        self.cpu = args.device == "cpu"
        self.results_path = self.out / "results.json"
        self.jsonl = open(self.out / "runbook.jsonl", "a", buffering=1)
        self.rows: dict[str, dict] = {}
        prev = Path(args.resume) if args.resume else self.results_path
        if prev.is_file():
            for r in json.loads(prev.read_text()).get("results", []):
                if final(r):
                    self.rows[r["case"]] = {**r, "from_earlier_run": True}
        wanted = set(filter(None, (args.cases or "").split(",")))
        self.plan = [c for c in PLAN if not wanted or c.name in wanted or c.name == "env"]
        self.meta = {"started": dt.datetime.fromtimestamp(self.t0, dt.timezone.utc).isoformat(timespec="seconds"),
                     "device": args.device, "tiny": self.cpu or args.tiny, "budget_s": args.budget,
                     "comfyui_path": os.environ.get("COMFYUI_PATH", "(default tree)"), "planned": len(self.plan)}

    def left(self) -> float:
        return self.deadline - time.time()

    def record(self, row: dict) -> None:
        row.setdefault("t_s", round(time.time() - self.t0, 1))
        self.rows[row["case"]] = row
        self.jsonl.write(json.dumps(row, default=str) + "\n")
        self.jsonl.flush()
        os.fsync(self.jsonl.fileno())
        self.save()
        state = "ERROR " + row["error"] if "error" in row else ("skipped: " + row["skipped"] if "skipped" in row
                                                                 else "ok")
        print(f"[runbook {row['t_s']:>6.1f}s] {row['case']}: {state[:160]}", flush=True)

    def save(self) -> None:
        order = {c.name: i for i, c in enumerate(PLAN)}
        rows = sorted(self.rows.values(), key=lambda r: order.get(r["case"], 1e9))
        self.meta["elapsed_s"] = round(time.time() - self.t0, 1)
        write_atomic(self.results_path, {"meta": self.meta, "results": rows})

    def est(self, c: PlannedCase) -> float:
        return c.cpu_est_s if self.cpu else c.est_s

    # -- workers --------------------------------------------------------------------------------

    def run_segment(self, group: str, cases: list[PlannedCase]) -> None:
        todo = [c.name for c in cases]
        while todo:
            start = WORKER_START_S["cpu" if self.cpu else "cuda"]
            if self.left() < start + min(self.est(c) for c in cases if c.name in todo):
                for name in todo:
                    self.record({"case": name, "group": group,
                                 "skipped": f"budget: {self.left():.0f} s left, a worker needs {start:.0f} s to start"})
                return
            todo = self.run_worker(group, todo)

    def run_worker(self, group: str, todo: list[str]) -> list[str]:
        """Start one worker for ``todo``; returns the cases still without a row when it ends."""
        cmd = [sys.executable, "-m", "benchmarks.rb_worker", "--group", group, "--device", self.args.device,
               "--cases", ",".join(todo), "--deadline", str(self.deadline), "--scratch", str(self.scratch),
               "--results", str(self.results_path)] + (["--tiny"] if self.meta["tiny"] else [])
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: ([lines.put(ln) for ln in proc.stdout], lines.put(None)), daemon=True).start()
        current, tail, remaining = None, [], list(todo)
        while True:
            try:
                ln = lines.get(timeout=1.0)
            except queue.Empty:
                ln = ""
            if ln is None:
                break
            if ln.startswith("@@START "):
                current = ln[8:].strip()
                tail = []
            elif ln.startswith("@@ROW "):
                row = json.loads(ln[6:])
                self.record(row)
                if row["case"] in remaining:
                    remaining.remove(row["case"])
                current = None
            elif ln:
                sys.stdout.write(f"  [{group}] {ln}")
                tail = (tail + [ln.rstrip()])[-15:]
            if time.time() > self.deadline + MARGIN_S / 2 and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                if current:
                    self.record({"case": current, "group": group, "error": "killed: the time budget ran out mid-case",
                                 "log_tail": tail})
                    remaining.remove(current)
                for name in remaining:
                    self.record({"case": name, "group": group, "skipped": "budget: worker stopped at the deadline"})
                proc.wait()
                return []
        rc = proc.wait()
        if current:  # died inside a case: that case is an error, the worker restarts for the rest
            self.record({"case": current, "group": group, "error": f"worker died (exit {rc}) in this case",
                         "log_tail": tail})
            remaining.remove(current)
            return remaining
        for name in remaining:
            self.record({"case": name, "group": group, "error": f"worker ended (exit {rc}) without a row",
                         "log_tail": tail})
        return []

    # -- anchor ---------------------------------------------------------------------------------

    def run_anchor(self, c: PlannedCase) -> None:
        script = REPO / "gpu_bundle" / "anchor_flux.py"
        if self.cpu:
            return self.record({"case": c.name, "group": c.group, "skipped": "needs cuda: the anchor builds the full model"})
        if not script.is_file():
            return self.record({"case": c.name, "group": c.group, "skipped": f"no anchor script ({script})"})
        timeout = self.left()
        if timeout < 60:
            return self.record({"case": c.name, "group": c.group, "skipped": f"budget: {timeout:.0f} s left"})
        env = {**os.environ, "DEV": "cuda", "DEPTH": "8", "SINGLE": "16", "RES": "1024", "ITERS": "3",
               "PYTHONUNBUFFERED": "1"}
        t = time.time()
        try:
            p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
                (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or ""), "timeout"
        sys.stdout.write("".join(f"  [anchor] {ln}\n" for ln in err.splitlines()))
        rows = []
        for ln in out.splitlines():  # JSON lines only: stderr never mixes in
            try:
                rows.append(json.loads(ln))
            except ValueError:
                sys.stdout.write(f"  [anchor stdout] {ln}\n")
        row = {"case": c.name, "group": c.group, "lines": rows, "exit": rc, "wall_s": round(time.time() - t, 1)}
        if rc != 0:
            row["error"] = f"anchor exit {rc}: {err.strip().splitlines()[-1] if err.strip() else ''}"
        self.record(row)

    # -- all ------------------------------------------------------------------------------------

    def run(self) -> dict:
        import hashlib
        import tempfile
        # Reference outputs shared by the workers of this run and its reruns (not in --out: ≤ 8 files).
        key = hashlib.sha1(f"{self.out.resolve()}|{os.environ.get('COMFYUI_PATH', '')}".encode()).hexdigest()[:10]
        self.scratch = Path(os.environ.get("RUNBOOK_SCRATCH") or Path(tempfile.gettempdir()) / f"mk-runbook-{key}")
        self.scratch.mkdir(parents=True, exist_ok=True)
        todo = [c for c in self.plan if c.name not in self.rows]
        print(f"[runbook] {len(todo)} of {len(self.plan)} cases to run, {self.left():.0f} s of budget left "
              f"({len(self.plan) - len(todo)} done in an earlier run)", flush=True)
        i = 0
        while i < len(todo):
            j = i
            while j < len(todo) and todo[j].group == todo[i].group:
                j += 1
            seg = todo[i:j]
            if seg[0].group == "anchor":
                for c in seg:
                    self.run_anchor(c)
            else:
                self.run_segment(seg[0].group, seg)
            i = j
        self.save()
        self.finish()
        if all(final(self.rows.get(c.name, {"error": "no row"})) for c in self.plan):
            import shutil  # nothing left to rerun: the scratch folder (reference outputs) goes
            shutil.rmtree(self.scratch, ignore_errors=True)
        return {"meta": self.meta, "results": list(self.rows.values())}

    def finish(self) -> None:
        rows = [self.rows[c.name] for c in self.plan if c.name in self.rows]
        n_err = sum("error" in r for r in rows)
        n_skip = sum("skipped" in r for r in rows)
        lines = [f"# MemoryKit GPU runbook ({self.meta['device']}, {self.meta['started']})", "",
                 f"{len(rows) - n_err - n_skip} measured, {n_err} errors, {n_skip} skipped; "
                 f"{time.time() - self.t0:.0f} s of {self.args.budget} s", "",
                 "| case | res | s/fwd | × resident | × floor | peak VRAM GiB | device peak GiB | H2D GB/fwd | rel err | note |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        g = lambda b: "" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
        f = lambda v, p=3: "" if v is None else f"{v:.{p}f}"  # noqa: E731
        gb = lambda b: "" if b is None else f"{b / 1e9:.2f}"  # noqa: E731
        for r in rows:
            note = r.get("error") or r.get("skipped") or ", ".join(
                f"{k}={r[k]}" for k in r if k.startswith("check_") or k in ("exact", "ok"))
            lines.append(f"| {r['case']} | {r.get('res', '')} | {f(r.get('s_per_forward', r.get('s_per_decode')), 4)} "
                         f"| {f(r.get('ratio_to_resident', r.get('ratio_to_untiled')))} | {f(r.get('ratio_to_floor'))} "
                         f"| {g(r.get('peak_vram_bytes'))} | {g(r.get('peak_device_bytes'))} "
                         f"| {gb(r.get('h2d_bytes_per_forward'))} "
                         f"| {f(r.get('rel_err_vs_resident', r.get('rel_err_vs_untiled')), 4)} | {str(note)[:120]} |")
        (self.out / "table.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)
        try:
            from .plot import plot
            env = self.rows.get("env", {})
            pts = [{**r, "group": "memorykit" if r["case"].startswith(("mk_", "optout")) else "baseline"}
                   for r in rows if "s_per_forward" in r and "skipped" not in r and "error" not in r]
            plot({"meta": {"device": env.get("device_name", self.meta["device"]),
                           "h2d_pinned_bytes_per_s": env.get("h2d_pinned_bytes_per_s")}, "results": pts},
                 self.out / "plot.png")
        except Exception as e:  # the plot is a convenience; the JSON is the result
            print(f"[runbook] no plot: {type(e).__name__}: {e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="the tiny model on a GPU too (a smoke run)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=510.0, help="seconds for everything since --t0")
    ap.add_argument("--t0", type=float, default=None, help="epoch seconds the budget counts from (the shell's start)")
    ap.add_argument("--cases", help="comma-separated case names (env always runs)")
    ap.add_argument("--resume", help="a results.json of an earlier run whose finished cases are kept")
    args = ap.parse_args(argv)
    data = Runbook(args).run()
    return 0 if data["results"] else 1


if __name__ == "__main__":
    sys.exit(main())
