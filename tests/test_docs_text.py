"""What a user reads: README.md, docs/ (development.md aside), the example workflows' Notes and the
nodes' tooltips speak to a ComfyUI user — no tracker numbers, no words about how the project is
developed, no paths outside the repository — and README's figures are the results files' own."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harness import paths

pytestmark = pytest.mark.core_independent  # runs on the ComfyUI 0.33 suite only

# What a reader cannot see or does not need: our tracker, how and where the project is built.
INTERNAL = [
    r"\bissues? \d+", r"\bitem \d+\b", r"\bsecond round\b", r"\bround \d\b", r"\.\./shared", r"\.ci/run",
    r"\bsession\b", r"device tool", r"development machine", r"\bengineers?\b", r"\bno GPU (?:was )?lent\b",
    r"/work/", r"CI minutes", r"\bCI's\b", r"first \d+ templates", r"\bthis project's shared\b",
]


def _user_texts() -> dict[str, str]:
    texts = {"README.md": (paths.REPO / "README.md").read_text()}
    for f in sorted((paths.REPO / "docs").glob("*.md")):
        if f.name != "development.md":
            texts[f"docs/{f.name}"] = f.read_text()
    for f in sorted((paths.REPO / "example_workflows").glob("*.json")):
        notes = [str(v) for n in json.loads(f.read_text())["nodes"] if n["type"] in ("Note", "MarkdownNote")
                 for v in n.get("widgets_values") or []]
        texts[f"example_workflows/{f.name} (Notes)"] = "\n".join(notes)
    for f in sorted((paths.REPO / "nodes").glob("*.py")):
        texts[f"nodes/{f.name}"] = "\n".join(re.findall(r'tooltip="([^"]*)"', f.read_text()))
    return texts


def test_user_texts_hold_no_internal_words():
    found = []
    for where, text in _user_texts().items():
        for i, line in enumerate(text.splitlines(), 1):
            for pattern in INTERNAL:
                m = re.search(pattern, line, flags=re.I)
                if m:
                    found.append(f"{where}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not found, "words for developers in what users read:\n" + "\n".join(found)


def test_the_check_catches_a_tracker_number():
    assert any(re.search(p, "What the new rows say (issue 25, second round)", flags=re.I) for p in INTERNAL)
    assert not any(re.search(p, "Run pip with the Python that runs ComfyUI", flags=re.I) for p in INTERNAL)


def test_readme_figures_come_from_the_results_files():
    proc = subprocess.run([sys.executable, str(paths.REPO / "scripts" / "docs_figures.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_format_table_results_are_complete_and_consistent():
    """benchmarks/results/formats.md (written by scripts/format_table.py, a benchmark run by hand)
    holds one row per (architecture, format) with one cell per node, each cell the result recorded
    in formats.json (exact / max err / refused with its message / ERROR / not run)."""
    res = json.loads((paths.REPO / "benchmarks" / "results" / "formats.json").read_text())
    md = (paths.REPO / "benchmarks" / "results" / "formats.md").read_text()
    words = {"exact": "exact", "error": "max err", "refused": "refused: ", "ERROR": "ERROR: ", "not run": "not run: "}
    rows = [line for line in md.splitlines() if line.startswith("| ") and " | " in line]
    for arch in res["archs"]:
        for fmt in res["formats"]:
            row = next(r for r in rows if r.startswith(f"| {arch} | {fmt} | "))
            cells = [c.strip() for c in row.strip("|").split(" | ")][2:]
            assert len(cells) == len(res["nodes"]), row
            for node, text in zip(res["nodes"], cells):
                cell = res["cells"][f"{arch}|{fmt}|{node}"]
                assert text.startswith(words[cell["result"]]), (arch, fmt, node, text)
                assert cell["result"] not in ("refused", "ERROR") or cell["message"], (arch, fmt, node)
                assert "left_files" not in cell, (arch, fmt, node, "a node left files behind")
    for s in res["streamed"]:
        assert s["streamed_bytes"] is None or s["streamed_bytes"] <= s["stored_bytes"], s
