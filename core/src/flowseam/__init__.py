"""flowseam: serve and RL-post-train flow-matching diffusion models through backend plugins.

The public API is re-exported here; see DESIGN.md for the vocabulary.
"""

from . import ops
from .components import ComponentRecord, ComponentSpec
from .declarations import Availability, BackendInfo, KernelRegistration, Provenance
from .errors import (
    BackendUnavailableError,
    ComponentBuildError,
    FlowseamError,
    KernelPinError,
    PluginLoadError,
    UnknownOpError,
)
from .hookspecs import hookimpl
from .kernels import BoundKernel, KernelTable
from .loading import load
from .loops import BehaviorRecord, ExecutionProfile, LoopResult, run_loop
from .platform import Platform
from .plugins import discover
from .request import DiffusionParams, GenerationRequest, TaskType

__version__ = "0.1.0"

__all__ = [
    "BehaviorRecord", "DiffusionParams", "ExecutionProfile", "GenerationRequest", "LoopResult",
    "TaskType", "load", "run_loop",
    "Availability", "BackendInfo", "BackendUnavailableError", "BoundKernel", "ComponentBuildError",
    "ComponentRecord", "ComponentSpec", "FlowseamError", "KernelPinError", "KernelRegistration",
    "KernelTable", "Platform", "PluginLoadError", "Provenance", "UnknownOpError", "discover",
    "hookimpl", "ops",
]
