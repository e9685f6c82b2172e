"""Platform: the resolved choice of backend for this process.

A Platform is built once from the discovered plugins: a device chain ending in ``"cpu"``
(``accel → cpu``), an arch chain per device, a frozen :class:`~flowseam.seam.kernels.KernelTable`,
and a component builder that walks the device chain. Everything device-specific that loops and
training methods need is reached through it::

    platform = flowseam.Platform.detect()          # or flowseam.Platform("cpu")
    step = platform.kernels.get(flowseam.ops.FLOW_MATCH_STEP)
    dit = platform.build_component("dit", spec)
    print(platform.explain())

It serializes (``to_dict`` / ``from_dict``, and pickling) so that a worker process gets the same
implementation ids without scanning entry points again.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from .components import MODULE_KINDS, ComponentRecord, ComponentSpec, module_dtype
from .declarations import Provenance
from ..errors import (
    BackendUnavailableError, ComponentBuildError, FlowseamError, InvalidInputError, PluginLoadError,
)
from .faults import component_fault, describe, is_out_of_memory
from .isolation import patch_watch
from .kernels import BoundKernel, KernelTable
from .discovery import PluginRecord, PluginRegistry, discover, load_without_discovery
from .tables import format_table

TERMINAL_DEVICE = "cpu"


def _describe_backends(reg: PluginRegistry) -> str:
    lines = []
    for r in sorted(reg.records.values(), key=lambda r: r.name):
        if r.backend is None and r.status in ("available", "unavailable"):
            continue  # method/reward-only plugins are not backends
        why = f": {r.reason}" if r.reason else ""
        dev = f" device={r.device}" if r.device else ""
        lines.append(f"  {r.name} ({r.distribution} {r.version}){dev} — {r.status}{why}")
    return "\n".join(lines) if lines else "  (no backend plugin is installed: pip install flowseam-cpu)"


def _not_a_component(kind: str, obj: Any) -> str | None:
    """What is wrong with a builder's result for ``kind`` (None if nothing)."""
    if isinstance(obj, (str, bytes)) or not callable(obj):
        return f"a {type(obj).__name__} ({obj!r:.60}) instead of a component"
    if kind in MODULE_KINDS:
        import torch

        if not isinstance(obj, torch.nn.Module):
            return f"a {type(obj).__name__} instead of a torch.nn.Module (kind {kind!r})"
    return None


class Platform:
    """The backend choice of this process. See the module docstring.

    :param name: a backend's plugin name (``"cpu"``, ``"accel"``, ``"cuda"``) or its device name.
    :param registry: the plugin registry to use (default: :func:`flowseam.seam.discovery.discover`).
    :raises BackendUnavailableError: if ``name`` is unknown, blocked or unavailable here; the
        message lists every backend and why each unusable one is unusable.
    :raises PluginLoadError: if ``name`` is a broken plugin (its fault: it names the plugin).
    """

    def __init__(self, name: str, *, registry: PluginRegistry | None = None,
                 _arch_chains: dict[str, tuple[str, ...]] | None = None) -> None:
        reg = registry if registry is not None else discover()
        record = self._find(reg, name)
        self._registry = reg
        self.backend: PluginRecord = record
        self.name: str = record.name
        self.device: str = record.device  # type: ignore[assignment]
        chain = [record.device]
        if record.device != TERMINAL_DEVICE:
            chain.append(TERMINAL_DEVICE)
        self.device_chain: tuple[str, ...] = tuple(chain)
        self._serving = {d: ([record] + [r for r in reg.serving(d) if r is not record]
                             if d == record.device else reg.serving(d))
                         for d in self.device_chain}
        self.arch_chains: dict[str, tuple[str, ...]] = (
            {d: tuple(_arch_chains[d]) for d in self.device_chain} if _arch_chains is not None
            else {d: self._detect_arch_chain(d) for d in self.device_chain})
        self.kernels = KernelTable(self._kernel_candidates(), self.device_chain, self.arch_chains)
        self.conflicts = self.kernels.conflicts
        self.components: list[ComponentRecord] = []

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def detect(cls, *, registry: PluginRegistry | None = None) -> "Platform":
        """The highest-priority available backend (ties broken by name).

        :raises BackendUnavailableError: if no backend is available.
        """
        reg = registry if registry is not None else discover()
        for r in reg.backends():
            if r.usable:
                return cls(r.name, registry=reg)
        raise BackendUnavailableError("no flowseam backend is available:\n" + _describe_backends(reg))

    @staticmethod
    def _find(reg: PluginRegistry, name: str) -> PluginRecord:
        rec = reg.records.get(name)
        if rec is not None and rec.status == "broken":  # its own fault, named (exit 3)
            raise PluginLoadError(
                f"flowseam backend {name!r} is broken ({rec.distribution} {rec.version}): "
                f"{rec.reason}", plugin=rec.name, distribution=rec.distribution,
                version=str(rec.version), what="backend")
        if rec is not None and not rec.usable:  # unavailable here, or blocked: the user's
            raise BackendUnavailableError(
                f"flowseam backend {name!r} is {rec.status}: {rec.reason}\nbackends:\n"
                f"{_describe_backends(reg)}")
        if rec is None or rec.backend is None:
            by_device = [r for r in reg.backends() if r.device == name and r.usable]
            if by_device:
                return by_device[0]
            raise BackendUnavailableError(
                f"unknown flowseam backend {name!r}; backends:\n{_describe_backends(reg)}")
        return rec

    def _detect_arch_chain(self, device: str) -> tuple[str, ...]:
        """The arch chain the highest-priority plugin serving ``device`` detected at discovery."""
        serving = self._serving[device]
        return serving[0].arch_chain if serving else ("generic",)

    def _kernel_candidates(self):
        for device in self.device_chain:
            archs = set(self.arch_chains[device])
            for rec in self._serving[device]:
                for k in rec.kernels:
                    if k.arch in archs:
                        prov = Provenance(k.op, rec.name, rec.distribution, rec.version, device, k.arch)
                        yield BoundKernel(k.fn, prov), rec.priority

    # -- components ------------------------------------------------------------------------
    def build_component(self, kind: str, spec: ComponentSpec) -> Any:
        """Build a component of ``kind`` along the device chain and record where it landed.

        The first plugin (priority order) serving a device that declares ``kind`` and does not
        decline builds it; a kind no plugin of the first device serves falls back to the next
        device (ultimately cpu), and :attr:`components` records that fallback and why.

        :raises ComponentBuildError: if no plugin on the chain builds ``kind``; the message says
            what each device answered.
        :raises ComponentFaultError: if a plugin's builder raises (other than a
            :class:`FlowseamError`, such as a checkpoint error, which passes unchanged) or returns
            something that is not a component (a string; anything but a ``torch.nn.Module`` for
            the kinds in :data:`flowseam.seam.components.MODULE_KINDS`), naming the plugin.
        """
        reasons: list[str] = []
        for i, device in enumerate(self.device_chain):
            plugins = [r for r in self._serving[device] if r.builds(kind)]
            if not plugins:
                reasons.append(f"no plugin serving {device!r} builds {kind!r}")
                continue
            for rec in plugins:
                record = ComponentRecord(kind=kind, name=spec.name, device=device, plugin=rec.name,
                                         fallback=i > 0, reason="; ".join(reasons),
                                         distribution=rec.distribution, version=rec.version)
                with patch_watch(rec, f"flowseam_build_component({kind!r})"):
                    try:
                        obj = self._registry.call(rec, "flowseam_build_component",
                                                  kind=kind, spec=spec, device=device)
                    except FlowseamError:
                        raise
                    except Exception as exc:
                        if is_out_of_memory(exc):
                            raise
                        raise component_fault(record, f"failed to build {spec.describe()}: "
                                              f"{describe(exc)}") from exc
                if obj is not None:
                    problem = _not_a_component(kind, obj)
                    if problem:
                        raise component_fault(record, f"returned {problem} for {spec.describe()}")
                    self.components.append(dataclasses.replace(record, dtype=module_dtype(obj)))
                    return obj
                reasons.append(f"plugin {rec.name!r} declined {kind!r} on {device!r}")
        raise ComponentBuildError(
            f"cannot build component {spec.describe()} of kind {kind!r} on device chain "
            f"{' → '.join(self.device_chain)}: " + "; ".join(reasons))

    def declared_component_classes(self) -> set[str]:
        """The dotted component classes the usable plugins of this platform's registry declare
        (``flowseam_component_classes``): what a checkpoint may name besides diffusers and
        transformers classes."""
        return {c for r in self._registry.usable() for c in r.component_classes}

    def check_dtype(self, kind: str, component: str, dtype: str) -> None:
        """Refuse asking for ``component`` (of ``kind``) in ``dtype`` when the plugin that would
        build it (:meth:`component_plan`) does not declare that dtype for the kind
        (``flowseam_component_dtypes``): before any weights load.

        :raises InvalidInputError: naming the component, the plugin and what it builds.
        """
        for i, device in enumerate(self.device_chain):
            for rec in self._serving[device]:
                if not rec.builds(kind):
                    continue
                declared = rec.dtypes(kind)
                if dtype in declared:
                    return
                where = f"plugin {rec.name!r} (device {device}" + \
                    (", the fallback)" if i else ")")
                offers = (f"builds {kind} in {', '.join(declared)} only" if declared else
                          f"does not say which dtypes it builds {kind} in (no "
                          "flowseam_component_dtypes), so it builds it in its own")
                raise InvalidInputError(
                    f"dtype {dtype} for {component} ({kind}): {where} {offers}; ask for "
                    f"another dtype, or another --backend")

    def component_plan(self, kind: str) -> tuple[str, str, bool]:
        """(device, plugin, fallback) that would first be asked to build ``kind``."""
        for i, device in enumerate(self.device_chain):
            for rec in self._serving[device]:
                if rec.builds(kind):
                    return device, rec.name, i > 0
        return "-", "-", True

    # -- reporting -------------------------------------------------------------------------
    @property
    def arch_chain(self) -> tuple[str, ...]:
        """The arch chain of the first device, most specific first, ending in ``"generic"``."""
        return self.arch_chains[self.device_chain[0]]

    def explain(self, verbose: bool = False, width: int = 100) -> str:
        """A readable report of every op and component resolution, conflicts and fallbacks:
        two tables (ops: device/arch, plugin, fallback; components: kind, device, plugin, dtype,
        fallback) with each fallback's reason whole on the line below its component.

        :param verbose: add each kernel's implementation id (what ``kernels.pin`` takes).
        """
        b = self.backend
        lines = [
            f"Platform: backend {self.name!r} ({b.distribution} {b.version}), "
            f"device chain {' → '.join(self.device_chain)}",
            "arch chains: " + "; ".join(f"{d}: {' → '.join(a)}" for d, a in self.arch_chains.items()),
            *textwrap.wrap("plugins per device: " + "; ".join(
                f"{d}: " + ", ".join(f"{r.name} ({r.distribution} {r.version})" for r in self._serving[d])
                for d in self.device_chain), width if not verbose else 10 ** 6, subsequent_indent="  ",
                break_long_words=False, break_on_hyphens=False),
            "",
        ]
        first = self.device_chain[0]
        header = ["op", "device/arch", "plugin", "fallback"] + (["impl_id"] if verbose else [])
        rows = []
        for op, k in self.kernels.resolved().items():
            p = k.provenance
            rows.append([op, f"{p.device}/{p.arch}", p.plugin, "yes" if p.device != first else "no"]
                        + ([p.impl_id] if verbose else []))
            # implementations that lost a conflict on this op stay visible here, not only below
            for c in self.kernels.conflicts:
                if c.op == op:
                    for loser in c.losers:
                        lp = self.kernels.pin(loser).provenance
                        rows.append(["  not chosen", f"{lp.device}/{lp.arch}", lp.plugin, "-"]
                                    + ([loser] if verbose else []))
        lines += format_table(header, rows, width if not verbose else 10 ** 6)
        rows = [[c.name, c.kind, c.device, c.plugin, c.dtype or "-", "yes" if c.fallback else "no"]
                for c in self.components]
        whys = [c.reason for c in self.components]
        if not self.components:
            kinds = sorted({k for d in self.device_chain for r in self._serving[d]
                            for k in r.component_kinds if k != "*"} | {"dit", "vae", "text_encoder"})
            for kind in kinds:
                device, plugin, fb = self.component_plan(kind)
                rows.append(["(planned)", kind, device, plugin, "-", "yes" if fb else "no"])
                whys.append(f"no plugin serving {first!r} builds {kind!r}" if fb else "")
        table = format_table(["component", "kind", "device", "plugin", "dtype", "fallback"], rows,
                             width)
        lines += [""] + table[:2]
        for line, why in zip(table[2:], whys):  # the reason whole, on a line of its own
            lines += [line] + ([f"  why: {why}"] if why else [])
        if self.conflicts:
            lines += ["", "conflicts:"] + [f"  {c}" for c in self.conflicts]
        names = self._registry.name_conflicts()
        if names:
            lines += ["", "name conflicts (unusable until one is chosen as '<plugin>:<name>'):"]
            lines += [f"  {c}" for c in names]
        patches = [f"  {r.name} ({r.distribution} {r.version}): {p}"
                   for r in sorted(self._registry.records.values(), key=lambda r: r.name)
                   for p in r.patches]
        if patches:
            lines += ["", "torch globals replaced by plugins:"] + patches
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Platform {self.name!r} chain={'→'.join(self.device_chain)} arch={'→'.join(self.arch_chain)}>"

    # -- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable description from which :meth:`from_dict` rebuilds this platform
        in another process, with the same implementation ids and no entry-point scan."""
        plugins = {r.name: r for d in self.device_chain for r in self._serving[d]}
        return {
            "backend": self.name,
            "device_chain": list(self.device_chain),
            "arch_chains": {d: list(a) for d, a in self.arch_chains.items()},
            "plugins": [{"name": r.name, "value": r.value, "distribution": r.distribution,
                         "version": r.version, "arch_chain": list(r.arch_chain)}
                        for r in plugins.values()],
            "kernels": {op: k.impl_id for op, k in self.kernels.resolved().items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Platform":
        """Rebuild a platform from :meth:`to_dict` output without discovering plugins.

        :raises PluginLoadError: if a plugin of the platform cannot be imported here, or is
            installed here in another version.
        :raises PluginLoadError: if the same plugins resolve other kernels here (a plugin that
            registers a kernel at this host's own arch rung, on another kind of host), naming
            the plugins and the kernels.
        """
        reg = load_without_discovery(data["plugins"])
        arch = {d: tuple(a) for d, a in data["arch_chains"].items()}
        platform = cls(data["backend"], registry=reg, _arch_chains=arch)
        got = {op: k.impl_id for op, k in platform.kernels.resolved().items()}
        if got != data["kernels"]:  # a plugin registered other kernels here (another host)
            differ = {op for op in set(got) | set(data["kernels"])
                      if got.get(op) != data["kernels"].get(op)}
            owners = sorted({i.split(":")[0] for op in differ
                             for i in (got.get(op), data["kernels"].get(op)) if i})
            raise PluginLoadError(
                f"plugin(s) {', '.join(owners)} resolve other kernels in this process than where "
                f"the platform was built: " + "; ".join(
                    f"{op}: {got.get(op) or 'none'} here, {data['kernels'].get(op) or 'none'} "
                    "there" for op in sorted(differ))
                + " (a kernel registered at another host's arch rung, say); run the workers on "
                "hosts like the driver's, or build the platform on one of them",
                plugin=", ".join(owners), what="kernels")
        return platform

    def __reduce__(self):
        return (Platform.from_dict, (self.to_dict(),))
