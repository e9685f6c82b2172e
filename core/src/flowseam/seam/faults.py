"""Naming plugin faults: the errors raised when a plugin's kernel or component misbehaves at run
time (the loops' checks that catch what does not raise: :mod:`flowseam.loops.checks`).

Every fault names the plugin, its distribution and version, the op or component kind and, for a
kernel, its ``impl_id``, chains the original exception as ``__cause__``, and says how to run
without the plugin: flowseam does not retry on another backend by itself (a retry would double
the time, hide the fault and return an output from a backend the user did not choose). Running
out of memory is not a plugin fault (:func:`is_out_of_memory`): it passes through unchanged.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Sequence

from ..errors import (
    ComponentFaultError, KernelArgumentError, KernelFaultError,
)

if TYPE_CHECKING:  # pragma: no cover
    from .components import ComponentRecord
    from .declarations import Provenance

#: The device every chain ends in; a plugin serving another device can be avoided with it.
_TERMINAL_DEVICE = "cpu"


def _without(plugin: str, device: str) -> str:
    ways = [f"FLOWSEAM_DISABLE_PLUGINS={plugin}"]
    if device != _TERMINAL_DEVICE:
        ways.insert(0, "--backend cpu (flowseam.Platform('cpu'))")
    return f"to run without it: {' or '.join(ways)}"


def kernel_fault(prov: "Provenance", problem: str, cause: BaseException | None = None) -> KernelFaultError:
    """The error for kernel ``prov`` having ``problem`` (``"raised RuntimeError: ..."``,
    ``"returned shape (1, 3) for input (1, 4)"``). A ``ValueError`` cause (the op contract's
    argument rejection) gives a :class:`KernelArgumentError`, which is also a ``ValueError``."""
    kind = KernelArgumentError if isinstance(cause, ValueError) else KernelFaultError
    return kind(f"kernel {prov.op!r} of plugin {prov.plugin!r} ({prov.distribution} {prov.version}, "
                f"device {prov.device}, arch {prov.arch}; impl_id {prov.impl_id}) {problem}; "
                f"{_without(prov.plugin, prov.device)}",
                prov.plugin, prov.distribution, prov.version, prov.op, prov.impl_id)


def component_fault(records: "ComponentRecord | Sequence[ComponentRecord]", problem: str) -> ComponentFaultError:
    """The error for the component(s) ``records`` (where the platform built them) having
    ``problem``; several records (a stage that runs two text encoders) are named together."""
    recs = [records] if not isinstance(records, (list, tuple)) else list(records)
    names = ", ".join(repr(r.name) for r in recs)
    kinds = ", ".join(dict.fromkeys(r.kind for r in recs))
    owners = list(dict.fromkeys((r.plugin, r.distribution, r.version, r.device) for r in recs))
    by = "; ".join(f"plugin {p!r} ({d} {v}, device {dev})" for p, d, v, dev in owners)
    plugin, dist, version, device = owners[0]
    return ComponentFaultError(
        f"component {names} (kind {kinds}) built by {by} {problem}; {_without(plugin, device)}",
        ", ".join(o[0] for o in owners), ", ".join(o[1] for o in owners),
        ", ".join(o[2] for o in owners), kinds)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out: ``MemoryError``, torch's ``OutOfMemoryError`` (CUDA
    and other accelerators) or the CPU allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't
    allocate memory"). Such an error is the request's size, not the plugin's fault."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def describe(exc: BaseException) -> str:
    """``"raised RuntimeError: message"``, the first line of the message only."""
    text = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {text[0]}" if text else "")
