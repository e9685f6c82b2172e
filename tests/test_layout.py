"""Layout: flowseam's modules and the in-repo backends import each other without circles, and
every module stands in a layer and imports nothing above it.

The layers, lowest first (a module imports only from its own layer or the ones below):

1. **seam**: what everything else stands on: errors, ops (names, contracts, the numpy oracle),
   kernels, plugins, hookspecs, declarations, components, platform, attention, request (and the
   request's policy values, :mod:`flowseam.policies`), schedulers, noise, faults, media, console,
   ... No model, no loop.
2. **models**: :mod:`flowseam.models` (cards and the instances that run them) and
   :mod:`flowseam.adapters`, the model's LoRA sets (``model.adapters`` switches the model's own
   DiT experts; it reads the model through a Protocol, so :mod:`flowseam.models.base` can build it).
3. **loops**: :mod:`flowseam.loops` (one module per loop family, the helpers they share). The
   loops drive the models; ``ModelInstance.generate`` reaches them through :mod:`flowseam.runner`,
   a seam-level registry the loops package fills when it is imported.
4. **users**: training, serve, the CLI, demo, workflows, refiner, the loader that builds a
   runnable model (:mod:`flowseam.loading`), the shipped test suites (:mod:`flowseam.testing`),
   the package ``flowseam`` itself (the public API: its names of higher layers are imported on
   first access) and the backend plugins (``flowseam_cpu``, ``flowseam_cuda``, ``flowseam_accel``:
   core finds them through the entry-point group and never imports them; a backend stands on the
   seam only, :func:`test_backends_stand_on_the_seam`).

Inside a layer modules may import each other, in one direction (no circles). :data:`LAYER`
places every module; a module it does not place fails :func:`test_every_module_has_a_layer`, so
a new module is placed when it is added.

Every import counts: at module level, inside functions (lazy) and under ``if TYPE_CHECKING:``
(a type-only import is still a dependency a reader and a type checker follow), and importing
``a.b.c`` imports the packages ``a`` and ``a.b`` too (Python initialises them first).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the import roots analysed: core and every in-repo backend plugin
PACKAGES = [REPO / "core" / "src" / "flowseam",
            *sorted((REPO / "plugins").glob("*/src/flowseam_*/"))]
BACKENDS = ("flowseam_cpu", "flowseam_cuda", "flowseam_accel")

SEAM, MODELS, LOOPS, USERS = "seam", "models", "loops", "users"
#: the layers, lowest first
ORDER = (SEAM, MODELS, LOOPS, USERS)

#: module → its layer. ``pkg.*`` stands for the package ``pkg`` and every module under it; a
#: plain name for that module only (so a new top-level module of flowseam must be placed here).
LAYER = {
    # -- seam ---------------------------------------------------------------------------------
    "flowseam.seam.*": SEAM,            # the plugin contract and its resolution
    "flowseam.ops.*": SEAM,             # op names and contracts, the numpy oracle, eager refs
    "flowseam.errors": SEAM,            # the errors every layer raises
    "flowseam._moved": SEAM,            # old import paths, kept for one release
    "flowseam.quiet": SEAM,             # the libraries' output kept quiet
    "flowseam.attention": SEAM,         # the attention route the DiTs' processors call
    "flowseam.causal_attention": SEAM,  # block-causal masks and the KV cache's attention
    "flowseam.parallel": SEAM,          # sequence/CFG parallelism: process groups, split hooks
    "flowseam.step_constants": SEAM,
    "flowseam.noise": SEAM,
    "flowseam.media": SEAM,
    "flowseam.policies": SEAM,          # parsing of the request's lora / cache values
    "flowseam.memory": SEAM,            # offload, VAE tiling / slicing options and helpers
    "flowseam.request": SEAM,
    "flowseam.schedulers": SEAM,        # a checkpoint's scheduler config → solver, sigmas
    "flowseam.defaults": SEAM,          # the precedence of serving defaults (plain data)
    "flowseam.runner": SEAM,            # the loops' entry points, registered by the loops
    # -- models -------------------------------------------------------------------------------
    "flowseam.models.*": MODELS,
    "flowseam.adapters": MODELS,        # the model's LoRA sets: drives its DiT experts
    # -- loops --------------------------------------------------------------------------------
    "flowseam.loops.*": LOOPS,
    # -- users --------------------------------------------------------------------------------
    "flowseam": USERS,                  # the public API (higher layers' names imported lazily)
    "flowseam.__main__": USERS,
    "flowseam.cli.*": USERS,
    "flowseam.loading": USERS,          # builds a runnable model: imports the loops it runs
    "flowseam.training.*": USERS,
    "flowseam.rewards.*": USERS,        # the real reward models, their server and client
    "flowseam.serve.*": USERS,
    "flowseam.workflows": USERS,
    "flowseam.refiner": USERS,          # the LM prompt refiner of unified RL
    "flowseam.demo.*": USERS,
    "flowseam.testing.*": USERS,        # the pytest plugin and the conformance suite
    **{f"{backend}.*": USERS for backend in BACKENDS},
}

#: the modules of the loops package shared by every loop (below them: they import no loop, and
#: may import each other)
LOOP_HELPERS = ("flowseam.loops.records", "flowseam.loops.solvers", "flowseam.loops.step_cache")


def _modules(roots: list[Path]) -> dict[str, Path]:
    """Dotted module name → file, for every ``.py`` file under the package directories
    ``roots`` (a package is named by its ``__init__.py``)."""
    modules = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(roots: list[Path]) -> dict[str, set[str]]:
    """module → the analysed modules it imports, anywhere in its file: at module level, inside
    functions and under ``if TYPE_CHECKING:``. ``from pkg import name`` imports the submodule
    ``pkg.name`` when there is one, else ``pkg``; importing ``a.b.c`` imports ``a`` and ``a.b``
    too, except the module's own packages (initialised before it, they cannot wait on it)."""
    modules = _modules(roots)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    named.add(sub if sub in modules else base)
        deps = set()
        for dep in named:
            while dep:  # the module and the packages above it
                if dep in modules:
                    deps.add(dep)
                dep = dep.rpartition(".")[0]
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: the strongly connected components of more than one module (Tarjan),
    each sorted; every circle of ``graph`` lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _describe(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    """Each circle with the imports that close it (one line per module)."""
    lines = []
    for component in cycles:
        lines.append(f"{len(component)} modules:")
        lines += [f"  {m} -> {sorted(graph[m] & set(component))}" for m in component]
    return "\n".join(lines)


def _layer(module: str) -> str | None:
    """The layer :data:`LAYER` places ``module`` in (its own entry, else its closest package's
    ``pkg.*`` entry), or None."""
    if module in LAYER:
        return LAYER[module]
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYER.get(".".join(parts[:n]) + ".*")
        if layer is not None:
            return layer
    return None


def test_import_graph_sees_every_import(tmp_path):
    """The graph counts lazy and type-only imports and the packages above an imported module,
    and the detector reports the circle they close."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("def f():\n    from .b import thing\n    return thing\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                              "    import pkg.sub.c\nthing = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\n")
    graph = _imports([pkg])
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub", "pkg.sub.c"},
                     "pkg.sub": set(), "pkg.sub.c": {"pkg.a"}}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    del graph["pkg.a"]  # without the lazy import there is no circle
    assert _cycles(graph) == []


def test_no_import_cycles():
    graph = _imports(PACKAGES)
    assert {"flowseam.loops.causal", "flowseam.models.wan_causal"} <= set(graph)
    assert {f"{backend}.plugin" for backend in BACKENDS} <= set(graph), sorted(PACKAGES)
    cycles = _cycles(graph)
    assert cycles == [], f"import circles:\n{_describe(graph, cycles)}"
    # the check finds a circle when there is one: the one the loops package removed
    graph["flowseam.noise"] = graph["flowseam.noise"] | {"flowseam.loops.flow_match"}
    assert any({"flowseam.noise", "flowseam.loops.flow_match"} <= set(c) for c in _cycles(graph))


def test_every_module_has_a_layer():
    graph = _imports(PACKAGES)
    unplaced = sorted(m for m in graph if _layer(m) is None)
    assert unplaced == [], f"modules without a layer (place them in LAYER): {unplaced}"
    stale = sorted(key for key in LAYER
                   if not any(m == key.removesuffix(".*") or
                              (key.endswith(".*") and m.startswith(key[:-1])) for m in graph))
    assert stale == [], f"LAYER entries that name no module: {stale}"


def test_no_module_imports_a_higher_layer():
    graph = _imports(PACKAGES)
    rank = {module: ORDER.index(_layer(module)) for module in graph if _layer(module)}
    upward = sorted(f"{m} ({_layer(m)}) imports {d} ({_layer(d)})"
                    for m, deps in graph.items() for d in deps
                    if m in rank and d in rank and rank[d] > rank[m])
    assert upward == [], "imports of a higher layer:\n" + "\n".join(upward)


def test_backends_stand_on_the_seam():
    """A backend plugin imports its own package, flowseam's seam modules and the package
    ``flowseam`` (core's public API) only: never a model, a loop or training."""
    graph = _imports(PACKAGES)
    for module, deps in graph.items():
        own = module.split(".")[0]
        if own not in BACKENDS:
            continue
        bad = sorted(d for d in deps if d.split(".")[0] != own and d != "flowseam"
                     and _layer(d) != SEAM)
        assert bad == [], f"{module} imports {bad}"


def _private_names_of_core(source: str) -> list[str]:
    """The ``_``-prefixed names of flowseam that ``source`` imports, or reads as attributes of a
    name bound to flowseam or one of its modules (``import flowseam.ops as o; o._x``)."""
    found, bound = [], set()
    nodes = list(ast.walk(ast.parse(source)))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flowseam":
                    bound.add(alias.asname or alias.name.split(".")[0])
                    found += [alias.name] if _private(alias.name) else []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (
                node.module or "").split(".")[0] == "flowseam":
            found += [node.module] if _private(node.module) else []
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.module}.{alias.name}")
                else:
                    bound.add(alias.asname or alias.name)
    for node in nodes:
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = ast.unparse(node.value)
            if base.split(".")[0] in bound:
                found.append(f"{base}.{node.attr}")
    return found


def _private(dotted: str) -> bool:
    """A ``_`` name that is not a ``__dunder__`` (``__version__`` is public)."""
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
               for p in dotted.split("."))


def test_backends_use_no_private_name_of_core():
    """A backend (the in-repo ones are the examples vendors copy) uses flowseam's public API
    only: no ``_``-prefixed module, function or attribute of flowseam."""
    for package in PACKAGES[1:]:
        for path in package.rglob("*.py"):
            assert _private_names_of_core(path.read_text()) == [], path
    # the check finds such a use when there is one
    for uses in ("from flowseam.attention import _SDPARoute",
                 "import flowseam\nflowseam.seam.discovery._CACHE = None",
                 "from flowseam import ops\nops._shape(1)",
                 "import flowseam.ops as o\no._shape(1)",
                 "import flowseam._private"):
        assert _private_names_of_core(uses) != [], uses
    for public in ("from flowseam import __version__, ops\nops.check_sigmas(0.5, 0.2)",
                   "import torch\ntorch._dynamo.reset()"):
        assert _private_names_of_core(public) == [], public


def test_loops_import_neither_training_nor_each_other():
    graph = _imports(PACKAGES)
    loops = [m for m in graph if m.startswith("flowseam.loops.")]
    assert {"flowseam.loops.flow_match", "flowseam.loops.causal"} <= set(loops)
    for loop in loops:
        bad = sorted(d for d in graph[loop] if d.startswith("flowseam.training")
                     or (d.startswith("flowseam.loops.") and d not in LOOP_HELPERS))
        assert bad == [], f"{loop} imports {bad}"


def test_models_reach_the_loops_through_the_runner():
    """The model layer imports no loop: ``ModelInstance.generate`` runs what the loops package
    registered in :mod:`flowseam.runner`, which :mod:`flowseam.loading` (``flowseam.load``)
    always imports; before that, a clear error instead of a silent no-op."""
    import subprocess
    import sys

    code = (
        "import sys, flowseam.models, flowseam.runner as runner\n"
        "assert 'flowseam.loops' not in sys.modules\n"
        "try:\n"
        "    runner.run(None, None)\n"
        "except RuntimeError as exc:\n"
        "    assert 'import flowseam.loops' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no error without the loops')\n"
        "import flowseam.loading, flowseam.loops as loops\n"
        "assert runner._ENTRY == {'run': loops.run_loop, 'stream': loops.stream_loop}\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
