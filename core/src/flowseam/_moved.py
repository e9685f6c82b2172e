"""Import paths that moved in flowseam 0.2, still importable until 0.3 with a DeprecationWarning.

``import flowseam.components`` (and ``from flowseam.components import instantiate``) gives the
module at its new path, :mod:`flowseam.seam.components`: the same module object, not a copy, so
a name patched through either path is patched for both. :func:`install` puts the finder on
``sys.meta_path`` (``import flowseam`` does it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module path → where it is now
MOVED = {
    **{f"flowseam.{name}": f"flowseam.seam.{name}"
       for name in ("components", "declarations", "dtypes", "faults", "hookspecs",
                    "isolation", "kernels", "platform", "tables", "weights")},
    "flowseam.plugins": "flowseam.seam.discovery",
    "flowseam.console": "flowseam.seam.notices",
    "flowseam.adapters": "flowseam.models.adapters",
    "flowseam.defaults": "flowseam.checkpoint_defaults",
    "flowseam.policies": "flowseam.request_fields",
    "flowseam.refiner": "flowseam.prompt_refiner",
    "flowseam.models.base": "flowseam.models",
    "flowseam.training.rewards": "flowseam.rewards.spec",
    "flowseam.training.toy_rewards": "flowseam.rewards.simple",
    "flowseam.rewards.server": "flowseam.rewards.reward_server",
    "flowseam.serve.metrics": "flowseam.serve.prometheus",
}
#: the release that drops the old paths
REMOVED_IN = "0.3"


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads the module at its new path."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes in "
                      f"flowseam {REMOVED_IN})", DeprecationWarning, stacklevel=2)  # past importlib's frames, which warnings skips
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system sets __spec__ to the old path's
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
