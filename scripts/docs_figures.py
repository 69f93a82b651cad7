"""Figures in README.md and docs/formats.md that come from a results file (or from docs/demo.md, which the
demo writes) are written by this script, between
``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``, so they cannot go stale:
``python scripts/docs_figures.py`` rewrites them, ``--check`` exits 1 when a file differs
(tests/test_docs_text.py runs the check)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def benchmarks_block() -> str:
    """The README's CPU benchmark lines, from benchmarks/results/latest_cpu.json and vae_cpu.json."""
    cases = {r["case"]: r for r in json.loads((RESULTS / "latest_cpu.json").read_text())["results"]}
    vae = {r["case"]: r for r in json.loads((RESULTS / "vae_cpu.json").read_text())["results"]}
    res, disk, fp8, core_fp8 = (cases[k] for k in ("resident", "mk_offload_disk_block", "mk_fp8_e4m3_per_tensor",
                                                   "comfy_fp8_e4m3fn_manual_cast"))
    ours, core = vae["memorykit_tiled_128_32"], vae["core_tiled_128_32"]
    exact = "output bit-exact" if disk["rel_err_vs_resident"] == 0 else f"relative error {disk['rel_err_vs_resident']:.3g}"
    return "\n".join([
        f"- Group Offload to disk: RSS {_gib(disk['rss_bytes'])} vs {_gib(res['rss_bytes'])} resident, "
        f"{disk['ratio_to_resident']:.2f}× the resident time, {exact}.",
        f"- FP8 Layerwise Cast (per-tensor scale): RSS {_gib(fp8['rss_bytes'])} vs {_gib(res['rss_bytes'])}, weights "
        f"{fp8['weights_ratio_to_unquantised']:.2f}× their size, relative error {fp8['rel_err_vs_resident']:.3f} "
        f"(core's plain fp8 cast: {core_fp8['rel_err_vs_resident']:.3f}).",
        f"- Tiled VAE ({ours['res']}² image, 128 px tiles): relative error {ours['rel_err_vs_untiled']:.3f} vs untiled "
        f"(core's tiled decode: {core['rel_err_vs_untiled']:.3f}), {ours['ratio_to_untiled']:.1f}× untiled time "
        f"(core: {core['ratio_to_untiled']:.1f}×).",
    ])


def formats_block() -> str:
    """docs/formats.md's tables: those of benchmarks/results/formats.md (scripts/format_table.py), as written."""
    text = (RESULTS / "formats.md").read_text()
    return text[text.index("| architecture"):].rstrip("\n")


def demo_block() -> str:
    """The README's demo table: docs/demo.md's table (written by ``scripts/demo.py --markdown``) and its
    "Measured:" line, as written."""
    lines = (REPO / "docs" / "demo.md").read_text().splitlines()
    table = [ln for ln in lines if ln.startswith("|")]
    measured = [ln for ln in lines if ln.startswith("Measured: ")]
    return "\n".join(table + [""] + measured)


BLOCKS = {"benchmarks": benchmarks_block, "demo": demo_block}
# file → its blocks
FILES = {"README.md": BLOCKS, "docs/formats.md": {"formats": formats_block}}


def render(text: str, blocks: dict | None = None, where: str = "README.md") -> str:
    for name, make in (BLOCKS if blocks is None else blocks).items():
        pattern = rf"(<!-- figures:{name} -->\n).*?(<!-- /figures:{name} -->)"
        if not re.search(pattern, text, flags=re.S):
            raise SystemExit(f"{where} has no <!-- figures:{name} --> block")
        text = re.sub(pattern, lambda m: m.group(1) + make() + "\n" + m.group(2), text, flags=re.S)
    return text


def main(argv: list[str]) -> int:
    stale = []
    for where, blocks in FILES.items():
        path = REPO / where
        old = path.read_text()
        new = render(old, blocks, where)
        if new == old:
            continue
        if "--check" in argv:
            stale.append(where)
        else:
            path.write_text(new)
    if stale:
        print(f"{', '.join(stale)}: figures differ from benchmarks/results/: run python scripts/docs_figures.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
