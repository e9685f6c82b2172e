"""Layout: flowseam's modules and the in-repo backends import each other without circles, and
every module stands in a layer and imports nothing above it. docs/architecture.md draws the same
layers.

The layers, lowest first (a module imports only from its own layer or the ones below):

1. **seam** (:mod:`flowseam.seam`, :mod:`flowseam.ops`, :mod:`flowseam.errors`): the plugin
   contract and its resolution — hook specs, declarations, discovery, the Platform with its
   kernel and component tables, plugin faults — the ops' contracts and their numpy oracle, and
   the errors every layer raises.
2. **runtime** (the modules at the root of ``flowseam``): what a model run is made of —
   requests, schedulers, attention routing, memory, parallelism, media, noise.
3. **loops** (:mod:`flowseam.loops`): one module per loop family; a loop drives a model's step
   bodies without importing the models.
4. **models** (:mod:`flowseam.models`, :mod:`flowseam.loading`, :mod:`flowseam.workflows`): the
   cards, the instances that run them (``model.generate`` calls the loop), loading a checkpoint
   into one, and workflows of several.
5. **users**: training, serving, the CLI, the demo, the rewards, the shipped test suites
   (:mod:`flowseam.testing`), the package ``flowseam`` itself (the public API: its names of
   higher layers are imported on first access) and the backend plugins, which stand on the seam
   alone (:func:`test_backends_import_the_seam_only`).

Inside a layer modules may import each other, in one direction (no circles); loops never import
each other. :data:`LAYER` places every module; a module it does not place fails
:func:`test_every_module_has_a_layer`, so a new module is placed when it is added.

Every import counts: at module level, inside functions (lazy) and under ``if TYPE_CHECKING:``
(a type-only import is still a dependency a reader and a type checker follow), and importing
``a.b.c`` imports the packages ``a`` and ``a.b`` too (Python initialises them first).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the import roots analysed: core and every in-repo backend plugin
PACKAGES = [REPO / "core" / "src" / "flowseam",
            *sorted((REPO / "plugins").glob("*/src/flowseam_*/"))]
BACKENDS = ("flowseam_cpu", "flowseam_cuda", "flowseam_accel")

SEAM, RUNTIME, LOOPS, MODELS, USERS = "seam", "runtime", "loops", "models", "users"
#: the layers, lowest first
ORDER = (SEAM, RUNTIME, LOOPS, MODELS, USERS)

#: module → its layer. ``pkg.*`` stands for the package ``pkg`` and every module under it; a
#: plain name for that module only (so a new top-level module of flowseam must be placed here).
LAYER = {
    # -- seam ---------------------------------------------------------------------------------
    "flowseam.seam.*": SEAM,            # the plugin contract and its resolution
    "flowseam.ops.*": SEAM,             # op names and contracts, the numpy oracle, eager refs
    "flowseam.errors": SEAM,            # the errors every layer raises
    # -- runtime: the root modules --------------------------------------------------------------
    "flowseam.attention": RUNTIME,         # the attention route the DiTs' processors call
    "flowseam.causal_attention": RUNTIME,  # block-causal masks and the KV cache's attention
    "flowseam.checkpoint_defaults": RUNTIME,  # a checkpoint's flowseam.json serving defaults
    "flowseam.media": RUNTIME,             # writing outputs, reading a conditioning image
    "flowseam.launch": RUNTIME,            # a command started as ranks; which rank failed
    "flowseam.memory": RUNTIME,            # offload, VAE tiling / slicing options and helpers
    "flowseam.noise": RUNTIME,             # initial noise, one generator per sample
    "flowseam.parallel": RUNTIME,          # ranks, process groups, split hooks
    "flowseam.prompt_refiner": RUNTIME,    # a causal LM that rewrites prompts (unified RL)
    "flowseam.quiet": RUNTIME,             # the libraries' output kept quiet
    "flowseam.request": RUNTIME,           # DiffusionParams, GenerationRequest and their checks
    "flowseam.request_fields": RUNTIME,    # a request's lora and cache values, parsed
    "flowseam.schedulers": RUNTIME,        # a checkpoint's scheduler config → solver, sigmas
    "flowseam.step_constants": RUNTIME,    # text-only DiT values reused across steps
    # -- loops --------------------------------------------------------------------------------
    "flowseam.loops.*": LOOPS,
    # -- models -------------------------------------------------------------------------------
    "flowseam.models.*": MODELS,
    "flowseam.loading": MODELS,         # flowseam.load: a checkpoint → a model instance
    "flowseam.workflows": MODELS,       # cross-model workflows
    # -- users --------------------------------------------------------------------------------
    "flowseam": USERS,                  # the public API (higher layers' names imported lazily)
    "flowseam.__main__": USERS,
    "flowseam._moved": USERS,           # old import paths, kept for one release
    "flowseam.cli.*": USERS,
    "flowseam.training.*": USERS,
    "flowseam.rewards.*": USERS,
    "flowseam.serve.*": USERS,
    "flowseam.demo.*": USERS,
    "flowseam.testing.*": USERS,        # the pytest plugin and the conformance suite
    **{f"{backend}.*": USERS for backend in BACKENDS},
}

#: the modules of the loops package shared by every loop (below them: they import no loop, and
#: may import each other)
LOOP_HELPERS = ("flowseam.loops.checks", "flowseam.loops.records", "flowseam.loops.solvers",
                "flowseam.loops.step_cache")


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


#: the only parts of flowseam a backend imports (docs/writing-a-backend.md says the same)
BACKEND_ROOTS = ("flowseam.seam", "flowseam.ops", "flowseam.testing")
#: every backend plugin of this repository: the in-repo backends and the test fixtures that
#: implement ``flowseam_backend`` (a plugin that only registers methods or rewards may use the
#: users' API, ``flowseam.load`` and the rest)
BACKEND_PACKAGES = [*PACKAGES[1:], *sorted(
    p for p in (REPO / "tests" / "fixtures").glob("**/src/*")
    if (p / "__init__.py").is_file() and "build" not in p.parts
    and any("def flowseam_backend(" in f.read_text() for f in p.rglob("*.py")))]


def _named_imports(source: str) -> set[str]:
    """The modules of flowseam the import statements of ``source`` name: ``from flowseam import
    ops`` names ``flowseam.ops`` (a submodule), ``from flowseam import hookimpl`` names
    ``flowseam`` (the package); the packages above a named module do not count."""
    core = _modules([PACKAGES[0]])
    named = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            named |= {a.name for a in node.names if a.name.split(".")[0] == "flowseam"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").split(".")[0] == "flowseam":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                named.add(sub if sub in core else node.module)
    return named


def _outside_backend_roots(source: str) -> list[str]:
    return sorted(m for m in _named_imports(source)
                  if not any(m == r or m.startswith(r + ".") for r in BACKEND_ROOTS))


def test_backends_import_the_seam_only():
    """A backend (the in-repo ones, every fixture backend, the one docs/writing-a-backend.md
    builds) imports :data:`BACKEND_ROOTS` of flowseam and nothing else: not the package
    ``flowseam`` (the users' API), a model, a loop or training."""
    assert len(BACKEND_PACKAGES) >= 8, BACKEND_PACKAGES
    for package in BACKEND_PACKAGES:
        for path in package.rglob("*.py"):
            assert _outside_backend_roots(path.read_text()) == [], path
    page = (REPO / "docs" / "writing-a-backend.md").read_text()
    blocks = re.findall(r"```python[^\n]*\n(.*?)```", page, re.S)
    assert any("hookimpl" in b for b in blocks)
    for block in blocks:
        assert _outside_backend_roots(block) == [], block[:200]
    promised = re.search(r"imports (`flowseam\.\w+`),\s+(`flowseam\.\w+`)\s+and\s+"
                         r"(`flowseam\.\w+`)\s+only", page)
    assert promised and sorted(g.strip("`") for g in promised.groups()) == sorted(BACKEND_ROOTS)
    # the check finds such an import when there is one
    for bad in ("from flowseam import hookimpl", "import flowseam", "from flowseam.models import x",
                "from flowseam.seam import x\nfrom flowseam.loops import run_loop"):
        assert _outside_backend_roots(bad) != [], bad
    for good in ("from flowseam import ops", "from flowseam.seam import hookimpl, instantiate",
                 "import flowseam.seam", "from flowseam.ops.eager import flow_sde_step",
                 "from flowseam.testing.tiny import write_tiny_checkpoint"):
        assert _outside_backend_roots(good) == [], good


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
    """A backend (the in-repo ones and the test fixtures are the examples vendors copy, with the
    one docs/writing-a-backend.md builds) uses flowseam's public API only: no ``_``-prefixed
    module, function or attribute of flowseam."""
    for package in BACKEND_PACKAGES:
        for path in package.rglob("*.py"):
            assert _private_names_of_core(path.read_text()) == [], path
    page = (REPO / "docs" / "writing-a-backend.md").read_text()
    for block in re.findall(r"```python[^\n]*\n(.*?)```", page, re.S):
        assert _private_names_of_core(block) == [], block[:200]
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


def test_models_call_the_loops_and_loops_never_import_models():
    """``ModelInstance.generate`` calls :func:`flowseam.loops.run_loop`: the models import the
    loops, the loops (below them) drive a model's step bodies without importing any model."""
    graph = _imports(PACKAGES)
    assert "flowseam.loops" in graph["flowseam.models.instance"]
    for loop in (m for m in graph if m.startswith("flowseam.loops")):
        assert not any(d.startswith("flowseam.models") for d in graph[loop]), loop


# -- what a reader can hold ----------------------------------------------------------------------

#: where every function must fit on a screen: the command line, the server, loading and the cards
HOLDABLE = ("cli/", "serve/", "loading.py", "models/")
#: the longest function those may hold without a reason written next to it
MAX_FUNCTION_LINES = 60
#: the longest module docstring: the design in a few lines (details go to the functions' own
#: docstrings and to docs/)
MAX_MODULE_DOCSTRING_LINES = 15
#: what a measurement looks like in prose: a figure with a unit of time, memory or speed, or the
#: words that report one (figures go to docs/benchmarks.md)
MEASUREMENT = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|µs|us|s|seconds|minutes|min|MiB|GiB|MB|GB)\b|"
                         r"\bmeasured\b|\d\s?x (?:faster|slower)|\bspeed-?ups? of\b", re.I)


def _core_files() -> list[Path]:
    return sorted(p for p in PACKAGES[0].rglob("*.py"))


def _long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (N lines)`` of the functions of ``source`` longer than ``limit`` lines with no
    ``# long:`` comment (the reason) on the line above their ``def`` or decorators."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            reason = first >= 2 and lines[first - 2].strip().startswith("# long:")
            if length > limit and not reason:
                found.append(f"{node.name} ({length} lines)")
    return found


def test_functions_a_reader_can_hold():
    """No function over :data:`MAX_FUNCTION_LINES` lines in the command line, the server,
    loading or the cards without its reason written next to it (``# long: ...``)."""
    long = {str(p.relative_to(PACKAGES[0])): _long_functions(p.read_text()) for p in _core_files()
            if str(p.relative_to(PACKAGES[0])).startswith(HOLDABLE)}
    assert {k: v for k, v in long.items() if v} == {}
    # the check finds such a function when there is one, and accepts a written reason
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    assert _long_functions(f"def f():\n{body}") == ["f (62 lines)"]
    assert _long_functions(f"# long: one option a line\ndef f():\n{body}") == []


def _docstrings(path: Path) -> list[tuple[str, str]]:
    """``(where, docstring)`` of a module and its classes."""
    tree = ast.parse(path.read_text())
    found = [("module", ast.get_docstring(tree, clean=False) or "")]
    found += [(f"class {n.name}", ast.get_docstring(n, clean=False) or "")
              for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return found


def test_docstrings_state_the_design_in_a_few_lines():
    """A module's docstring is at most :data:`MAX_MODULE_DOCSTRING_LINES` lines, and neither it
    nor a class docstring reports a measurement (timings, sizes measured: docs/benchmarks.md
    holds the figures, each with the command that measured it), in core and the backends."""
    long, figures = [], []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            where = str(path.relative_to(package.parent))
            for what, doc in _docstrings(path):
                if what == "module" and len(doc.strip().splitlines()) > MAX_MODULE_DOCSTRING_LINES:
                    long.append(f"{where} ({len(doc.strip().splitlines())} lines)")
                figures += [f"{where} {what}: {m.group(0)!r}" for m in MEASUREMENT.finditer(doc)]
    assert long == [] and figures == []
    assert MEASUREMENT.search("a decode took 11 ms against 2.3 ms") is not None
    assert MEASUREMENT.search("22 MiB instead of 540 MiB") is not None
    assert MEASUREMENT.search("the latents (B, 16, F, H / 8, W / 8) float32 in [0, 1]") is None


def test_no_two_modules_or_classes_of_core_share_a_name():
    """A name says one thing: no two modules or packages of core share a name (but the
    entry-point modules, ``plugin.py``; a model family's loop and card, ``loops/ltx2.py`` and
    ``models/ltx2.py``; a command and what it runs, ``cli/serve.py`` and ``serve/``), and no two
    classes of core share a name."""
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for path in _core_files():
        rel = path.relative_to(PACKAGES[0]).as_posix()
        if path.name != "__init__.py":
            modules.setdefault(path.stem, []).append(rel)
        elif path.parent != PACKAGES[0]:  # a package's name counts as a module's
            modules.setdefault(path.parent.name, []).append(rel.removesuffix("/__init__.py"))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(rel)
    def allowed(name: str, paths: list[str]) -> bool:
        """Entry-point modules; one family's loop and card; a command and what it runs."""
        rest = sorted(set(paths) - {f"cli/{name}.py"})
        return (name == "plugin" or sorted(paths) == [f"loops/{name}.py", f"models/{name}.py"]
                or (len(rest) == 1 and len(paths) == 2))

    assert {n: p for n, p in modules.items() if len(p) > 1 and not allowed(n, p)} == {}
    assert {n: p for n, p in classes.items() if len(p) > 1} == {}


def test_the_command_line_imports_no_torch_until_a_command_needs_it():
    """``flowseam --help`` and ``flowseam COMMAND --help`` stay quick: building the command line's
    parser imports neither torch nor any model library (a command imports them when it runs;
    discovery imports torch before any plugin, which all import it)."""
    import subprocess
    import sys

    code = ("import sys, flowseam.cli; flowseam.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_architecture_page_draws_these_layers_from_the_tree():
    """docs/architecture.md's layer drawing lists every top-level module and package of core,
    each in the layer :data:`LAYER` gives it, and nothing that is not there."""
    page = (REPO / "docs" / "architecture.md").read_text()
    drawing = page.split("## The layers, drawn from the tree", 1)[1].split("```")[1]
    drawn = dict(re.findall(r"^  (\S+)\s+(seam|runtime|loops|models|users)\s", drawing, re.M))
    core = PACKAGES[0]
    tree = {p.name + ("/" if p.is_dir() else ""): p for p in core.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert sorted(drawn) == sorted(tree)
    for name, layer in drawn.items():
        module = "flowseam" if name == "__init__.py" else f"flowseam.{name.rstrip('/').removesuffix('.py')}"
        assert _layer(module) == layer, (name, layer, _layer(module))


def test_the_paths_that_moved_still_import_with_a_deprecation_warning():
    """Every import path that moved in 0.2 (:data:`flowseam._moved.MOVED`) still imports, with a
    DeprecationWarning naming where it is now and the line that asked for it, and gives every
    name of every module its names went to (a renamed one under its old name)."""
    import subprocess
    import sys

    from flowseam._moved import MOVED

    code = (
        "import importlib, warnings\n"
        "from flowseam._moved import MOVED, RENAMED\n"
        "for old, new in MOVED.items():\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        module = importlib.import_module(old)\n"
        "    said = [w for w in caught if w.category is DeprecationWarning]\n"
        "    assert any(f'{old} moved to {new[0]}' in str(w.message) and w.filename == '<string>'\n"
        "               for w in said), (old, [(str(w.message), w.filename) for w in said])\n"
        "    for target in map(importlib.import_module, new):\n"
        "        for name in getattr(target, '__all__', None) or [n for n in vars(target)\n"
        "                                                        if not n.startswith('_')]:\n"
        "            if not any(hasattr(importlib.import_module(n), name) for n in\n"
        "                       new[:new.index(target.__name__)]):\n"
        "                assert getattr(module, name) is getattr(target, name), (old, name)\n"
        "    for was, now in RENAMED.get(old, {}).items():\n"
        "        assert getattr(module, was) is getattr(importlib.import_module(new[0]), now)\n"
        "from flowseam.components import instantiate\n"
        "from flowseam.faults import check_step, kernel_fault\n"
        "from flowseam.kernels import Conflict\n"
        "from flowseam.seam import instantiate as new\n"
        "assert instantiate is new and Conflict.__name__ == 'KernelConflict'\n"
        "print(len(MOVED))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(MOVED))
    # the old paths name modules that are gone from the tree, the new ones modules that exist
    modules = _modules([PACKAGES[0]])
    assert not set(MOVED) & set(modules)
    assert {n for new in MOVED.values() for n in new} <= set(modules)
