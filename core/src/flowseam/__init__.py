"""flowseam: serve and RL-post-train flow-matching diffusion models through backend plugins.

The public API is re-exported here (docs/architecture.md explains the vocabulary):

* ``load(path, platform=None, verbose=False)``: a diffusers-format checkpoint → a model whose
  ``generate(prompt, params=DiffusionParams(...))`` serves it;
* ``run_loop(model, request, profile)`` / ``rollout_loop(...)``: the denoising loop behind it
  (``ExecutionProfile.SERVE`` or ``ROLLOUT``, which captures a ``BehaviorRecord`` per step and
  returns a ``LoopResult``);
* ``Platform.detect()`` / ``Platform(name)``: the resolved backend choice (``platform.kernels``,
  ``platform.build_component``, ``platform.explain()``); ``discover()`` the plugins behind it;
* ``DiffusionParams``, ``GenerationRequest``, ``TaskType``: what a request asks for;
* ``hookimpl``, ``BackendInfo``, ``Availability``, ``KernelRegistration``, ``ComponentSpec``,
  ``ConformanceExpectations``, ``ops``: what a backend plugin implements and returns;
* the errors, all subclasses of ``FlowseamError``.

``import flowseam`` does not import torch: the names that need it (``load``, ``run_loop`` and the
loop records) are imported on first access (PEP 562 ``__getattr__``; ``dir(flowseam)`` and
``help(flowseam)`` list them). That keeps the plugin loader, ``flowseam backends`` and
flowseam's pytest plugin (loaded by every pytest run in an environment where flowseam is
installed) cheap to import.

The modules stand in layers (seam below models below loops below training, serve and the CLI;
``tests/test_layout.py`` states and checks them). This package is the public API over all of
them: what it imports on ``import flowseam`` is the seam, and the names of the higher layers
(``load``, the loops) come on first access.
"""

from typing import TYPE_CHECKING, Any

from . import _moved, ops
from .request import DiffusionParams, GenerationRequest, TaskType
from .seam import (
    Availability,
    BackendInfo,
    BackendUnavailableError,
    BoundKernel,
    CheckpointError,
    ComponentBuildError,
    ComponentFaultError,
    ComponentRecord,
    ComponentSpec,
    ConformanceExpectations,
    FlowseamError,
    InvalidInputError,
    InvalidParameterError,
    KernelArgumentError,
    KernelFaultError,
    KernelPinError,
    KernelRegistration,
    KernelTable,
    Platform,
    PluginFaultError,
    PluginLoadError,
    Provenance,
    RewardFaultError,
    RewardServerError,
    UnknownOpError,
    UnsafeCheckpointError,
    UntrustedComponentError,
    discover,
    hookimpl,
)

_moved.install()  # the import paths that moved in 0.2 still work, with a DeprecationWarning

if TYPE_CHECKING:  # pragma: no cover
    from .loading import load
    from .parallel import Parallel
    from .loops import (
        BehaviorRecord,
        Chunk,
        ExecutionProfile,
        LoopResult,
        record_velocity,
        rollout_loop,
        run_loop,
        stream_loop,
    )

__version__ = "0.1.0"

#: Public names whose modules import torch, imported on first access: name -> module.
_LAZY = {
    "load": "loading", "Parallel": "parallel",
    "BehaviorRecord": "loops", "ExecutionProfile": "loops", "LoopResult": "loops",
    "run_loop": "loops", "rollout_loop": "loops", "stream_loop": "loops", "Chunk": "loops",
    "record_velocity": "loops",
}


def __getattr__(name: str) -> Any:
    """Import the lazy public names, and submodules (``flowseam.loops``), on first access."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'flowseam' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names and the lazy public ones (so ``dir()`` and ``help()`` show them)."""
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BehaviorRecord", "Chunk", "DiffusionParams", "ExecutionProfile", "GenerationRequest",
    "LoopResult", "Parallel", "TaskType", "load", "record_velocity", "rollout_loop", "run_loop", "stream_loop",
    "Availability", "BackendInfo", "BackendUnavailableError", "BoundKernel", "CheckpointError",
    "ComponentBuildError", "ComponentFaultError", "ComponentRecord", "ComponentSpec",
    "ConformanceExpectations", "FlowseamError", "InvalidInputError", "InvalidParameterError",
    "KernelArgumentError",
    "KernelFaultError", "KernelPinError", "KernelRegistration", "KernelTable", "Platform",
    "PluginFaultError", "PluginLoadError", "Provenance", "RewardFaultError",
    "RewardServerError", "UnknownOpError", "UnsafeCheckpointError",
    "UntrustedComponentError", "discover", "hookimpl", "ops",
]
