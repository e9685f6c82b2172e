"""Compile once per module and input signature; book compile seconds apart from run seconds.

Two compilers: ``torch.compile`` (below), and for the CPU calls of the solver kernels
AOTInductor packages (:class:`AOTFunction`, :func:`compile_function`'s ``aot``), which a later
process loads without dynamo; the DiT blocks' packages are :mod:`flowseam_accel.aot`'s. Both
kinds live in :mod:`flowseam_accel.store`.

``torch.compile`` is lazy. The first call with a new input *signature* (shapes, dtypes, devices,
grad mode) traces the function with dynamo and generates code with inductor, then runs it; later
calls with the same signature only check the guards and run the generated code. So a compiled
component costs its compile time once per signature, and that cost must not be mistaken for its
speed.

How the two are separated
    Every compiled entry point of accel (the DiT's blocks, the solver kernels) is wrapped in a
    :class:`Timed`, which times each call with ``time.perf_counter`` and reads dynamo's own counters
    of built graphs and converted frames (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``
    and ``["frames"]["total"]``) before and after. A call during which dynamo built a graph is
    booked as **compile** time, and its input signature is recorded; every other call is booked as
    **run** time. A compile call's seconds include its one execution (separating them would mean
    running twice); on CUDA it synchronizes the device before stopping the clock, while run calls do
    not (their seconds are host-side launch time, like any asynchronous CUDA call).

    Building or loading an AOTInductor package is booked the same way
    (:func:`count_compile_event`): a compile call whose signature is recorded; a compile call
    that only loaded packages (nothing was traced or compiled) is also counted as a load.

    Caveat: the counter is process-wide, so a *different* compiled function compiling in another
    thread during one of ours is booked to ours.

:func:`compile_report` returns the totals and a per-entry breakdown; :func:`reset_compile_report`
clears them. Entry names are ``"<kind>:<component name>"`` (``"dit:transformer"``), with the
block class for a regionally compiled DiT (``"dit:transformer.WanTransformerBlock"``), and the op
name for kernels (``"flow_sde_step.sample"``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import store

_LOCK = threading.Lock()


@dataclass
class _Entry:
    compile_s: float = 0.0
    run_s: float = 0.0
    calls: int = 0
    compiles: int = 0
    loads: int = 0
    signatures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"compile_s": self.compile_s, "run_s": self.run_s, "calls": self.calls,
                "compiles": self.compiles, "loads": self.loads,
                "signatures": list(self.signatures)}


_ENTRIES: dict[str, _Entry] = {}
_SEEN: dict[str, set[str]] = {}  # input signatures announced per entry name (see Timed)


def compile_report() -> dict[str, Any]:
    """Compile and run seconds of everything accel compiled in this process.

    :returns: ``{"compile_s": float, "run_s": float, "calls": int, "compiles": int,
        "loads": int, "entries": {name: {"compile_s", "run_s", "calls", "compiles", "loads",
        "signatures"}}}``: ``compiles`` counts the calls that compiled or loaded compiled code
        (one per new signature of each compiled function: a model built again in this process
        books its signatures again; their seconds are ``compile_s``), ``loads`` those of them that
        only loaded AOTInductor packages compiled before, ``signatures`` lists their inputs
        (``"f32[1,16,2,4,4]"``), ``calls`` counts every call.
    """
    with _LOCK:
        entries = {name: e.as_dict() for name, e in sorted(_ENTRIES.items())}
    return {
        "compile_s": sum(e["compile_s"] for e in entries.values()),
        "run_s": sum(e["run_s"] for e in entries.values()),
        "calls": sum(e["calls"] for e in entries.values()),
        "compiles": sum(e["compiles"] for e in entries.values()),
        "loads": sum(e["loads"] for e in entries.values()),
        "entries": entries,
    }


def reset_compile_report() -> None:
    """Forget every booked second (the compiled code itself stays cached)."""
    with _LOCK:
        _ENTRIES.clear()


_AOT_EVENTS = {"built": 0, "loaded": 0}  # AOTInductor packages (flowseam_accel.store)


def count_compile_event(built: bool = True) -> None:
    """Book that the current call built (``built``) or loaded compiled code outside dynamo (an
    AOTInductor package, :mod:`flowseam_accel.store`)."""
    with _LOCK:
        _AOT_EVENTS["built" if built else "loaded"] += 1


def _compile_events() -> tuple[int, int]:
    """``(built, loaded)``: graphs dynamo has built plus frames it has converted in this
    process (fullgraph compiles count only the former, graph-breaking ones both; either growing
    means work) plus AOTInductor packages built; AOTInductor packages loaded."""
    from torch._dynamo.utils import counters  # imported by torch.compile already

    return (counters["stats"]["unique_graphs"] + counters["frames"]["total"]
            + _AOT_EVENTS["built"], _AOT_EVENTS["loaded"])


_DTYPE_SHORT = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16",
                torch.float16: "f16", torch.int64: "i64", torch.int32: "i32", torch.bool: "b"}


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = _DTYPE_SHORT.get(value.dtype, str(value.dtype).removeprefix("torch."))
        return f"{dtype}[{','.join(map(str, value.shape))}]"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({len(value)})"
    return type(value).__name__


def signature(args: tuple, kwargs: dict) -> str:
    """A short description of a call's inputs, e.g. ``"f32[2,64], f32[2,64], f32[5]"``."""
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in kwargs.items() if v is not None]
    return ", ".join(parts)


class Timed:
    """Calls ``fn`` and books the seconds under ``name`` as compile or run time (see the module
    docstring). Transparent otherwise: same arguments, same result, exceptions propagate.

    When flowseam's notices are on (the ``flowseam`` command turns them on), the first call with
    each input signature is announced with :func:`flowseam.console.long_wait` — a compile takes
    minutes on a small CPU and would otherwise look like a hang — and its closing line says
    whether it compiled, only loaded packages compiled before, or neither, and the seconds it
    took. Wrappers with the same ``name`` (the blocks of one class in a regionally
    compiled DiT) share what they have seen, so a signature is announced once per name."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name = name
        self.fn = fn
        self._seen = _SEEN.setdefault(name, set())
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from flowseam.console import long_wait, notices_enabled

        if notices_enabled():
            sig = signature(args, kwargs)
            if sig not in self._seen:
                self._seen.add(sig)
                message = (f"accel: preparing {self.name} for new input shapes "
                           "(compiled on the first call, cached on disk)")
                with long_wait(message) as wait:
                    out, compiled = self._call(args, kwargs)
                    wait.outcome = {"compiled": "compiled", "loaded": "loaded (compiled before)",
                                    None: "ready (compiled before)"}[compiled]
                return out
        return self._call(args, kwargs)[0]

    def _call(self, args: tuple, kwargs: dict) -> tuple[Any, str | None]:
        """``(fn's result, what happened)``, booked: ``"compiled"`` when dynamo built a graph or
        an AOTInductor package was built during the call, ``"loaded"`` when packages compiled
        before were only loaded, else ``None``."""
        built, loaded = _compile_events()
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        now = _compile_events()
        compiled = ("compiled" if now[0] != built else "loaded" if now[1] != loaded else None)
        if compiled and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        with _LOCK:
            entry = _ENTRIES.setdefault(self.name, _Entry())
            entry.calls += 1
            if compiled:
                entry.compiles += 1
                entry.loads += compiled == "loaded"
                entry.compile_s += seconds
                entry.signatures.append(signature(args, kwargs))
            else:
                entry.run_s += seconds
        return out, compiled

    def __repr__(self) -> str:
        return f"<Timed {self.name!r} {self.fn!r}>"


def compile_function(fn: Callable, name: str, *, aot: tuple | None = None,
                     aot_dtypes: tuple[torch.dtype, ...] = (), **options: Any) -> Timed:
    """``torch.compile(fn, **options)``, timed under ``name``; with ``aot``, calls on the CPU run
    an AOTInductor package of ``fn`` instead (:class:`AOTFunction`), which a later process loads
    without dynamo.

    :param aot: per positional argument of ``fn`` (all tensors), a tuple of dimension names, one
        per dimension: a name is a dynamic size (equal names, equal sizes), ``None`` the size of
        the first call. ``None``: no packages.
    :param aot_dtypes: the dtypes of the first argument whose calls get packages (the others
        take the ``torch.compile`` path).

    The ``torch.compile`` wrapper is created on the first call that needs it, so importing a
    module full of compiled kernels (as flowseam's discovery does) does not import dynamo, and a
    process whose calls all run packages never imports inductor's compiler.
    """
    compiled: Callable | None = None
    packaged = AOTFunction(fn, name, aot, aot_dtypes) if aot is not None else None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if packaged is not None and not kwargs:
            out = packaged(*args)
            if out is not NotImplemented:
                return out
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    call.aot = packaged
    return Timed(name, call)


def _source(fn: Callable) -> str:
    """``fn``'s source code (its bytecode and names where the source is not installed) and the
    values of the plain module constants it reads (``_A``, ``_STD``, ...): what the export
    freezes into a package."""
    import inspect

    code = fn.__code__
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError):
        text = f"{code.co_code.hex()} {code.co_names} {code.co_varnames}"
    constants = {n: repr(fn.__globals__[n]) for n in code.co_names
                 if isinstance(fn.__globals__.get(n), (int, float, bool, str))}
    return f"{text}\n{sorted(constants.items())}"


_AOT_SWITCH: list[bool] = []   # FLOWSEAM_ACCEL_AOT, read on the first packaged call


class AOTFunction:
    """The CPU calls of a plain tensor function (accel's solver kernels) through AOTInductor
    packages of :mod:`flowseam_accel.store`: one package per dtypes of the arguments, exported
    with ``torch.export`` with the sizes named in ``dims`` dynamic (at least 1, no upper bound),
    compiled on the first call whose package is not on disk yet and loaded (milliseconds, no
    dynamo) by every later process.

    ``__call__`` returns :data:`NotImplemented` for a call it does not run, and the caller takes
    its ``torch.compile`` path: an argument off the CPU, a first argument whose dtype is not in
    ``dtypes``, a dynamic size of 0 (torch specializes it), keyword arguments,
    ``FLOWSEAM_ACCEL_AOT=0`` (read once per process, on the first call: a value that is not a
    switch raises ``ValueError``), or dtypes whose export or compile failed (recorded in the
    store; said once when flowseam's notices are on). Which path a call takes depends only on
    its arguments' devices, dtypes and sizes and on the store, so two calls with the same
    arguments run the same code (what :mod:`flowseam_accel.kernels` needs for its bit-for-bit
    log-prob recompute).

    Key of a package (:meth:`_key`): torch's, Python's and accel's versions, the CPU capability,
    ``name``, the function's source code and the plain module constants it reads, the
    arguments' dtypes and ``dims``.
    """

    def __init__(self, fn: Callable, name: str, dims: tuple, dtypes: tuple[torch.dtype, ...]) -> None:
        self.fn, self.name, self.dims, self.dtypes = fn, name, dims, dtypes
        self._dynamic = [[j for j, d in enumerate(names) if d is not None] for names in dims]
        self._by_dtypes: dict[tuple, list] = {}   # argument dtypes -> packages (or store.FAILED)
        self._loaded: set = set()
        self._lock = threading.Lock()

    def __call__(self, *args: torch.Tensor) -> Any:
        if (args[0].dtype not in self.dtypes or len(args) != len(self.dims)
                or any(a.device.type != "cpu" for a in args)):
            return NotImplemented
        if not _AOT_SWITCH:
            _AOT_SWITCH.append(store.enabled())
        if not _AOT_SWITCH[0]:
            return NotImplemented
        shapes = tuple(a.shape for a in args)
        if any(shape[j] == 0 for shape, dyn in zip(shapes, self._dynamic) for j in dyn):
            return NotImplemented
        dtypes = tuple(a.dtype for a in args)
        with self._lock:   # a package's runner is not reentrant; builds happen once
            package = self._find(dtypes, shapes)
            if package is None:
                package = self._build(args, dtypes, shapes)
            if package is store.FAILED:
                return NotImplemented
            # contiguous, as exported: the generated code computes strides from the sizes
            return package([a.contiguous() for a in args])

    def _find(self, dtypes: tuple, shapes: tuple) -> Any:
        return store.loaded(self._by_dtypes.get(dtypes, ()), shapes)

    def _key(self, args: tuple) -> str:
        import hashlib
        import json
        import sys

        from . import __version__

        described = {
            "torch": torch.__version__, "accel": __version__, "python": sys.version_info[:2],
            "cpu": torch.backends.cpu.get_cpu_capability(), "name": self.name,
            "source": _source(self.fn), "dtypes": [str(a.dtype) for a in args],
            "dims": [list(d) for d in self.dims],
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]

    def _build(self, args: tuple, dtypes: tuple, shapes: tuple) -> Any:
        """Load the package for these dtypes from the store, or export and compile it there."""
        return store.obtain(self._key(args), shapes, self._loaded,
                            self._by_dtypes.setdefault(dtypes, []),
                            lambda path: self._export(args, path), self._say)

    def _export(self, args: tuple, path) -> dict:
        """Export ``fn`` on fresh example tensors (the call's static sizes; distinct sizes per
        dynamic name; never the call's own tensors, which may alias one another) and compile
        it into ``path`` (:func:`flowseam_accel.store.write`)."""
        from torch.export import Dim

        names = list(dict.fromkeys(d for names in self.dims for d in names if d is not None))
        symbols = {n: Dim(n, min=1) for n in names}
        example = {n: 3 + 2 * i for i, n in enumerate(names)}
        seeded = torch.Generator().manual_seed(0)   # the global RNG stays untouched
        inputs = tuple(torch.randn([example[d] if d is not None else size
                                    for d, size in zip(names_, a.shape)],
                                   dtype=a.dtype, generator=seeded)
                       for names_, a in zip(self.dims, args))
        dynamic = tuple({j: symbols[d] for j, d in enumerate(names_) if d is not None}
                        for names_ in self.dims)
        fn = self.fn

        class _Call(torch.nn.Module):
            def forward(self, *tensors):
                return fn(*tensors)

        with torch.no_grad(), store.quiet():
            program = torch.export.export(_Call(), inputs, dynamic_shapes=(dynamic,), strict=False)
            return store.write(program, path)

    def _say(self, message: str) -> None:
        from flowseam.console import notices_enabled

        if notices_enabled():
            import sys

            print(f"accel: {self.name}: {message}", file=sys.stderr)


def compile_module(module: torch.nn.Module, name: str, **options: Any) -> torch.nn.Module:
    """Compile ``module`` in place, as ``nn.Module.compile(**options)`` does, and time its calls.

    In place means the object keeps its class, config, parameters and methods (``isinstance``,
    ``module.config``, ``state_dict()`` all as before); only ``module(...)`` runs compiled code.
    ``nn.Module.compile`` stores ``torch.compile(module._call_impl)`` in
    ``module._compiled_call_impl``, which ``module.__call__`` prefers (hooks registered on the
    module still run inside the compiled region). We store there a :class:`Timed` that creates
    that ``torch.compile`` wrapper on its first call (:func:`compile_function`): creating it
    imports inductor (about 2 CPU s), which a process whose calls all run AOTInductor packages
    (:mod:`flowseam_accel.aot`) never needs. ``copy.deepcopy`` drops the attribute, as for
    ``nn.Module.compile``.
    """
    module._compiled_call_impl = compile_function(module._call_impl, name, **options)
    return module
