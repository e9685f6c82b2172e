"""Discovery: load every plugin of the ``flowseam.plugins`` entry-point group, one at a time.

Each plugin is imported, registered with a pluggy ``PluginManager`` (which validates its hook
signatures), checked for unknown hook names, asked for its declarations (backend, kernels,
component kinds, methods, rewards) and, if it is a backend, for its availability, each step
guarded by :mod:`.isolation`. Anything that raises marks *that* plugin ``broken`` with its
traceback; the others keep working. :func:`scan` honours ``FLOWSEAM_PLUGINS``,
``FLOWSEAM_DISABLE_PLUGINS`` and ``FLOWSEAM_STRICT``; :func:`discover` keeps one scan per process.
"""

from __future__ import annotations

import dataclasses
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterable, Mapping

import pluggy

from . import hookspecs
from .. import ops
from .declarations import Availability, BackendInfo, KernelRegistration
from ..errors import InvalidInputError, PluginFaultError, PluginLoadError
from .components import KINDS
from .isolation import patch_watch, plugin_timeout, run_plugin_code

ENTRY_POINT_GROUP = "flowseam.plugins"
#: what a training method's or a reward's name may be
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

#: How many times entry points were scanned in this process (a rebuilt Platform must not scan).
DISCOVERY_SCANS = 0


@dataclass
class PluginRecord:
    """Everything discovery learnt about one plugin.

    ``status`` is one of ``available``, ``unavailable``, ``broken``, ``blocked`` (``active`` is
    added by ``flowseam backends`` for the plugins the detected platform uses).
    """

    name: str
    value: str  # "module:attr" of the entry point
    distribution: str
    version: str
    status: str = "available"
    reason: str = ""
    traceback: str = ""
    backend: BackendInfo | None = None
    kernels: list[KernelRegistration] = field(default_factory=list)
    component_kinds: tuple[str, ...] = ()
    component_classes: tuple[str, ...] = ()
    #: kind (or ``"*"``) → the dtypes it builds that kind in on request (flowseam_component_dtypes)
    component_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    arch_chain: tuple[str, ...] = ("generic",)
    methods: dict[str, Any] = field(default_factory=dict)
    rewards: dict[str, Any] = field(default_factory=dict)
    plugin: Any = None  # the registered module/object
    #: torch globals its code replaced (flowseam.seam.isolation.patch_watch), e.g.
    #: ``"torch.nn.functional.scaled_dot_product_attention (import)"``
    patches: list[str] = field(default_factory=list)

    @property
    def device(self) -> str | None:
        return self.backend.device if self.backend else None

    @property
    def priority(self) -> int:
        return self.backend.priority if self.backend else 0

    def builds(self, kind: str) -> bool:
        """Whether this plugin declared ``kind`` (or ``"*"``, every kind)."""
        return kind in self.component_kinds or "*" in self.component_kinds

    def dtypes(self, kind: str) -> tuple[str, ...]:
        """The dtypes this plugin builds ``kind`` in on request (none declared: ``()``)."""
        return self.component_dtypes.get(kind, self.component_dtypes.get("*", ()))

    @property
    def usable(self) -> bool:
        return self.status == "available"

    def summary(self) -> dict[str, Any]:
        """The JSON shape printed by ``flowseam backends --json``."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "reason": self.reason,
            "device": self.device,
            "priority": self.priority if self.backend else None,
            "ops": sorted({f"{k.op}@{k.arch}" for k in self.kernels}),
            "arch_chain": list(self.arch_chain) if self.backend else None,
            "components": list(self.component_kinds),
            "component_classes": list(self.component_classes),
            "component_dtypes": {k: list(v) for k, v in self.component_dtypes.items()},
            "methods": sorted(self.methods),
            "rewards": sorted(self.rewards),
            "entry_point": self.value,
            "patches": list(self.patches),
            "traceback": self.traceback or None,
        }


@dataclass(frozen=True)
class NameConflict:
    """Two or more plugins register one training-method or reward name."""

    what: str  # "method" or "reward"
    name: str
    plugins: tuple[str, ...]
    claimants: tuple[str, ...]  # "plugin (distribution version)"

    def __str__(self) -> str:
        return f"{self.what} {self.name!r}: {', '.join(self.claimants)}"


class PluginRegistry:
    """The plugins of this process: one pluggy ``PluginManager`` plus a :class:`PluginRecord`
    per entry point (including blocked and broken ones)."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}

    # -- queries ---------------------------------------------------------------------------
    def usable(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.usable]

    def backends(self) -> list[PluginRecord]:
        """Every plugin that declared a backend, in detection order (priority desc, name)."""
        recs = [r for r in self.records.values() if r.backend is not None]
        return sorted(recs, key=lambda r: (-r.priority, r.name))

    def serving(self, device: str) -> list[PluginRecord]:
        """Usable plugins whose backend serves ``device``, priority desc then name."""
        return [r for r in self.backends() if r.usable and r.device == device]

    def broken(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.status == "broken"]

    def name_conflicts(self) -> list["NameConflict"]:
        """Training-method and reward names that two or more usable plugins register. Such a
        name resolves to nothing until one is chosen (``"<plugin>:<name>"``) or the others are
        blocked; see :func:`flowseam.training.get_method`."""
        out = []
        for what, attr in (("method", "methods"), ("reward", "rewards")):
            claims: dict[str, list[PluginRecord]] = {}
            for rec in sorted(self.usable(), key=lambda r: r.name):
                for name in getattr(rec, attr):
                    claims.setdefault(name, []).append(rec)
            out += [NameConflict(what, name, tuple(r.name for r in recs),
                                 tuple(f"{r.name} ({r.distribution} {r.version})" for r in recs))
                    for name, recs in sorted(claims.items()) if len(recs) > 1]
        return out

    def call(self, record: PluginRecord, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of ``hook`` (None if it has none)."""
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            if impl.plugin_name == record.name:
                return impl.function(*[kwargs[a] for a in impl.argnames])
        return None

    # -- loading ---------------------------------------------------------------------------
    def load(self, name: str, value: str, distribution: str, version: str,
             loader: Callable[[], Any], *, check_availability: bool = True) -> PluginRecord:
        """Import, register, validate and interrogate one plugin; never raises for a bad plugin.

        The plugin's import and its hook calls run through
        :func:`flowseam.seam.isolation.run_plugin_code` (timeout, ``os._exit`` and stdout guarded)
        and :func:`flowseam.seam.isolation.patch_watch` (torch globals it replaces are recorded).
        """
        rec = PluginRecord(name=name, value=value, distribution=distribution, version=version)
        self.records[name] = rec
        who = f"plugin {name!r} ({distribution} {version})"
        try:
            timeout = plugin_timeout()
            with patch_watch(rec, "import"):
                plugin = run_plugin_code(loader, f"importing {who}", timeout)
            self.pm.register(plugin, name=name)
            rec.plugin = plugin
            _reject_unknown_hooks(self.pm, plugin, name)
            # the hooks fill a scratch copy; a plugin that times out cannot change the record later
            scratch = dataclasses.replace(rec, patches=[])
            with patch_watch(rec, "hooks"):
                run_plugin_code(lambda: self._interrogate(scratch, check_availability),
                                f"calling the hooks of {who}", timeout)
            for f in dataclasses.fields(PluginRecord):
                if f.name != "patches":
                    setattr(rec, f.name, getattr(scratch, f.name))
        except (Exception, SystemExit) as exc:  # a bad plugin must not take the others down
            rec.status = "broken"
            rec.reason = f"{type(exc).__name__}: {exc}"
            rec.traceback = traceback.format_exc()
            if rec.plugin is not None or self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            rec.plugin = None
        return rec

    def _interrogate(self, rec: PluginRecord, check_availability: bool) -> None:
        """Read a registered plugin's declarations, availability and arch chain into ``rec``.

        :raises PluginFaultError: naming the plugin, for a declaration that breaks a hook's
            contract (the wrong type, a kernel for an unknown op, a path that is not one), or a
            hook that raises ``TypeError`` or ``ValueError``.
        """
        try:
            self._declare(rec, check_availability)
        except (TypeError, ValueError) as exc:
            raise PluginFaultError(f"plugin {rec.name!r} ({rec.distribution} {rec.version}): "
                                   f"{exc}", **_who(rec)) from exc

    def _declare(self, rec: PluginRecord, check_availability: bool) -> None:
        _read_declarations(self, rec)
        if rec.backend is not None and check_availability:
            avail = self.call(rec, "flowseam_backend_available")
            if avail is None:
                avail = Availability(True, "")
            if not (isinstance(avail, tuple) and len(avail) == 2 and isinstance(avail[0], bool)):
                raise TypeError(f"flowseam_backend_available() returned {avail!r}; "
                                "expected flowseam.seam.Availability(ok: bool, reason: str)")
            if not avail[0]:
                rec.status, rec.reason = "unavailable", str(avail[1] or "unavailable")
        if rec.backend is not None and rec.usable:
            rec.arch_chain = _arch_chain(self.call(rec, "flowseam_arch_chain"))


def _reject_unknown_hooks(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    unknown = [hc.name for hc in (pm.get_hookcallers(plugin) or []) if hc.spec is None]
    if unknown:
        known = sorted(n for n in dir(hookspecs) if n.startswith("flowseam_"))
        raise pluggy.PluginValidationError(
            plugin, f"plugin {name!r} implements unknown hook(s) {sorted(unknown)}; "
                    f"flowseam's hooks are {known}")


def _read_declarations(reg: PluginRegistry, rec: PluginRecord) -> None:
    backend = reg.call(rec, "flowseam_backend")
    if backend is not None and not isinstance(backend, BackendInfo):
        raise TypeError(f"flowseam_backend() returned {backend!r}; expected flowseam.seam.BackendInfo")
    rec.backend = backend

    kernels = list(reg.call(rec, "flowseam_register_kernels") or ())
    seen: set[tuple[str, str]] = set()
    for k in kernels:
        if not isinstance(k, KernelRegistration):
            raise TypeError(f"flowseam_register_kernels() yielded {k!r}; "
                            "expected flowseam.seam.KernelRegistration")
        if k.op not in ops.ALL_OPS:
            raise ValueError(
                f"kernel for unknown op {k.op!r}; known ops are {list(ops.ALL_OPS)}")
        if (k.op, k.arch) in seen:
            raise ValueError(f"plugin registers op {k.op!r} at arch {k.arch!r} twice")
        seen.add((k.op, k.arch))
    if kernels and backend is None:
        raise ValueError(
            "plugin registers kernels but declares no backend (flowseam_backend)")
    rec.kernels = kernels

    kinds = tuple(_names(reg.call(rec, "flowseam_component_kinds"), "flowseam_component_kinds"))
    unknown = sorted(k for k in kinds if k != "*" and k not in KINDS)
    if unknown:
        raise ValueError(f"flowseam_component_kinds() returned unknown kinds {unknown}; the kinds "
                         f"are {list(KINDS)} (or '*', every kind)")
    if kinds and backend is None:
        raise ValueError("plugin declares component kinds but no backend (flowseam_backend)")
    rec.component_kinds = kinds
    classes = _names(reg.call(rec, "flowseam_component_classes"), "flowseam_component_classes")
    bad = [c for c in classes if len(c.split(".")) < 2 or not all(p.isidentifier() for p in c.split("."))]
    if bad:
        raise ValueError(
            f"flowseam_component_classes() returned {bad!r}; expected dotted class "
            "paths such as 'flowseam_myvendor.models.MyDiT'")
    rec.component_classes = tuple(classes)
    rec.component_dtypes = _dtype_table(reg.call(rec, "flowseam_component_dtypes"))
    rec.methods = _named_mapping(reg.call(rec, "flowseam_training_methods"), "flowseam_training_methods")
    bad = [v for v in rec.methods.values() if isinstance(v, str) and not _is_import_path(v)]
    if bad:
        raise ValueError(
            f"flowseam_training_methods() returned {bad!r}; a method given by name is an import "
            "path 'package.module:Class'")
    rec.rewards = _named_mapping(reg.call(rec, "flowseam_rewards"), "flowseam_rewards")
    for hook, found in (("flowseam_training_methods", rec.methods),
                        ("flowseam_rewards", rec.rewards)):
        bad = [n for n in found if not _NAME.fullmatch(n)]
        if bad:
            raise ValueError(f"{hook}() returned the names {bad}; a name is letters, digits, "
                             "'_', '-' and '.', starting with a letter or a digit (no ':', which "
                             "qualifies a name with its plugin)")


def _dtype_table(result: Any) -> dict[str, tuple[str, ...]]:
    """``flowseam_component_dtypes()``'s mapping, every dtype checked
    (:mod:`flowseam.seam.dtypes`)."""
    from .dtypes import dtype_name

    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise TypeError(f"flowseam_component_dtypes() returned {result!r}; expected a mapping "
                        "of component kind to dtype names")
    return {str(kind): tuple(dtype_name(d, f"flowseam_component_dtypes()[{kind!r}]")
                             for d in _names(names, "flowseam_component_dtypes"))
            for kind, names in result.items()}


def _names(result: Any, hook: str) -> list[str]:
    """A hook result that must be an iterable of non-empty strings (a bare str is rejected)."""
    if result is None:
        return []
    if isinstance(result, (str, bytes)) or not isinstance(result, Iterable):
        raise TypeError(f"{hook}() returned {result!r}; expected a list of names")
    names = list(result)
    if any(not isinstance(n, str) or not n for n in names):
        raise TypeError(f"{hook}() returned {names!r}; expected non-empty strings")
    return names


def _named_mapping(result: Any, hook: str) -> dict[str, Any]:
    if result is None:
        return {}
    if not isinstance(result, Mapping) or any(not isinstance(k, str) or not k for k in result):
        raise TypeError(f"{hook}() returned {result!r}; expected a mapping of name (str) → object")
    return dict(result)


def _is_import_path(value: str) -> bool:
    """Whether ``value`` reads ``"package.module:attr"`` (an entry point's form)."""
    module, sep, attr = value.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".") + attr.split("."))


def _arch_chain(result: Any) -> tuple[str, ...]:
    chain = _names(result, "flowseam_arch_chain")
    if "generic" not in chain:
        chain.append("generic")
    elif chain[-1] != "generic":
        raise ValueError(
            f"flowseam_arch_chain() returned {chain!r}; 'generic' must come last")
    return tuple(chain)


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    names = {p.strip() for p in raw.split(",") if p.strip()}
    return names or None


#: The spellings of an environment switch (case and surrounding spaces ignored).
SWITCH_ON, SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_switch(var: str, default: bool) -> bool:
    """The on/off environment variable ``var``; ``default`` when it is unset or empty.

    :raises ValueError: for any other value than :data:`SWITCH_ON` / :data:`SWITCH_OFF`, naming
        the variable, its value and the allowed spellings (a typo such as ``FLOWSEAM_STRICT=ture``
        must not silently mean "off").
    """
    raw = os.environ.get(var, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value not in SWITCH_ON + SWITCH_OFF:
        raise InvalidInputError(
            f"{var}={raw!r} is not a switch: use one of {', '.join(SWITCH_ON)} (on) "
            f"or {', '.join(SWITCH_OFF)} (off)")
    return value in SWITCH_ON


def strict_mode() -> bool:
    """``FLOWSEAM_STRICT`` (default off). :raises ValueError: for a value that is not a switch."""
    return env_switch("FLOWSEAM_STRICT", False)


def _entry_point_value_loader(name: str, value: str) -> Callable[[], Any]:
    return metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP).load


# -- the names plugins register (training methods, rewards) --------------------------------------

def claims(attr: str) -> dict[str, list[tuple[PluginRecord, Any]]]:
    """name → ``[(plugin record, registered object)]`` of every usable plugin, in plugin-name
    order; ``attr`` is ``"methods"`` or ``"rewards"``. A registered object may still be an
    import path (:func:`registered_object` imports it)."""
    found: dict[str, list[tuple[PluginRecord, Any]]] = {}
    for rec in sorted(discover().usable(), key=lambda r: r.name):
        for name, obj in getattr(rec, attr).items():
            found.setdefault(name, []).append((rec, obj))
    return found


def registered_object(rec: PluginRecord, obj: Any) -> Any:
    """``obj`` itself, or for an import path ``"package.module:attr"`` (how a plugin registers a
    method without importing it at discovery) the object it names, imported as discovery imports
    a plugin: with its timeout, ``os._exit`` and ``sys.exit`` refused, and what it prints sent
    to stderr (:func:`~flowseam.seam.isolation.run_plugin_code`).

    :raises PluginLoadError: naming the plugin and the path when it cannot be imported.
    """
    if not isinstance(obj, str):
        return obj
    load = _entry_point_value_loader(rec.name, obj)  # resolved as an entry point's value
    try:
        with patch_watch(rec, f"importing {obj}"):
            return run_plugin_code(load, f"importing {obj!r} of plugin {rec.name!r}",
                                   plugin_timeout())
    except (Exception, SystemExit) as exc:
        raise PluginLoadError(f"plugin {rec.name!r} ({rec.distribution} {rec.version}) registers "
                              f"{obj!r}, which cannot be imported: {type(exc).__name__}: "
                              f"{exc}", **_who(rec)) from exc


def names(attr: str) -> list[str]:
    """The names the usable plugins register as ``attr`` (a name two plugins register only
    qualified, ``"<plugin>:<name>"``), without importing anything."""
    return sorted(name if len(found) == 1 else f"{rec.name}:{name}"
                  for name, found in claims(attr).items() for rec, _ in found)


def registered(attr: str) -> dict[str, tuple[PluginRecord, Any]]:
    """name → (plugin record, imported object) of everything the usable plugins register as
    ``attr``; a name two plugins register appears only qualified, as ``"<plugin>:<name>"``."""
    out: dict[str, tuple[PluginRecord, Any]] = {}
    for name, found in claims(attr).items():
        if len(found) == 1:
            rec, obj = found[0]
            out[name] = (rec, registered_object(rec, obj))
        else:  # a conflict: only the qualified names resolve
            out.update({f"{rec.name}:{name}": (rec, registered_object(rec, obj))
                        for rec, obj in found})
    return out


def resolve(attr: str, what: str, name: str) -> tuple[PluginRecord, Any]:
    """``(plugin record, imported object)`` registered as ``name`` (or ``"plugin:name"``).

    :raises InvalidInputError: for an unknown name (listing the registered ones), or a name that
        two or more plugins register (listing them, and how to choose): never a silent winner.
    :raises PluginLoadError: when its import path cannot be imported.
    """
    found = claims(attr)
    plugin, sep, short = name.rpartition(":")
    if sep and short in found:
        for rec, obj in found[short]:
            if rec.name == plugin:
                return rec, registered_object(rec, obj)
    if name not in found:
        broken = sorted(r.name for r in discover().broken())
        raise InvalidInputError(
            f"unknown {what} {name!r}; registered {attr}: {sorted(set(names(attr)))}"
            + (f" (broken plugins, which may register more: {', '.join(broken)}; flowseam "
               "backends says why)" if broken else ""))
    if len(found[name]) > 1:
        who = ", ".join(f"{rec.name!r} ({rec.distribution} {rec.version})"
                        for rec, _ in found[name])
        first = found[name][0][0].name
        others = ",".join(rec.name for rec, _ in found[name][1:])
        raise InvalidInputError(
            f"{what} {name!r} is registered by {len(found[name])} plugins: {who}; flowseam does "
            f"not pick one silently. Name one as '{first}:{name}', or block the others with "
            f"FLOWSEAM_DISABLE_PLUGINS={others}")
    rec, obj = found[name][0]
    return rec, registered_object(rec, obj)


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "?"


def _dist_version(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else "?"


def scan() -> PluginRegistry:
    """Scan the entry-point group and load every plugin (uncached), honouring the environment:

    - ``FLOWSEAM_PLUGINS=a,b``: allow-list of entry-point names; every other plugin is
      ``blocked``.
    - ``FLOWSEAM_DISABLE_PLUGINS=a,b``: block-list.
    - ``FLOWSEAM_STRICT=1``: a broken plugin raises :class:`~flowseam.PluginLoadError` naming it
      (``0/1``, ``false/true``, ``no/yes``, ``off/on``; any other value is refused, see
      :func:`env_switch`).
    """
    global DISCOVERY_SCANS
    DISCOVERY_SCANS += 1
    plugin_timeout()  # a bad FLOWSEAM_PLUGIN_TIMEOUT is an error before any plugin loads
    strict = strict_mode()  # and so is a bad FLOWSEAM_STRICT
    allow = _env_list("FLOWSEAM_PLUGINS")
    block = _env_list("FLOWSEAM_DISABLE_PLUGINS") or set()
    reg = PluginRegistry()
    eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP),
                 key=lambda e: (e.name, _dist_name(e)))
    known = {ep.name for ep in eps}
    for name in sorted((allow or set()) - known):
        warnings.warn(f"FLOWSEAM_PLUGINS names {name!r}, which is not an installed plugin; "
                      f"installed: {sorted(known)}", stacklevel=2)
    try:  # plugins import torch; import it first, so a hung plugin never holds its import lock
        import torch  # noqa: F401  (and so that patch_watch has a "before")
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    claims: dict[str, list[metadata.EntryPoint]] = {}
    for ep in eps:
        claims.setdefault(ep.name, []).append(ep)
    for name, group in claims.items():
        dists = [(_dist_name(ep), _dist_version(ep)) for ep in group]
        if (allow is not None and name not in allow) or name in block:
            why = "not in FLOWSEAM_PLUGINS" if allow is not None and name not in allow \
                else "listed in FLOWSEAM_DISABLE_PLUGINS"
            reg.records[name] = PluginRecord(name=name, value=group[0].value,
                                             distribution=dists[0][0], version=dists[0][1],
                                             status="blocked", reason=why)
            continue
        if len(group) > 1:
            # No distribution may take another's name (a package registering "cpu" would replace
            # flowseam-cpu): every claimant is skipped, loudly, until all but one are removed.
            listed = ", ".join(f"{d} {v} ({ep.value})" for (d, v), ep in zip(dists, group))
            for i, (ep, (dist_name, version)) in enumerate(zip(group, dists)):
                key = name if i == 0 else f"{name}@{dist_name}"
                reg.records[key] = PluginRecord(
                    name=key, value=ep.value, distribution=dist_name, version=version,
                    status="broken",
                    reason=f"entry-point name {name!r} is claimed by {len(group)} distributions: "
                           f"{listed}; none of them is loaded, so that no package silently takes "
                           "another's place; uninstall or rename all but one")
            continue
        reg.load(name, group[0].value, dists[0][0], dists[0][1], group[0].load)
    if strict:
        raise_if_broken(reg)
    return reg


def _who(*records: PluginRecord) -> dict[str, str]:
    """The plugin fields of a :class:`~flowseam.errors.PluginFaultError` naming ``records``."""
    return {"plugin": ", ".join(r.name for r in records),
            "distribution": ", ".join(r.distribution for r in records),
            "version": ", ".join(str(r.version) for r in records), "what": "plugin"}


def raise_if_broken(reg: PluginRegistry) -> None:
    broken = reg.broken()
    if broken:
        details = "\n\n".join(f"plugin {r.name!r} ({r.distribution} {r.version}) is broken: "
                              f"{r.reason}\n{r.traceback}" for r in broken)
        names = ", ".join(repr(r.name) for r in broken)
        raise PluginLoadError(f"broken flowseam plugin(s) {names} (strict mode):\n{details}",
                              **_who(*broken))


_CACHE: PluginRegistry | None = None


def scanned() -> bool:
    """Whether this process has discovered the plugins (a worker given a platform by
    :meth:`Platform.from_dict` never does)."""
    return _CACHE is not None


def discover(refresh: bool = False) -> PluginRegistry:
    """The process-wide :class:`PluginRegistry` (scanned on first use, then cached); pass
    ``refresh=True`` after changing the environment or ``sys.path``.

    :raises PluginLoadError: in strict mode (``FLOWSEAM_STRICT=1``), if any plugin is broken.
    """
    global _CACHE
    if _CACHE is None or refresh:
        _CACHE = None
        _CACHE = scan()
    return _CACHE


def load_without_discovery(plugins: list[dict[str, str]]) -> PluginRegistry:
    """Rebuild a registry from a serialized plugin list (``name``, ``value``, ``distribution``,
    ``version``) by importing each entry-point value directly: no entry-point scan and no
    availability check. Used by :meth:`flowseam.Platform.from_dict` in worker processes.

    :raises PluginLoadError: if a listed plugin cannot be loaded here.
    """
    reg = PluginRegistry()
    for p in plugins:
        try:
            installed = metadata.version(p["distribution"])
        except metadata.PackageNotFoundError:
            installed = None
        if installed != p["version"]:
            raise PluginLoadError(
                f"plugin {p['name']!r} needs {p['distribution']}=={p['version']}, but this process "
                f"has {installed or 'no such distribution'}; kernel ids would not mean the same code",
                plugin=p["name"], distribution=p["distribution"], version=p["version"])
        rec = reg.load(p["name"], p["value"], p["distribution"], p["version"],
                       _entry_point_value_loader(p["name"], p["value"]), check_availability=False)
        rec.arch_chain = tuple(p.get("arch_chain") or ("generic",))
        if rec.status == "broken":
            raise PluginLoadError(f"plugin {rec.name!r} ({rec.value}) could not be loaded in this "
                                  f"process: {rec.reason}\n{rec.traceback}", **_who(rec))
    return reg
