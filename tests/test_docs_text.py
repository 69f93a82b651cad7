"""What a user reads: README.md, docs/ (development.md aside), the example workflows' Notes and the
nodes' tooltips speak to a ComfyUI user — no tracker numbers, no words about how the project is
developed, no paths outside the repository — and README's figures are the results files' own."""
from __future__ import annotations

import ast
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
    texts.update(_node_texts())
    return texts


def _node_texts() -> dict[str, str]:
    """Every tooltip and description in nodes/, whole: a tooltip written as several string literals
    on several lines is one constant in the syntax tree (a regex over the source saw only its first
    line), and one built from module-level constants is followed to them."""
    texts = {}
    for f in sorted((paths.REPO / "nodes").glob("*.py")):
        tree = ast.parse(f.read_text())
        consts = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Name)}
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg in ("tooltip", "description"):
                found += [c.value for c in ast.walk(node.value)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                found += [c.value for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id in consts
                          for c in ast.walk(consts[n.id]) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        texts[f"nodes/{f.name}"] = "\n".join(found)
    return texts


# Words the docs define (their test pages explain "the zoo", "the fixture") but a tooltip or a
# template's Note, read on its own in the editor, does not.
NODE_TEXT_INTERNAL = [r"\bzoo\b", r"\bfixtures?\b", r"\btests?/", r"\bpytest\b", r"\bdemo\b"]


def test_tooltips_and_notes_hold_no_words_only_the_docs_explain():
    texts = _node_texts()
    assert sum(len(t) for t in texts.values()) > 10_000, "the tooltips were not found"
    for f in sorted((paths.REPO / "example_workflows").glob("*.json")):
        texts[f"example_workflows/{f.name} (Notes)"] = "\n".join(
            str(v) for n in json.loads(f.read_text())["nodes"] if n["type"] in ("Note", "MarkdownNote")
            for v in n.get("widgets_values") or [])
    found = [f"{where}: {m.group(0)!r} in {line.strip()[:120]!r}"
             for where, text in texts.items() for line in text.splitlines()
             for p in NODE_TEXT_INTERNAL for m in [re.search(p, line, flags=re.I)] if m]
    assert not found, "words a user of the editor cannot look up:\n" + "\n".join(found)


def test_every_template_note_says_where_its_model_files_go():
    """A user opening a template learns from its Note which folder each model file goes in (the
    folders of the files its loaders list for download), not only that a download link exists."""
    missing = []
    for f in sorted((paths.REPO / "example_workflows").glob("*.json")):
        nodes = json.loads(f.read_text())["nodes"]
        note = " ".join(str(v) for n in nodes if n["type"] == "Note" for v in n.get("widgets_values") or [])
        folders = {m["directory"] for n in nodes for m in (n.get("properties") or {}).get("models", [])}
        missing += [f"{f.name}: models/{d}" for d in sorted(folders) if f"models/{d}" not in note]
    assert not missing, "Notes that do not say where a model file goes:\n" + "\n".join(missing)


def _anchors(md: str) -> set[str]:
    """GitHub's anchors of a Markdown page: its headings (lower case, punctuation dropped, spaces
    to '-') and explicit <a id="..."> / <a name="...">."""
    heads = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+\s+(.*?)\s*#*$", md, flags=re.M)}
    return heads | set(re.findall(r'<a (?:id|name)="([^"]+)"', md))


def test_relative_links_and_images_resolve():
    """Every relative link and image in README.md and docs/ names a file of the repository (and a
    heading or anchor of it, after '#'), so a link renders on GitHub and in the registry's page."""
    broken = []
    for page in [paths.REPO / "README.md", *sorted((paths.REPO / "docs").glob("*.md"))]:
        md = page.read_text()
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", md) + \
                re.findall(r'<img [^>]*src="([^"]+)"', md):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = page.relative_to(paths.REPO)
            if not dest.exists() or paths.REPO.resolve() not in dest.parents:
                broken.append(f"{rel}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{rel}: {target} (no heading or anchor '{anchor}')")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_user_texts_hold_no_internal_words():
    found = []
    for where, text in _user_texts().items():
        for i, line in enumerate(text.splitlines(), 1):
            for pattern in INTERNAL:
                m = re.search(pattern, line, flags=re.I)
                if m:
                    found.append(f"{where}:{i}: {m.group(0)!r} in {line.strip()[:120]!r}")
    assert not found, "words for developers in what users read:\n" + "\n".join(found)


# README and docs/ (development.md aside) say what holds today, for a user: no change history ("fixed
# with this table", "crashed", "used to", "tiled correctly before, now …"), no test files or test-only
# words as evidence (development.md names those).
HISTORY = [
    r"\btests?/", r"\bzoo\b", r"\bfixtures?\b", r"\bpytest\b", r"\bused to\b", r"\bcrashed\b",
    r"\bfixed (?:with|in|by)\b", r"\bno longer\b", r"\bpreviously\b", r"\bwas (?:wrong|broken)\b",
    r"\bcorrectly before\b", r"\bbefore:", r"\bbefore \d", r"\bwas \S+ before\b",
    r"\bthe default before\b", r"\bbefore the (?:fix|change)\b", r"\bnow (?:with|never|runs|streams)\b",
]


def _pages() -> dict[str, str]:
    pages = {"README.md": (paths.REPO / "README.md").read_text()}
    pages.update({f"docs/{f.name}": f.read_text() for f in sorted((paths.REPO / "docs").glob("*.md"))
                  if f.name != "development.md"})
    return pages


def _history(text: str) -> list[str]:
    return [f"{i}: {m.group(0)!r} in {line.strip()[:120]!r}" for i, line in enumerate(text.splitlines(), 1)
            for p in HISTORY for m in [re.search(p, line, flags=re.I)] if m]


def test_docs_say_what_holds_today_without_history_or_test_files():
    found = [f"{where}:{hit}" for where, text in _pages().items() for hit in _history(text)]
    assert not found, "history or test references in what users read (say what holds now):\n" + "\n".join(found)


def test_the_history_check_catches_the_old_wording():
    old = ["- **Fixed with this table** (each case failed in the zoo before): Balanced Device Map crashed",
           "What these rows say: HunyuanImage 2.1 tiled correctly before, now with",
           "AuraFlow's class is named `MMDiT` like SD3's; it used to get SD3's patterns, which left",
           "Verified on CPU, ComfyUI 0.3.75 and 0.33.0 (`tests/test_fp8.py`, `tests/test_fp8_models.py`,",
           "| Wan e4m3 + merged LoRA, before: legacy | core format | 0 (before 0.0036) |",
           "keeps the blocks' modulation too (the default before; on Flux, SD3.5",
           "Slightly less precise (Flux fixture, blocks' modulation kept: 0.026 → 0.037)."]
    assert all(_history(line) for line in old), [line for line in old if not _history(line)]
    ok = ["1. Loader → **FP8 Layerwise Cast** → KSampler (LoRA loaders before or after it).",
          "everything is checked before the first tensor is read, so a bad checkpoint loads",
          "the next start after a crash). No network access, no downloads, no other programs started.",
          "Measured on tiny models of each architecture (random weights, CPU)."]
    assert not any(_history(line) for line in ok), [line for line in ok if _history(line)]


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
