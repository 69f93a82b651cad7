"""What a badge figure may look like (units), shared by the badge tests with and without a browser.

Every figure of a report's ``badge`` list (``memorykit/badge.py``) must match one of
:data:`FIGURE_PATTERNS`: bytes only in binary units, seconds as "s", counts without a unit.
"""
from __future__ import annotations

import re

_B = r"\d+(\.\d+)? (B|KiB|MiB|GiB)"
_N = r"\d+(\.\d+)?"
FIGURE_PATTERNS = [re.compile(p) for p in (
    rf"(VRAM|RAM) peak( \(max of \d+\))? {_B}",
    rf"{_N} → {_N} (B|KiB|MiB|GiB) \([−+]\d+ %\)",
    r"\d+ layers fp8( \(core\))?", r"\d+ kept",
    rf"resident {_B}", rf"streams {_B}/(forward|step)( from disk)?", rf"(peak|needs) {_B}",
    rf"\d+ (forwards?|steps?) in {_N} s", r"planned",
    r"\d+(×\d+)* tiles", r"\d+×\d+ px", rf"{_N} s",
    r"\d+ shards?", _B, r"\d+ tensors",
    rf"(cpu|disk|mps|(cuda|xpu|npu|mlu):\d+) {_N}( (B|KiB|MiB|GiB))?",  # device map: "cuda:0 10.8", "disk 1.6 MiB"
    rf"(fp8 \+ )?stream {_B}/step from (RAM|disk)", r"fp8 resident", r"as loaded", r"(fp8 \+ )?core dynamic VRAM",
    r"tiles \d+", r"no tiles",  # Memory Plan
    rf"TE: ((fp8 \+ )?stream {_B}/text from (RAM|disk)|fp8 resident|as loaded|(fp8 \+ )?core dynamic VRAM)",
    rf"DM2?: ((fp8 \+ )?stream {_B}/step from (RAM|disk)|fp8 resident|as loaded|(fp8 \+ )?core dynamic VRAM)",
    rf"unloaded {_B}", rf"VRAM freed {_B}", rf"cache released {_B}", r"\d+ models? loaded",
)]


def bad_figures(figures: list[str]) -> list[str]:
    """The figures that match no pattern (empty when all are well formed)."""
    return [f for f in figures if not any(p.fullmatch(f) for p in FIGURE_PATTERNS)]


def split_badge(text: str) -> tuple[bool, list[str], int]:
    """A badge's text → (cached, shown figures, N of "+N"). A figure cut to fit ends with "…"."""
    cached = text.startswith("cached · ")
    if cached:
        text = text[len("cached · "):]
    shown = text.split(" · ") if text else []
    more = 0
    if shown and re.fullmatch(r"\+\d+", shown[-1]):
        more = int(shown.pop()[1:])
    return cached, shown, more


def badge_matches(text: str, figures: list[str]) -> bool:
    """Whether a badge's text shows a prefix of ``figures`` (the last shown one possibly cut
    with "…") with "+N" counting the rest."""
    _, shown, more = split_badge(text)
    if not shown or len(shown) + more != len(figures):
        return False
    *whole, last = shown
    if whole != figures[:len(whole)]:
        return False
    ref = figures[len(whole)]
    return last == ref or (last.endswith("…") and ref.startswith(last[:-1]))
