"""Layout: flowseam's modules import each other without cycles, and the loops stay below models
and training (one module per loop, helpers below them)."""

from __future__ import annotations

import ast
from pathlib import Path

import flowseam

ROOT = Path(flowseam.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module → the flowseam modules it imports at import time (module level, outside
    ``if TYPE_CHECKING:``; imports inside functions run later and cannot form an import cycle).
    ``from .pkg import name`` counts as importing the submodule ``pkg.name`` when it is one (a
    partly initialised package can hand out its submodules), else ``pkg`` itself (the name must
    exist, so the package must be initialised)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_cycles():
    graph = _imports()
    assert "flowseam.loops.causal" in graph and "flowseam.models.wan_causal" in graph
    cycles = _cycles(graph)
    assert cycles == [], f"import cycles: {cycles}"
    # the check finds a cycle when there is one: the one the loops package removed
    graph["flowseam.noise"] = graph["flowseam.noise"] | {"flowseam.loops.flow_match"}
    assert any("flowseam.noise" in c and "flowseam.loops.flow_match" in c for c in _cycles(graph))


#: the modules of the loops package shared by every loop (below them: they import no loop)
LOOP_HELPERS = ("flowseam.loops.records", "flowseam.loops.solvers", "flowseam.loops.step_cache")


def test_loops_import_neither_models_nor_training_nor_each_other():
    graph = _imports()
    loops = [m for m in graph if m.startswith("flowseam.loops.")]
    assert {"flowseam.loops.flow_match", "flowseam.loops.causal"} <= set(loops)
    for loop in loops:
        allowed = () if loop in LOOP_HELPERS else LOOP_HELPERS
        bad = sorted(d for d in graph[loop] if d.startswith(("flowseam.models", "flowseam.training"))
                     or (d.startswith("flowseam.loops.") and d not in allowed))
        assert bad == [], f"{loop} imports {bad}"
