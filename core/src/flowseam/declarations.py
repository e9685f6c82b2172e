"""Plain records that plugins return from their hooks, and the provenance of a kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple


@dataclass(frozen=True)
class BackendInfo:
    """What :func:`~flowseam.hookspecs.flowseam_backend` returns.

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
            raise ValueError(f"BackendInfo.device={self.device!r} must be an identifier like 'cuda'")
        if not isinstance(self.priority, int):
            raise ValueError(f"BackendInfo.priority={self.priority!r} must be an int")


class Availability(NamedTuple):
    """What :func:`~flowseam.hookspecs.flowseam_backend_available` returns."""

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
            raise ValueError(f"KernelRegistration(op={self.op!r}).fn={self.fn!r} is not callable")
        if not isinstance(self.arch, str) or not self.arch:
            raise ValueError(f"KernelRegistration(op={self.op!r}).arch={self.arch!r} must be a non-empty str")


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
