"""Compile once per module and input signature; book compile seconds apart from run seconds.

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

_LOCK = threading.Lock()


@dataclass
class _Entry:
    compile_s: float = 0.0
    run_s: float = 0.0
    calls: int = 0
    compiles: int = 0
    signatures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"compile_s": self.compile_s, "run_s": self.run_s, "calls": self.calls,
                "compiles": self.compiles, "signatures": list(self.signatures)}


_ENTRIES: dict[str, _Entry] = {}
_SEEN: dict[str, set[str]] = {}  # input signatures announced per entry name (see Timed)


def compile_report() -> dict[str, Any]:
    """Compile and run seconds of everything accel compiled in this process.

    :returns: ``{"compile_s": float, "run_s": float, "calls": int, "compiles": int,
        "entries": {name: {"compile_s", "run_s", "calls", "compiles", "signatures"}}}``:
        ``compiles`` counts the calls that compiled (one per new signature), ``signatures`` lists
        their inputs (``"f32[1,16,2,4,4]"``), ``calls`` counts every call.
    """
    with _LOCK:
        entries = {name: e.as_dict() for name, e in sorted(_ENTRIES.items())}
    return {
        "compile_s": sum(e["compile_s"] for e in entries.values()),
        "run_s": sum(e["run_s"] for e in entries.values()),
        "calls": sum(e["calls"] for e in entries.values()),
        "compiles": sum(e["compiles"] for e in entries.values()),
        "entries": entries,
    }


def reset_compile_report() -> None:
    """Forget every booked second (the compiled code itself stays cached)."""
    with _LOCK:
        _ENTRIES.clear()


_AOT_EVENTS = 0  # AOTInductor packages built or loaded (flowseam_accel.aot)


def count_compile_event() -> None:
    """Book that the current call built or loaded compiled code outside dynamo (an AOTInductor
    package, :mod:`flowseam_accel.aot`)."""
    global _AOT_EVENTS
    with _LOCK:
        _AOT_EVENTS += 1


def _compile_events() -> int:
    """Graphs dynamo has built plus frames it has converted in this process (fullgraph
    compiles count only the former, graph-breaking ones both; either growing means work), plus
    AOTInductor packages built or loaded."""
    from torch._dynamo.utils import counters  # imported by torch.compile already

    return counters["stats"]["unique_graphs"] + counters["frames"]["total"] + _AOT_EVENTS


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
    whether it compiled. Wrappers with the same ``name`` (the blocks of one class in a regionally
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
                message = (f"accel: compiling {self.name} for new input shapes "
                           "(first call; cached on disk afterwards)")
                with long_wait(message) as wait:
                    out, compiled = self._call(args, kwargs)
                    wait.outcome = "compiled" if compiled else "ready (compiled before)"
                return out
        return self._call(args, kwargs)[0]

    def _call(self, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """``(fn's result, whether dynamo compiled during the call)``, booked."""
        events = _compile_events()
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        compiled = _compile_events() != events
        if compiled and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        with _LOCK:
            entry = _ENTRIES.setdefault(self.name, _Entry())
            entry.calls += 1
            if compiled:
                entry.compiles += 1
                entry.compile_s += seconds
                entry.signatures.append(signature(args, kwargs))
            else:
                entry.run_s += seconds
        return out, compiled

    def __repr__(self) -> str:
        return f"<Timed {self.name!r} {self.fn!r}>"


def compile_function(fn: Callable, name: str, **options: Any) -> Timed:
    """``torch.compile(fn, **options)``, timed under ``name``.

    The compiled wrapper is created on the first call, so importing a module full of compiled
    kernels (as flowseam's discovery does) does not import dynamo.
    """
    compiled: Callable | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return Timed(name, call)


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
