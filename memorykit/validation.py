"""Input validation shared by every node: numbers, names, skip patterns.

Plain Python (no ComfyUI, no torch). Every check raises ValueError whose message starts with
the field's name and says what to give instead.

- :func:`finite_number`: NaN and ±inf are refused (ComfyUI's own min/max checks let NaN
  through: every comparison with NaN is false), then the range.
- :func:`nonempty_batch`: a LATENT/IMAGE batch of at least one item, no dimension of size 0.
- :func:`path_component`: one portable file/folder name (no separators, no control
  characters, at most 255 bytes, nothing Windows or macOS refuses).
- :func:`parse_patterns` / :func:`compile_pattern`: the skip-pattern syntax of FP8 Layerwise
  Cast. Patterns are Python regular expressions **without** backreferences, lookarounds,
  ``\\b``/``\\B``, atomic groups, possessive quantifiers or inline flags, and they are matched
  by a linear-time automaton (Thompson's construction, simulated with a memoised state-set
  DFA) instead of ``re``'s backtracking engine, so a pattern such as ``(\\w+\\.?)+Z`` costs
  ``O(len(name) × pattern size)`` per name instead of exponential time with the GIL held
  (Russ Cox, "Regular Expression Matching Can Be Simple And Fast", 2007). Parsing uses
  ``re``'s own parser, so the syntax is exactly Python's for what is supported.
"""
from __future__ import annotations

import math
import unicodedata

try:  # Python 3.11+
    from re import _constants as _c
    from re import _parser as _p
except ImportError:  # Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

NAME_MAX = 255  # bytes of one path component on Linux, macOS and Windows file systems
MAX_PATTERN_CHARS = 1000
MAX_STATES = 5000  # automaton states of one pattern (bounded repeats are expanded)
MAX_PATTERNS = 200  # distinct patterns of one field (each is matched against every module name)
MAX_PATTERNS_CHARS = 64 * 1024  # characters of a whole patterns field
_WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
_WINDOWS_BAD = set('<>:"|?*')


def finite_number(value, field: str, minimum: float | None = None, maximum: float | None = None) -> float:
    """``value`` as a float after checking it is a finite number within [minimum, maximum].

    Raises ValueError naming ``field`` for a non-number (bools too), NaN, ±inf, or a value
    outside the range. ComfyUI's schema checks compare with min/max, which NaN always passes.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} is {value!r}, not a number: give a number")
    if not math.isfinite(value):
        raise ValueError(f"{field} is {value!r}, not a finite number: give a number"
                         + (f" between {minimum} and {maximum}" if minimum is not None and maximum is not None else ""))
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        raise ValueError(f"{field} is {value}: give a number between {minimum} and {maximum}")
    return float(value)


def nonempty_batch(shape, field: str, kind: str) -> None:
    """Refuse a batch of nothing: ValueError naming ``field`` when ``shape`` (a tensor's shape,
    batch first) has no dimensions, a batch of 0, or another dimension of size 0 (a 0-pixel
    width, height, frame count or channel count) (``kind``: ``LATENT``, ``IMAGE``...)."""
    if len(shape) == 0 or shape[0] == 0:
        raise ValueError(f"{field}: the {kind} holds no items (shape {tuple(shape)}); connect a {kind} with at "
                         "least one item (a batch size of 0 gives nothing to process)")
    if 0 in tuple(shape):
        raise ValueError(f"{field}: the {kind} has a dimension of size 0 (shape {tuple(shape)}); connect a {kind} "
                         "with a width, height (and frame count) of at least one")


def path_component(name, field: str, allow_hidden: bool = False) -> str:
    """``name`` checked to be one portable file or folder name; returned unchanged.

    Refused (ValueError naming ``field``): non-strings, empty, ``.``/``..``, ``/`` or ``\\``,
    NUL and other control characters, more than NAME_MAX (255) bytes in UTF-8, Windows'
    reserved characters ``<>:"|?*`` and device names (``CON``, ``NUL``, ``COM1``...), a trailing
    space or dot, and (unless ``allow_hidden``) a leading dot, which hides the entry.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field}: {name!r} is not a name; give a file or folder name")
    shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
    bad = next((i for i, ch in enumerate(name) if unicodedata.category(ch) in ("Cc", "Cs")), None)
    if bad is not None:
        raise ValueError(f"{field}: {shown}: character {bad + 1} is a control character ({name[bad]!r}); "
                         "remove it (names are printable text)")
    if name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"{field}: {shown} is not a single name (no '/', '\\', '.' or '..')")
    n = len(name.encode("utf-8", "surrogatepass"))
    if n > NAME_MAX:
        raise ValueError(f"{field}: the name {shown} is {n} bytes long; file systems allow at most {NAME_MAX}: shorten it")
    found = sorted(_WINDOWS_BAD.intersection(name))
    if found:
        raise ValueError(f"{field}: {shown} contains {' '.join(found)}, which Windows does not allow in names; remove it")
    if name.rstrip(" .") != name:
        raise ValueError(f"{field}: {shown} ends with a space or a dot, which Windows drops; remove it")
    if name.split(".")[0].upper() in _WINDOWS_RESERVED:
        raise ValueError(f"{field}: {shown} is a reserved device name on Windows; choose another name")
    if name.startswith(".") and not allow_hidden:
        raise ValueError(f"{field}: {shown} starts with '.', so it is hidden (and never listed by the loaders); "
                         "remove the leading '.'")
    return name


# ------------------------------------------------------------------------------------------
# Skip patterns: list syntax
# ------------------------------------------------------------------------------------------
def split_patterns(text: str) -> list[str]:
    """Pattern texts of a multi-line field: one pattern per line, or several on a line
    separated by commas that are outside ``[...]``, ``{...}`` and ``(...)`` and not escaped
    (``blocks\\.{0,1}0\\.`` stays whole; ``\\,`` is a literal comma). Blank lines and lines
    starting with ``#`` are ignored; surrounding spaces are stripped."""
    out = []
    for line in (text or "").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cur, i, depth, in_class = [], 0, 0, False
        while i < len(line):
            ch = line[i]
            if ch == "\\" and i + 1 < len(line):
                cur.append(line[i:i + 2])
                i += 2
                continue
            if in_class:
                in_class = ch != "]" or cur[-1] in ("[", "[^")
            elif ch == "[":
                in_class = True
                if line[i + 1:i + 2] == "^":
                    cur.append("[^")
                    i += 2
                    continue
            elif ch in "({":
                depth += 1
            elif ch in ")}" and depth:
                depth -= 1
            elif ch == "," and depth == 0:
                out.append("".join(cur).strip())
                cur, i = [], i + 1
                continue
            cur.append(ch)
            i += 1
        out.append("".join(cur).strip())
    return [p for p in out if p]


def bounded_text(text, field: str, max_chars: int, hint: str = "shorten it") -> str:
    """``text`` checked to be a string of at most ``max_chars`` characters (a text field that
    becomes work: ComfyUI bounds no string input, and a megabyte field held the prompt worker
    for minutes). Raises ValueError naming ``field``, its length and the limit."""
    if text is None:
        return ""
    if not isinstance(text, str):
        raise ValueError(f"{field} is {type(text).__name__}, not text: give text")
    if len(text) > max_chars:
        raise ValueError(f"{field} is {len(text):,} characters long; at most {max_chars:,} are read: {hint}")
    return text


def parse_patterns(text: str, field: str = "extra_skip_patterns") -> list[str]:
    """The distinct patterns of ``text`` (see :func:`split_patterns`; a repeated pattern is
    kept once, in first-seen order), each checked by :func:`compile_pattern`. Raises ValueError
    naming ``field``: more than MAX_PATTERNS_CHARS characters, more than MAX_PATTERNS distinct
    patterns, or the first bad pattern."""
    text = bounded_text(text, field, MAX_PATTERNS_CHARS, "shorten it (one pattern can match many layers, "
                        "e.g. a regex over the block numbers)")
    pats = list(dict.fromkeys(split_patterns(text)))
    if len(pats) > MAX_PATTERNS:
        raise ValueError(f"{field} holds {len(pats):,} distinct patterns; at most {MAX_PATTERNS} are accepted (each is "
                         "matched against every layer name): merge them, e.g. blocks\\.(0|1|2)\\. for three blocks")
    for p in pats:
        compile_pattern(p, field)
    return pats


# ------------------------------------------------------------------------------------------
# Skip patterns: linear-time matching
# ------------------------------------------------------------------------------------------
_CHAR, _SPLIT, _BEGIN, _END, _MATCH = range(5)
_CATEGORY = {
    _c.CATEGORY_DIGIT: str.isdecimal, _c.CATEGORY_SPACE: str.isspace,
    _c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
}
_CATEGORY.update({
    _c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(), _c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    _c.CATEGORY_NOT_WORD: lambda ch: not (ch.isalnum() or ch == "_"),
})
_UNSUPPORTED = {
    "GROUPREF": "backreferences", "GROUPREF_EXISTS": "conditional groups", "ASSERT": "lookahead/lookbehind",
    "ASSERT_NOT": "lookahead/lookbehind", "ATOMIC_GROUP": "atomic groups", "POSSESSIVE_REPEAT": "possessive quantifiers",
}


class _Unsupported(ValueError):
    pass


class Pattern:
    """A compiled skip pattern: ``search(name)`` is True where ``re.search(pattern, name)``
    would find a match, computed in time linear in ``len(name)`` (build with :func:`compile_pattern`)."""

    def __init__(self, pattern: str, states: list, start: int):
        self.pattern = pattern
        self._states = states
        self._start = start
        self._cache: dict = {}

    def __repr__(self) -> str:
        return f"Pattern({self.pattern!r})"

    def _closure(self, seeds, begin: bool, end: int) -> frozenset:
        """States reachable from ``seeds`` without reading a character. ``end`` is 2 at the
        end of the name, 1 just before a final newline (where ``$`` matches but ``\\Z`` does
        not, as in ``re``), 0 elsewhere."""
        seen, stack = set(), list(seeds)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            kind, dollar, out = self._states[s]
            if kind == _SPLIT:
                stack.extend(out)
            elif kind == _BEGIN and begin or kind == _END and end >= 2 - bool(dollar):
                stack.append(out)
        return frozenset(seen)

    @staticmethod
    def _end(name: str, pos: int) -> int:
        n = len(name)
        return 2 if pos == n else int(pos == n - 1 and name[-1] == "\n")

    def _matched(self, cur: frozenset) -> bool:
        return any(self._states[s][0] == _MATCH for s in cur)

    def search(self, name: str) -> bool:
        """True when the pattern matches somewhere in ``name`` (as ``re.search``)."""
        end = self._end(name, 0)
        key = (None, end)
        cur = self._cache.get(key)
        if cur is None:
            cur = self._cache[key] = self._closure([self._start], True, end)
        for i, ch in enumerate(name):
            if self._matched(cur):
                return True
            end = self._end(name, i + 1)
            key = (cur, ch, end)
            nxt = self._cache.get(key)
            if nxt is None:
                moved = [out for s in cur for kind, pred, out in (self._states[s],) if kind == _CHAR and pred(ch)]
                nxt = self._closure(moved + [self._start], False, end)
                if len(self._cache) > 20000:  # bound the memo; it refills from what is used
                    self._cache.clear()
                self._cache[key] = nxt
            cur = nxt
        return self._matched(cur)


def _is(c: str):
    return lambda ch: ch == c


def _is_not(c: str):
    return lambda ch: ch != c


def _in_pred(items):
    tests, negate = [], False
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            tests.append(_is(chr(av)))
        elif name == "NOT_LITERAL":
            tests.append(_is_not(chr(av)))
        elif name == "RANGE":
            tests.append(lambda ch, lo=av[0], hi=av[1]: lo <= ord(ch) <= hi)
        elif name == "CATEGORY" and av in _CATEGORY:
            tests.append(_CATEGORY[av])
        else:
            raise _Unsupported(f"the character-class item {name}")
    return (lambda ch: not any(t(ch) for t in tests)) if negate else (lambda ch: any(t(ch) for t in tests))


def _build(pattern: str) -> Pattern:
    parsed = _p.parse(pattern)
    if parsed.state.flags & ~(_c.SRE_FLAG_UNICODE):
        raise _Unsupported("inline flags such as (?i)")
    states: list = []

    def new(kind, data=None, out=None) -> int:
        if len(states) >= MAX_STATES:
            raise _Unsupported(f"a pattern this large (more than {MAX_STATES} steps once its repeats are counted out)")
        states.append([kind, data, out])
        return len(states) - 1

    def seq(items, nxt: int) -> int:
        for op, av in reversed(list(items)):
            nxt = item(op, av, nxt)
        return nxt

    def item(op, av, nxt: int) -> int:
        name = str(op)
        if name in _UNSUPPORTED:
            raise _Unsupported(_UNSUPPORTED[name])
        if name == "LITERAL":
            return new(_CHAR, _is(chr(av)), nxt)
        if name == "NOT_LITERAL":
            return new(_CHAR, _is_not(chr(av)), nxt)
        if name == "ANY":
            return new(_CHAR, lambda ch: ch != "\n", nxt)
        if name == "IN":
            return new(_CHAR, _in_pred(av), nxt)
        if name == "CATEGORY" and av in _CATEGORY:
            return new(_CHAR, _CATEGORY[av], nxt)
        if name == "BRANCH":
            return new(_SPLIT, None, [seq(alt, nxt) for alt in av[1]])
        if name == "SUBPATTERN":
            if av[1] or av[2]:
                raise _Unsupported("inline flags such as (?i:...)")
            return seq(av[3], nxt)
        if name == "AT":
            at = str(av)
            if at in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
                return new(_BEGIN, None, nxt)
            if at in ("AT_END", "AT_END_STRING"):  # '$' also matches before a final newline
                return new(_END, at == "AT_END", nxt)
            raise _Unsupported("word boundaries (\\b, \\B)")
        if name in ("MAX_REPEAT", "MIN_REPEAT"):
            lo, hi, body = av
            if hi == _c.MAXREPEAT:
                loop = new(_SPLIT, None, None)
                states[loop][2] = [seq(body, loop), nxt]
                nxt = loop
            else:
                for _ in range(hi - lo):
                    nxt = new(_SPLIT, None, [seq(body, nxt), nxt])
            for _ in range(lo):
                nxt = seq(body, nxt)
            return nxt
        raise _Unsupported(f"the regex element {name}")

    start = seq(parsed, new(_MATCH))
    return Pattern(pattern, [tuple(s) for s in states], start)


_compiled: dict[str, Pattern] = {}


def compile_pattern(pattern: str, field: str = "extra_skip_patterns") -> Pattern:
    """A :class:`Pattern` for ``pattern`` (a Python regular expression in the supported subset,
    see the module docstring). Raises ValueError naming ``field`` and the pattern for invalid
    syntax, unsupported elements, more than MAX_PATTERN_CHARS characters or MAX_STATES states."""
    if pattern in _compiled:
        return _compiled[pattern]
    example = "e.g. 'double_blocks\\.0\\.' or 'attn.*\\.proj$'"
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{field}: {pattern!r} is not a pattern ({example})")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{field}: a pattern of {len(pattern)} characters is longer than {MAX_PATTERN_CHARS}; "
                         "split it into several patterns, one per line")
    try:
        compiled = _build(pattern)
    except _Unsupported as e:
        raise ValueError(f"{field}: pattern {pattern!r} uses {e}, which skip patterns do not support (they are "
                         f"matched in bounded time); write it without ({example})") from None
    except (_c.error, OverflowError, RecursionError) as e:
        raise ValueError(f"{field}: invalid skip pattern {pattern!r}: {e} (patterns are Python regular expressions "
                         f"searched in module names, {example}; a literal comma is written '\\,')") from None
    if len(_compiled) > 256:
        _compiled.clear()
    _compiled[pattern] = compiled
    return compiled
