"""The contract of a training method, and how a registered one is found.

A training method is a class written against :class:`TrainingMethod` and registered through the
``flowseam_training_methods`` hook (name → the class, or its import path
``"package.module:Class"``, imported on first use). ``flowseam train --method NAME`` uses exactly
this contract: :meth:`~TrainingMethod.default_config` for ``--show-config``,
:meth:`~TrainingMethod.check_world_size` before it starts ``--nproc`` ranks, then
``cls(config).run()``; flowseam's own methods are registered and run the same way.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, ClassVar, Mapping, TypedDict

from ..errors import PluginFaultError
from .discovery import PluginRecord, claims, registered, registered_object, resolve


class TrainingRecord(TypedDict, total=False):
    """One training step's metrics (``metrics.jsonl`` holds one per line): ``step`` (1-based)
    and whatever the method measures (``loss``, ``reward_mean``, ``seconds_*``, ...)."""

    step: int


class _TrainingSummaryRequired(TypedDict):
    steps: int
    records: list[dict[str, Any]]


class TrainingSummary(_TrainingSummaryRequired, total=False):
    """What :meth:`TrainingMethod.run` returns.

    :ivar steps: the steps the run has completed (counting those of a resumed run).
    :ivar records: the steps' metrics (:class:`TrainingRecord`), oldest first.
    :ivar exported: stage → ``{"model": directory, "lora": file}`` of what the run exported
        (a diffusers-format model; a LoRA run also a LoRA file), when it exports.
    """

    exported: dict[str, dict[str, str]]


class TrainingMethod(abc.ABC):
    """A training method: turns rollouts or data into weight updates.

    A subclass sets :attr:`name`, takes its whole config in ``__init__`` (checking it there,
    before any model loads: :class:`~flowseam.errors.InvalidInputError` naming the key) and
    implements :meth:`run`. Its class docstring's first sentence is what ``flowseam train
    --help`` lists.
    """

    #: the method's own name, recorded by its runs (``run.json``, an exported model's
    #: ``flowseam.json``); usually the name it is registered under
    name: ClassVar[str] = ""
    #: the keys of :meth:`default_config` that are TOML tables (``--show-config`` prints each as
    #: a ``[table]``)
    config_tables: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """Every key of the config with its default (None: required, or chosen at run time): the
        schema ``--show-config`` prints as TOML. The default: no published keys."""
        return {}

    @classmethod
    def check_world_size(cls, config: Mapping[str, Any], world_size: int) -> None:
        """Refuse a config that cannot run on ``world_size`` data-parallel ranks (a batch that
        does not split), before any rank starts (``flowseam train --nproc``). The default
        accepts any.

        :raises InvalidInputError: naming the key and the numbers.
        """

    @classmethod
    def summary(cls) -> str:
        """The first sentence of the class docstring, as plain text."""
        text = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split()).replace("``", "")
        end = text.find(". ")
        return text if end < 0 else text[:end + 1]

    @abc.abstractmethod
    def __init__(self, config: dict[str, Any]) -> None:
        """Check ``config`` (unknown keys, bad values) before any model loads.

        :raises InvalidInputError: naming the key and what is allowed.
        """

    @abc.abstractmethod
    def run(self, progress: bool = True) -> TrainingSummary:
        """Train to the config's end (resuming from the run directory's last checkpoint where
        the method checkpoints); ``progress`` shows a progress bar."""


def _fault(rec: PluginRecord, name: str, problem: str) -> PluginFaultError:
    """The plugin fault of training method ``name`` of plugin ``rec``: ``problem``."""
    return PluginFaultError(f"plugin {rec.name!r} ({rec.distribution} {rec.version}) registers "
                            f"training method {name!r} as {problem}", plugin=rec.name,
                            distribution=rec.distribution, version=str(rec.version),
                            what=f"training method {name!r}")


def _checked(rec: PluginRecord, name: str, obj: Any) -> type[TrainingMethod]:
    """``obj`` if it is a :class:`TrainingMethod` subclass (a real one: a class ``register``-ed
    as a virtual subclass inherits nothing of the contract) with a name and ``run``.

    :raises PluginFaultError: naming the plugin, otherwise.
    """
    if not (isinstance(obj, type) and TrainingMethod in obj.__mro__):
        raise _fault(rec, name, f"{obj!r}, which is not a subclass of flowseam.seam."
                                "TrainingMethod (the contract flowseam train runs methods by)")
    missing = sorted(getattr(obj, "__abstractmethods__", ()))
    if not (isinstance(obj.name, str) and obj.name):
        missing.append(f"name (a non-empty str; it has {obj.name!r})")
    if missing:
        raise _fault(rec, name, f"{obj.__qualname__}, which does not implement "
                                f"{', '.join(missing)} of flowseam.seam.TrainingMethod")
    return obj


def registered_methods() -> dict[str, type[TrainingMethod]]:
    """Every registered training method: name → class (each imported and checked against the
    contract). A name two plugins register appears only qualified, as ``"<plugin>:<name>"``.

    :raises PluginLoadError: if a method registered by import path cannot be imported.
    :raises PluginFaultError: for a registered object that is not a :class:`TrainingMethod`.
    """
    return {name: _checked(rec, name, obj) for name, (rec, obj) in registered("methods").items()}


def method_summaries() -> dict[str, str]:
    """name → the summary of each registered method, or why it cannot be used (its import path
    fails, it is not a :class:`TrainingMethod`, its summary raises): for a listing that shows
    every method whatever the others do."""
    out = {}
    for name, found in claims("methods").items():
        for rec, obj in found:
            key = name if len(found) == 1 else f"{rec.name}:{name}"
            try:
                out[key] = " ".join(str(_checked(rec, name, registered_object(rec, obj))
                                        .summary()).split())
            except Exception as exc:  # noqa: BLE001 - a listing names it and goes on
                out[key] = f"(unusable: {type(exc).__name__}: {exc})"
    return out


def resolve_method(name: str) -> tuple[PluginRecord, type[TrainingMethod]]:
    """``(plugin record, class)`` of the training method ``name`` (or ``"<plugin>:<name>"``).

    :raises InvalidInputError: for an unknown method (listing the registered ones), or one that
        several plugins register (naming them).
    :raises PluginLoadError: if its plugin registered an import path that cannot be imported.
    :raises PluginFaultError: if what its plugin registered is not a :class:`TrainingMethod`.
    """
    rec, obj = resolve("methods", "training method", name)
    return rec, _checked(rec, name.rpartition(":")[2], obj)


def get_method(name: str) -> type[TrainingMethod]:
    """The training method ``name`` (or ``"<plugin>:<name>"``): :func:`resolve_method`'s class.

    :raises InvalidInputError: see :func:`resolve_method`.
    :raises PluginLoadError: see :func:`resolve_method`.
    :raises PluginFaultError: see :func:`resolve_method`.
    """
    return resolve_method(name)[1]


class Checked:
    """A registered method's calls, each checked against the contract: a call its signature
    does not take, or a result of the wrong type, is its plugin's fault (named); what the
    method raises itself passes unchanged (its ``InvalidInputError`` is the user's to fix).

    :param name: the name it was asked for; ``rec``, ``cls``: :func:`resolve_method`'s.
    """

    def __init__(self, name: str, rec: PluginRecord, cls: type[TrainingMethod]) -> None:
        self.name, self.rec, self.cls = name.rpartition(":")[2], rec, cls

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as exc:
            raise _fault(self.rec, self.name, f"{self.cls.__qualname__}, whose {what} does not "
                                              f"take what the contract passes: {exc}") from None
        except ValueError:  # no signature to read: let the call decide
            pass
        return fn(*args, **kwargs)

    def default_config(self) -> dict[str, Any]:
        """:meth:`TrainingMethod.default_config`, a mapping of ``str`` keys."""
        config = self._call("default_config()", self.cls.default_config)
        if not (isinstance(config, Mapping) and _plain(config)):
            raise _fault(self.rec, self.name, f"{self.cls.__qualname__}, whose default_config() "
                                              f"returned {config!r:.80}; expected a mapping of "
                                              "str keys to TOML values (str, numbers, bools, None, "
                                              "lists and tables of them)")
        return dict(config)

    def check_world_size(self, config: dict[str, Any], world_size: int) -> None:
        """:meth:`TrainingMethod.check_world_size`."""
        self._call("check_world_size(config, world_size)", self.cls.check_world_size, config,
                   world_size)

    def run(self, config: dict[str, Any], progress: bool = True) -> TrainingSummary:
        """``cls(config).run(progress=progress)``, its summary checked.

        :raises PluginFaultError: for a summary that is not a :class:`TrainingSummary`.
        """
        method = self._call("__init__(config)", self.cls, config)
        summary = self._call("run(progress=...)", method.run, progress=progress)
        problem = _summary_problem(summary)
        if problem:
            raise _fault(self.rec, self.name, f"{self.cls.__qualname__}, whose run() returned "
                                              f"{problem}")
        return summary


def _plain(value: Any) -> bool:
    """Whether ``value`` is what a TOML config holds (None standing for a key left out)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, Mapping) and all(isinstance(k, str) and _plain(v)
                                              for k, v in value.items())


def _summary_problem(summary: Any) -> str | None:
    """What is wrong with ``summary`` as a :class:`TrainingSummary`, or None."""
    if not isinstance(summary, Mapping):
        return f"{summary!r:.80}; expected a TrainingSummary (a dict)"
    if isinstance(summary.get("steps"), bool) or not isinstance(summary.get("steps"), int):
        return f"steps={summary.get('steps')!r:.40}; expected an int"
    records = summary.get("records")
    if not (isinstance(records, list) and all(isinstance(r, Mapping) for r in records)):
        return f"records={records!r:.60}; expected a list of dicts"
    exported = summary.get("exported") or {}
    if not (isinstance(exported, Mapping) and all(
            isinstance(p, Mapping) and isinstance(p.get("model"), str) for p in exported.values())):
        return f"exported={exported!r:.60}; expected stage → {{'model': directory, ...}}"
    return None
