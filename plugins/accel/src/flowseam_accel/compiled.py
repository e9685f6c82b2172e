"""``torch.compile`` with the seconds spent compiling booked apart from the seconds spent running.

``torch.compile`` is lazy: the first call with a new input *signature* (shapes, dtypes, devices,
grad mode, whatever the compiled code's guards check) traces the Python code with dynamo and
generates code with inductor, then runs it; later calls only check the guards and run. A
compiled component costs its compile time once per signature, and that cost must not be
mistaken for its speed. Every entry point accel compiles (a DiT's ``forward``, a VAE's
``encode`` and ``decode``, each solver kernel's arithmetic) is therefore wrapped in a
:class:`Timed`, which books each call as **compile** or **run** time (:meth:`Timed.book`);
:func:`compile_report` adds them up.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

_LOCK = threading.Lock()
_ENTRIES: dict[str, dict[str, Any]] = {}
_SEEN: dict[str, set[str]] = {}  # signatures announced per entry name (see Timed)


def compile_report() -> dict[str, Any]:
    """Compile and run seconds of everything accel compiled in this process.

    :returns: ``{"compile_s", "run_s", "calls", "compiles", "entries": {name: {"compile_s",
        "run_s", "calls", "compiles", "signatures"}}}``: ``compiles`` counts the calls during
        which dynamo built a graph, ``signatures`` their inputs (``"float32[1,16,2,4,4]"``).
        Entries are named ``"<kind>:<component name>"`` (``"dit:transformer"``,
        ``"vae:vae.decode"``) and by op for the kernels (``"flow_sde_step.sample"``).
    """
    with _LOCK:
        entries = {name: {**e, "signatures": list(e["signatures"])}
                   for name, e in sorted(_ENTRIES.items())}
    totals = {key: sum(e[key] for e in entries.values())
              for key in ("compile_s", "run_s", "calls", "compiles")}
    return {**totals, "entries": entries}


def reset_compile_report() -> None:
    """Forget every booked second (the compiled code itself stays cached)."""
    with _LOCK:
        _ENTRIES.clear()


def _graphs_built() -> int:
    from torch._dynamo.utils import counters  # imported by torch.compile already

    return counters["stats"]["unique_graphs"] + counters["frames"]["total"]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{','.join(map(str, value.shape))}]"
    kind = type(value).__name__
    return f"{kind}({len(value)})" if isinstance(value, (list, tuple)) else kind


def signature(args: tuple, kwargs: dict) -> str:
    """A short description of a call's inputs, e.g. ``"float32[2,64], float32[5]"``."""
    return ", ".join([_describe(a) for a in args]
                     + [f"{k}={_describe(v)}" for k, v in kwargs.items() if v is not None])


class Timed:
    """Calls ``fn`` and books its seconds under ``name`` as compile or run time (:meth:`book`);
    same arguments, same result, exceptions propagate. When flowseam's notices are
    on (the ``flowseam`` command), the first call with each input signature is announced with
    :func:`flowseam.seam.long_wait`: a cold compile takes minutes on a small CPU."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name, self.fn = name, fn
        self.seen = _SEEN.setdefault(name, set())
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from flowseam.seam import long_wait, notices_enabled

        if notices_enabled():
            sig = signature(args, kwargs)
            if sig not in self.seen:
                self.seen.add(sig)
                with long_wait(f"accel: preparing {self.name} for new input shapes (compiled on "
                               "the first call, cached on disk)") as wait:
                    out, compiled = self.book(args, kwargs)
                    wait.outcome = "compiled" if compiled else "ready (compiled before)"
                return out
        return self.book(args, kwargs)[0]

    def book(self, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """Call ``fn`` once: a call during which dynamo built a graph or converted a frame
        (``torch._dynamo.utils.counters``: torch has no public counter) is booked as compile
        time, its one execution included, and its input signature recorded; every other call as
        run time. The counters are process-wide, so a function compiling in another thread
        meanwhile is booked to the running call. On CUDA a compile call synchronizes before its
        clock stops.

        :returns: ``(fn's result, whether the call compiled)``.
        """
        before, start = _graphs_built(), time.perf_counter()
        out = self.fn(*args, **kwargs)
        compiled = _graphs_built() != before
        if compiled and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        with _LOCK:
            entry = _ENTRIES.setdefault(self.name, {"compile_s": 0.0, "run_s": 0.0, "calls": 0,
                                                    "compiles": 0, "signatures": []})
            entry["calls"] += 1
            if compiled:
                entry["compiles"] += 1
                entry["compile_s"] += seconds
                entry["signatures"].append(signature(args, kwargs))
            else:
                entry["run_s"] += seconds
        return out, compiled


def compile_function(fn: Callable, name: str, **options: Any) -> Timed:
    """``torch.compile(fn, **options)``, timed under ``name``. The compiled wrapper is created on
    the first call, so importing a module of compiled kernels (as plugin discovery does) does not
    import dynamo."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return Timed(name, call)


def time_methods(obj: Any, methods: tuple[str, ...], name: str) -> None:
    """Replace each of ``obj``'s ``methods`` (those it has) by a :class:`Timed` of itself, an
    instance attribute named ``"<name>.<method>"`` (``"<name>"`` for ``forward``). The wrapped
    method stays bound to ``obj``, so ``copy.deepcopy(obj)`` gets one bound to the copy."""
    for method in methods:
        bound = getattr(obj, method, None)
        if callable(bound):
            setattr(obj, method, Timed(name if method == "forward" else f"{name}.{method}", bound))
