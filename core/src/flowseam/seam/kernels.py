"""KernelTable: the op → implementation choices of one Platform, resolved once.

Resolution walks the platform's device chain (e.g. ``accel → cpu``) and, within each device, its
arch chain (e.g. ``sm90 → sm80 → generic``); the first registered implementation wins. Within
one (op, device, arch) slot, several plugins are a *conflict*: the higher backend priority wins,
then the smaller plugin name; the losers stay pinnable and the conflict is reported.

``get`` and ``pin`` are dictionary lookups; they never call pluggy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .declarations import Provenance
from ..errors import KernelPinError, PluginFaultError, UnknownOpError
from .faults import describe, is_out_of_memory, kernel_fault


class BoundKernel:
    """A kernel implementation with its :class:`~flowseam.seam.declarations.Provenance`.

    Calling it calls the implementation directly (one Python call of overhead, and a ``try``
    that costs nothing unless the kernel raises).

    :raises KernelFaultError: when the implementation raises anything (a wrong signature gives a
        ``TypeError``, a crash any exception): the error names the plugin, distribution, op and
        ``impl_id``, with the original as ``__cause__`` (out-of-memory errors pass unchanged:
        :func:`flowseam.seam.faults.is_out_of_memory`). A ``ValueError`` (the op contract's
        rejection of bad arguments) becomes a :class:`~flowseam.errors.KernelArgumentError`,
        which is still a ``ValueError``.
    """

    __slots__ = ("fn", "provenance")

    def __init__(self, fn: Callable, provenance: Provenance) -> None:
        self.fn = fn
        self.provenance = provenance

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except PluginFaultError:  # a kernel that calls another: already named
            raise
        except Exception as exc:  # the op's argument checks (InvalidInputError) included
            if is_out_of_memory(exc):
                raise
            raise kernel_fault(self.provenance, describe(exc), exc) from exc

    @property
    def impl_id(self) -> str:
        return self.provenance.impl_id

    def __repr__(self) -> str:
        return f"<BoundKernel {self.provenance.impl_id}>"


@dataclass(frozen=True)
class KernelConflict:
    """Two or more plugins registered the same (op, device, arch)."""

    op: str
    device: str
    arch: str
    winner: str  # impl_id
    losers: tuple[str, ...]

    def __str__(self) -> str:
        return (f"{self.op} on {self.device}/{self.arch}: {self.winner} wins over "
                f"{', '.join(self.losers)} (higher priority, then plugin name)")


class KernelTable:
    """The frozen kernel choices of a Platform.

    :param candidates: every implementation this platform can run, each with the plugin's
        priority, in any order.
    :param device_chain: e.g. ``("accel", "cpu")``.
    :param arch_chains: device → its arch chain, e.g. ``{"accel": ("avx2", "generic"), ...}``.
    """

    def __init__(self, candidates: Iterable[tuple[BoundKernel, int]],
                 device_chain: tuple[str, ...], arch_chains: dict[str, tuple[str, ...]]) -> None:
        slots: dict[tuple[str, str, str], list[tuple[int, str, BoundKernel]]] = {}
        for bound, priority in candidates:
            p = bound.provenance
            slots.setdefault((p.op, p.device, p.arch), []).append((-priority, p.plugin, bound))
        self._all: dict[str, BoundKernel] = {}
        winners: dict[tuple[str, str, str], BoundKernel] = {}
        conflicts = []
        for key in sorted(slots):
            ranked = sorted(slots[key], key=lambda t: (t[0], t[1]))
            winners[key] = ranked[0][2]
            for _, _, b in ranked:
                self._all[b.impl_id] = b
            if len(ranked) > 1:
                conflicts.append(KernelConflict(*key, winner=ranked[0][2].impl_id,
                                          losers=tuple(b.impl_id for _, _, b in ranked[1:])))
        self.conflicts: tuple[KernelConflict, ...] = tuple(conflicts)
        self._resolved: dict[str, BoundKernel] = {}
        self.walks: dict[str, tuple[str, ...]] = {}
        for op in sorted({k[0] for k in slots}):
            tried = []
            for device in device_chain:
                for arch in arch_chains[device]:
                    tried.append(f"{device}/{arch}")
                    hit = winners.get((op, device, arch))
                    if hit is not None:
                        self._resolved[op] = hit
                        break
                if op in self._resolved:
                    break
            self.walks[op] = tuple(tried)

    def get(self, op: str) -> BoundKernel:
        """The resolved implementation of ``op``; its ``.provenance`` says where it came from.

        :raises UnknownOpError: if no plugin on the device chain registers ``op``; the message
            lists the registered ops.
        """
        try:
            return self._resolved[op]
        except KeyError:
            raise UnknownOpError(
                f"no kernel registered for op {op!r} on this platform; registered ops: "
                f"{sorted(self._resolved)}") from None

    def pin(self, impl_id: str) -> BoundKernel:
        """Exactly the implementation ``impl_id`` (as recorded in a BehaviorRecord), never a
        substitute.

        :raises KernelPinError: if this platform cannot run ``impl_id``; lists the ids it can.
        """
        try:
            return self._all[impl_id]
        except KeyError:
            raise KernelPinError(
                f"kernel {impl_id!r} is not available on this platform, and a pinned kernel is "
                f"never substituted; available implementation ids: {sorted(self._all)}") from None

    def ops(self) -> list[str]:
        return sorted(self._resolved)

    def resolved(self) -> dict[str, BoundKernel]:
        """op → the implementation ``get`` returns."""
        return dict(self._resolved)

    def available_ids(self) -> list[str]:
        return sorted(self._all)

    def __contains__(self, op: str) -> bool:
        return op in self._resolved
