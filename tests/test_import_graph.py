"""Imports run one way inside the pack: the graph of the package's own imports (module level and
inside functions; ``if TYPE_CHECKING:`` blocks left out) has no cycle. Reads the source only."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("memorykit", "nodes")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for child in node.body for n in ast.walk(child)}
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the pack's modules it imports (``from . import x`` counts as importing ``x``)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.level == 0:
                targets = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_packs_imports_have_no_cycle():
    graph = import_graph()
    assert "memorykit.comfy_integration.common" in graph and graph["memorykit.comfy_integration.offload_patcher"]
    # a package's __init__ importing its own modules is the package's public surface, not a cycle
    # through them: leave out edges from a module to the package that contains it
    for mod in graph:
        graph[mod] = {t for t in graph[mod] if not mod.startswith(t + ".")}
    assert _cycle(graph) is None, " → ".join(_cycle(graph))
