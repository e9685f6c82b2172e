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


def _checked(rec: PluginRecord, name: str, obj: Any) -> type[TrainingMethod]:
    """``obj`` if it is a :class:`TrainingMethod` subclass with a name.

    :raises PluginFaultError: naming the plugin, otherwise.
    """
    who = f"plugin {rec.name!r} ({rec.distribution} {rec.version})"
    if not (isinstance(obj, type) and issubclass(obj, TrainingMethod)):
        raise PluginFaultError(
            f"{who} registers training method {name!r} as {obj!r}, which is not a subclass of "
            "flowseam.seam.TrainingMethod (the contract flowseam train runs methods by)",
            plugin=rec.name, distribution=rec.distribution, version=str(rec.version),
            what=f"training method {name!r}")
    if inspect.isabstract(obj) or not (isinstance(obj.name, str) and obj.name):
        missing = sorted(getattr(obj, "__abstractmethods__", ())) or ["name"]
        raise PluginFaultError(
            f"{who} registers training method {name!r} as {obj.__qualname__}, which does not "
            f"implement {', '.join(missing)} of flowseam.seam.TrainingMethod",
            plugin=rec.name, distribution=rec.distribution, version=str(rec.version),
            what=f"training method {name!r}")
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
    fails, it is not a :class:`TrainingMethod`): for a listing that shows every method."""
    out = {}
    for name, found in claims("methods").items():
        for rec, obj in found:
            key = name if len(found) == 1 else f"{rec.name}:{name}"
            try:
                out[key] = _checked(rec, name, registered_object(rec, obj)).summary()
            except PluginFaultError as exc:
                out[key] = f"(unusable: {exc})"
    return out


def get_method(name: str) -> type[TrainingMethod]:
    """The training method ``name`` (or ``"<plugin>:<name>"``).

    :raises InvalidInputError: for an unknown method (listing the registered ones), or one that
        several plugins register (naming them).
    :raises PluginLoadError: if its plugin registered an import path that cannot be imported.
    :raises PluginFaultError: if what its plugin registered is not a :class:`TrainingMethod`.
    """
    rec, obj = resolve("methods", "training method", name)
    return _checked(rec, name, obj)
