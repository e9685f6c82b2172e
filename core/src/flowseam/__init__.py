"""flowseam: serve and RL-post-train flow-matching diffusion models through backend plugins.

The public API is re-exported here (``help(flowseam)`` lists it; docs/architecture.md explains
the vocabulary): ``load`` (a diffusers-format checkpoint → a model whose ``generate`` serves it);
``run_loop`` / ``rollout_loop`` (the denoising loop behind it, ``ExecutionProfile.SERVE`` or
``ROLLOUT``, which records a ``BehaviorRecord`` per step); ``Platform`` and ``discover`` (the
resolved backend choice and the plugins behind it); ``DiffusionParams``, ``GenerationRequest``,
``TaskType`` (a request); ``hookimpl``, ``ops`` and the records a backend plugin returns; and the
errors, all subclasses of ``FlowseamError``.

``import flowseam`` imports the seam layer, not torch: ``load``, the loops and their records come
on first access (PEP 562 ``__getattr__``), which keeps the plugin loader, ``flowseam backends``
and flowseam's pytest plugin (loaded by every pytest run where flowseam is installed) cheap to
import. The layers: docs/architecture.md, "Rules the code keeps".
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
