"""Plain records that plugins return from their hooks, and the provenance of a kernel. A record
that breaks its contract raises ``ValueError``; discovery names the plugin that returned it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NamedTuple



@dataclass(frozen=True)
class BackendInfo:
    """What :func:`~flowseam.seam.hookspecs.flowseam_backend` returns.

    :param device: the flowseam device this backend serves (``"cpu"``, ``"cuda"``, ``"accel"``,
        ...). Several plugins may serve one device; their kernels and components pool.
    :param priority: ``Platform.detect()`` picks the available backend with the highest
        priority; it also breaks kernel conflicts within a device. cpu is 0.
    :param description: one line shown by ``flowseam backends``.
    """

    device: str
    priority: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device.isidentifier():
            raise ValueError(
                f"BackendInfo.device={self.device!r} must be an identifier like 'cuda'")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"BackendInfo.priority={self.priority!r} must be an int")


class Availability(NamedTuple):
    """What :func:`~flowseam.seam.hookspecs.flowseam_backend_available` returns."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class KernelRegistration:
    """One kernel implementation a plugin offers.

    :param op: an op name from :mod:`flowseam.ops` (e.g. ``ops.FLOW_SDE_STEP``).
    :param fn: the callable, following the op's contract.
    :param arch: the arch rung it is written for; ``"generic"`` runs on every arch of the device.
    """

    op: str
    fn: Callable
    arch: str = "generic"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(
                f"KernelRegistration(op={self.op!r}).fn={self.fn!r} is not callable")
        if not isinstance(self.arch, str) or not self.arch:
            raise ValueError(
                f"KernelRegistration(op={self.op!r}).arch={self.arch!r} must be a non-empty str")


@dataclass(frozen=True)
class ConformanceExpectations:
    """What :func:`~flowseam.seam.hookspecs.flowseam_conformance_expectations` returns: what a
    backend promises flowseam's conformance suite beyond its declarations.

    Every field is optional; ``None`` means "derive it from the declarations" (see each field).

    :param overrides: component kinds this backend must build itself, on its own device (not as a
        fallback), for every tiny checkpoint that has a component of that kind. Default: every
        kind it declares in ``flowseam_component_kinds`` (``"*"``: every kind). List fewer to
        allow the builder to decline some components (declared kinds left out are then checked
        only for a consistent record).
    :param falls_back: component kinds this backend must leave to the next device of the chain
        (cpu), with the fallback recorded. Default: every kind it does not declare.
    :param xfail_file: a text file of expected failures, one ``<test id> <reason>`` per line
        (format: :mod:`flowseam.testing.conformance.expectations`), usually package data:
        ``importlib.resources.files(__package__) / "conformance-xfail.txt"``. Each listed test
        is marked strict ``xfail``: it must fail, and an unexpected pass fails the run.
    :param torch_device: the torch device this backend's kernels take tensors on (``"cuda:0"``);
        the kernel checks put their inputs there. Default ``"cpu"``.
    """

    overrides: tuple[str, ...] | None = None
    falls_back: tuple[str, ...] | None = None
    xfail_file: str | os.PathLike | None = None  # or any importlib.resources Traversable
    torch_device: str | None = None

    def __post_init__(self) -> None:
        for name in ("overrides", "falls_back"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (str, bytes)) or any(not isinstance(k, str) or not k
                                                      for k in value):
                raise ValueError(
                    f"ConformanceExpectations.{name}={value!r} must be a list of kind "
                    "names, e.g. ['dit', 'vae']")
            object.__setattr__(self, name, tuple(value))
        both = set(self.overrides or ()) & set(self.falls_back or ())
        if both:
            raise ValueError(
                f"ConformanceExpectations: kinds {sorted(both)} are listed both in "
                "overrides and in falls_back; a kind is one or the other")
        if self.torch_device is not None and not isinstance(self.torch_device, str):
            raise ValueError(
                f"ConformanceExpectations.torch_device={self.torch_device!r} must be "
                "a torch device string such as 'cuda:0'")


@dataclass(frozen=True)
class Provenance:
    """Where a bound kernel came from. ``impl_id`` is stable across processes and runs:
    ``"<plugin>:<op>:<device>:<arch>:<distribution>==<version>"``."""

    op: str
    plugin: str
    distribution: str
    version: str
    device: str
    arch: str

    @property
    def impl_id(self) -> str:
        return f"{self.plugin}:{self.op}:{self.device}:{self.arch}:{self.distribution}=={self.version}"
