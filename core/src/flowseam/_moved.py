"""Import paths that moved in flowseam 0.2, still importable until 0.3 with a DeprecationWarning.

``import flowseam.components`` (and ``from flowseam.components import instantiate``) gives a
module that forwards every name to where it is now, :mod:`flowseam.seam.components`; an old module
whose names went to several new ones forwards to each in turn, and a name renamed on the way
(``flowseam.kernels.Conflict``) resolves to its new name. :func:`install` puts the finder on
``sys.meta_path`` (``import flowseam`` does it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
import warnings
from typing import Any

#: old module path → the modules its names are in now, the main one first
MOVED: dict[str, tuple[str, ...]] = {
    **{f"flowseam.{name}": (f"flowseam.seam.{name}",)
       for name in ("components", "declarations", "dtypes", "hookspecs", "isolation", "kernels",
                    "platform", "tables", "weights")},
    "flowseam.faults": ("flowseam.seam.faults", "flowseam.loops.checks"),
    "flowseam.plugins": ("flowseam.seam.discovery",),
    "flowseam.console": ("flowseam.seam.notices", "flowseam.seam.report", "flowseam.seam.tables",
                         "flowseam.quiet"),
    "flowseam.adapters": ("flowseam.models.adapters",),
    "flowseam.defaults": ("flowseam.checkpoint_defaults",),
    "flowseam.policies": ("flowseam.request_fields",),
    "flowseam.refiner": ("flowseam.prompt_refiner",),
    "flowseam.demo.refiner": ("flowseam.demo.refiner_lm",),
    "flowseam.models.base": ("flowseam.models",),
    "flowseam.training.rewards": ("flowseam.rewards.spec", "flowseam.rewards.simple",
                                  "flowseam.seam.reward_contract", "flowseam.training.config"),
    "flowseam.training.toy_rewards": ("flowseam.rewards.simple",),
    "flowseam.rewards.server": ("flowseam.rewards.reward_server",),
    "flowseam.serve.metrics": ("flowseam.serve.prometheus",),
}
#: old module path → {old name: its new name}, for names renamed as they moved
RENAMED: dict[str, dict[str, str]] = {"flowseam.kernels": {"Conflict": "KernelConflict"}}
#: the release that drops the old paths
REMOVED_IN = "0.3"


class MovedModule(types.ModuleType):
    """An old path: every name is read from the modules it moved to, in order."""

    def __init__(self, name: str, targets: list[types.ModuleType], renamed: dict[str, str]):
        super().__init__(name, f"moved to {targets[0].__name__} (until flowseam {REMOVED_IN})")
        self._targets, self._renamed = targets, renamed
        self.__all__ = sorted({n for t in targets for n in getattr(t, "__all__", None) or
                               (k for k in vars(t) if not k.startswith("_"))} | set(renamed))

    def __getattr__(self, name: str) -> Any:
        new = self._renamed.get(name, name)
        for target in self._targets:
            if hasattr(target, new):
                return getattr(target, new)
        raise AttributeError(f"module {self.__name__!r} (moved to "
                             f"{', '.join(t.__name__ for t in self._targets)}) has no {name!r}")

    def __dir__(self) -> list[str]:
        return self.__all__


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads a :class:`MovedModule` for it."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        where = new[0] + (f" (and {', '.join(new[1:])})" if len(new) > 1 else "")
        warnings.warn(f"{spec.name} moved to {where}; import it from there (the old path goes in "
                      f"flowseam {REMOVED_IN})", DeprecationWarning, stacklevel=_importer())
        return MovedModule(spec.name, [importlib.import_module(n) for n in new],
                           RENAMED.get(spec.name, {}))

    def exec_module(self, module):
        pass


def _importer() -> int:
    """The ``stacklevel`` that names the code asking for an old path: past the import system
    (whose bootstrap frames :func:`warnings.warn` skips itself), ``importlib.import_module`` and
    ``flowseam.__getattr__`` (``flowseam.components`` as an attribute)."""
    frame, level = sys._getframe(2), 2  # create_module's caller
    while frame is not None:
        file = frame.f_code.co_filename
        if not ("importlib" in file and "_bootstrap" in file):
            if not file.endswith((f"importlib{os.sep}__init__.py", f"flowseam{os.sep}__init__.py")):
                return level
            level += 1
        frame = frame.f_back
    return level


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
