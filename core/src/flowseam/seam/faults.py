"""Naming plugin faults: the errors raised when a plugin's kernel or component misbehaves at run
time, and the checks that catch what does not raise (a wrong shape, dtype or device, non-finite
values, a string instead of a module).

Every fault names the plugin, its distribution and version, the op or component kind and, for a
kernel, its ``impl_id``, and chains the original exception as ``__cause__``. flowseam does not
retry a failed request on another backend by itself (a retry would double the time, hide the
fault and return an output from a backend the user did not choose); the message says how to run
without the plugin instead.

Cost on the success path: a kernel call runs inside one ``try`` (free in CPython 3.11+); the
loops check each step's output with attribute comparisons and one sum over the latents (its
finiteness; ``bench/step_check.py`` measures it against the element-wise test and a real DiT
step), and look for the culprit (velocity or kernel) only once a check has failed.

Running out of memory is not a plugin fault: :func:`is_out_of_memory` errors pass through the
kernel and component wrappers unchanged, so callers see the allocator's own error (the server
answers it as ``out_of_memory``; the CLI says which request was too large).
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..errors import (
    ComponentFaultError, FlowseamError, KernelArgumentError, KernelFaultError,
    NotEnoughMemoryError,
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


@contextlib.contextmanager
def component_faults(model: Any, kinds: tuple[str, ...], doing: str) -> Iterator[None]:
    """Name the plugin when a component of ``kinds`` raises inside the block: any exception but
    a :class:`FlowseamError` becomes a :class:`ComponentFaultError` naming the components of those
    kinds in ``model.component_records`` (where the platform built each), with the original as
    ``__cause__``. A model without records re-raises unchanged."""
    try:
        yield
    except FlowseamError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            advice = getattr(model, "memory_advice", None)
            if advice is None or isinstance(exc, NotEnoughMemoryError):
                raise
            raise NotEnoughMemoryError(f"{describe(exc).removeprefix('raised ')} while {doing}; "
                                       f"{advice(kinds)}") from exc
        records = records_of_kind(model, kinds)
        if not records:
            raise
        raise component_fault(records, f"{describe(exc)} while {doing}") from exc


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out: ``MemoryError``, torch's ``OutOfMemoryError`` (CUDA
    and other accelerators) or the CPU allocator's ``RuntimeError`` ("DefaultCPUAllocator: can't
    allocate memory"). Such an error is the request's size, not the plugin's fault."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def records_of_kind(model: Any, kinds: tuple[str, ...]) -> list["ComponentRecord"]:
    """The records of ``model``'s components of ``kinds``."""
    return [r for r in getattr(model, "component_records", {}).values() if r.kind in kinds]


def describe(exc: BaseException) -> str:
    """``"raised RuntimeError: message"``, the first line of the message only."""
    text = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {text[0]}" if text else "")


def check_tensor_like(value: Any, like: Any, what: str) -> str | None:
    """What is wrong with ``value`` as a stand-in for ``like`` (same type of tensor, shape and
    device), or None. Used on step outputs and velocities; dtype is checked by the caller."""
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "dtype"):
        return f"returned {type(value).__name__} as {what}; expected a tensor"
    if tuple(shape) != tuple(like.shape):
        return f"returned {what} of shape {tuple(shape)} for latents of shape {tuple(like.shape)}"
    if getattr(value, "device", None) != getattr(like, "device", None):
        return f"returned {what} on device {value.device}; the latents are on {like.device}"
    return None


def check_step(model: Any, index: int | str, kernel: Any, latents: Any, velocity: Any, out: Any,
               sigma: float, sigma_next: float, log_prob: Any = None, sde: bool = False) -> None:
    """After denoising step ``index``: the kernel's output must have the latents' shape, dtype
    and device, be finite, and (SDE) come with a finite ``(B,)`` log-prob.

    On the success path this is attribute comparisons and one sum (``torch.isfinite(out.sum())``;
    the element-wise test runs only when that sum is not finite, so an overflowing sum of
    finite values is no false alarm); only when the output is non-finite is the velocity
    examined, to name the culprit: a non-finite
    velocity is the DiT's fault (:class:`ComponentFaultError`), finite inputs turned into
    non-finite latents the kernel's (:class:`KernelFaultError`). ``velocity=None``: the kernel
    had no velocity input (a re-noise step), its inputs were finite.

    :raises KernelFaultError: naming the step, op and the kernel's ``impl_id``.
    :raises ComponentFaultError: naming the DiT's plugin, for a non-finite velocity.
    """
    import torch

    where = f"at step {index} (sigma {sigma:.6g} -> {sigma_next:.6g})"
    prov = kernel.provenance
    problem = check_tensor_like(out, latents, "latents")
    if problem is None and out.dtype != latents.dtype:
        problem = f"returned latents of dtype {out.dtype} for latents of dtype {latents.dtype}"
    if problem is None and sde:
        shape = tuple(getattr(log_prob, "shape", ()) or ())
        if shape != (latents.shape[0],):
            problem = f"returned a log-prob of shape {shape}; expected ({latents.shape[0]},)"
        elif not bool(torch.isfinite(log_prob).all()):
            problem = "returned a non-finite log-prob"
    if problem is not None:
        raise kernel_fault(prov, f"{problem} {where}")
    # one reduction and no temporary: the sum of finite values is finite unless it overflows
    # (then the exact test decides); a NaN or an infinity anywhere makes it non-finite
    if bool(torch.isfinite(out.sum())) or bool(torch.isfinite(out).all()):
        return
    if velocity is not None and not bool(torch.isfinite(velocity).all()):
        raise component_fault(records_of_kind(model, ("dit",)) or _unknown("dit"),
                              f"predicted a non-finite velocity {where}")
    raise kernel_fault(prov, f"returned non-finite latents from finite inputs {where}")


def check_velocity(model: Any, index: int | str, velocity: Any, latents: Any) -> None:
    """The DiT's velocity must be a tensor of the latents' shape on their device.

    :raises ComponentFaultError: naming the DiT's plugin.
    """
    problem = check_tensor_like(velocity, latents, "a velocity")
    if problem is not None:
        raise component_fault(records_of_kind(model, ("dit",)) or _unknown("dit"),
                              f"{problem} at step {index}")


def check_finite(model: Any, kinds: tuple[str, ...], values: Any, problem: str) -> None:
    """``values`` (a tensor or numpy array) must be finite, else the components of ``kinds`` that
    produced them are named. One reduction, once per request (not per step).

    :raises ComponentFaultError: naming the plugin(s) that built those components.
    """
    import numpy as np
    import torch

    finite = bool(torch.isfinite(values).all()) if torch.is_tensor(values) \
        else bool(np.isfinite(values).all())
    if not finite:
        kind = kinds[0]
        raise component_fault(records_of_kind(model, kinds) or _unknown(kind), problem)


def _unknown(kind: str) -> "ComponentRecord":
    from .components import ComponentRecord

    return ComponentRecord(kind=kind, name=kind, device="?", plugin="?", fallback=False)
