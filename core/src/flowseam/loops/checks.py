"""The checks every loop runs on what a plugin's component or kernel returned, naming the plugin
at fault (:mod:`flowseam.seam.faults`): a component that raises, a velocity or a step's latents
of the wrong shape, dtype or device, non-finite values. On the success path a step costs
attribute comparisons and one sum; the culprit (velocity or kernel) is looked for only once a
check has failed. Running out of memory is the request's size, named with what lowers it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..errors import FlowseamError, NotEnoughMemoryError
from ..seam.components import ComponentRecord
from ..seam.faults import component_fault, describe, is_out_of_memory, kernel_fault


@contextlib.contextmanager
def component_faults(model: Any, kinds: tuple[str, ...], doing: str) -> Iterator[None]:
    """Name the plugin when a component of ``kinds`` raises inside the block: any exception but
    a :class:`FlowseamError` becomes a :class:`ComponentFaultError` naming the components of those
    kinds in ``model.component_records`` (where the platform built each), with the original as
    ``__cause__``; running out of memory becomes a :class:`NotEnoughMemoryError` saying what
    lowers it (``model.placement.advice``). With no record of those kinds it re-raises
    unchanged."""
    try:
        yield
    except FlowseamError:
        raise
    except Exception as exc:
        if is_out_of_memory(exc):
            if isinstance(exc, NotEnoughMemoryError):
                raise
            raise NotEnoughMemoryError(f"{describe(exc).removeprefix('raised ')} while {doing}; "
                                       f"{model.placement.advice(kinds)}") from exc
        records = records_of_kind(model, kinds)
        if not records:
            raise
        raise component_fault(records, f"{describe(exc)} while {doing}") from exc


def records_of_kind(model: Any, kinds: tuple[str, ...]) -> list["ComponentRecord"]:
    """The records of ``model``'s components of ``kinds``."""
    return [r for r in getattr(model, "component_records", {}).values() if r.kind in kinds]


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


def _unknown(kind: str) -> ComponentRecord:
    return ComponentRecord(kind=kind, name=kind, device="?", plugin="?", fallback=False)
