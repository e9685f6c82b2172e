"""The seam: flowseam's plugin contract and its resolution.

What a plugin may implement (:mod:`.hookspecs`) and return (:mod:`.declarations`), how plugins are
found and kept from harming the host (:mod:`.discovery`, :mod:`.isolation`), the choice they
resolve to in one process (:class:`Platform`, its :class:`KernelTable` and component builder),
how their run-time faults are named (:mod:`.faults`), and the written contracts of the other
plugin kinds — training methods (:mod:`.method_contract`) and rewards (:mod:`.reward_contract`) —
with how the ones plugins register are found.

This package, :mod:`flowseam.ops` and :mod:`flowseam.testing` are the only parts of flowseam a
backend imports (``tests/test_layout.py`` checks the in-repo ones). Importing it does not import
torch.
"""

from .components import (
    ACTIVATIONS,
    KINDS,
    MODULE_KINDS,
    ComponentRecord,
    ComponentSpec,
    cast_inputs,
    compute_dtype,
    instantiate,
)
from .declarations import (
    Availability,
    BackendInfo,
    ConformanceExpectations,
    KernelRegistration,
    Provenance,
)
from .discovery import discover
from .dtypes import dtype_name, torch_dtype
from ..errors import (
    BackendUnavailableError,
    CheckpointError,
    ComponentBuildError,
    ComponentFaultError,
    FlowseamError,
    InvalidInputError,
    InvalidParameterError,
    KernelArgumentError,
    KernelFaultError,
    KernelPinError,
    NotEnoughMemoryError,
    PluginFaultError,
    PluginLoadError,
    RewardFaultError,
    RewardServerError,
    UnknownOpError,
    UnsafeCheckpointError,
    UntrustedComponentError,
)
from .hookspecs import hookimpl
from .kernels import BoundKernel, KernelTable
from .method_contract import TrainingMethod, TrainingSummary, get_method, registered_methods
from .notices import enable_notices, long_wait, notices_enabled
from .platform import Platform
from .reward_contract import RewardFunction, get_reward, registered_rewards

__all__ = [
    "ACTIVATIONS", "Availability", "BackendInfo", "BackendUnavailableError", "BoundKernel",
    "CheckpointError", "ComponentBuildError", "ComponentFaultError", "ComponentRecord",
    "ComponentSpec", "ConformanceExpectations", "FlowseamError", "InvalidInputError",
    "InvalidParameterError", "KINDS", "KernelArgumentError", "KernelFaultError", "KernelPinError",
    "KernelRegistration", "KernelTable", "MODULE_KINDS", "NotEnoughMemoryError", "Platform",
    "PluginFaultError", "PluginLoadError", "Provenance", "RewardFaultError", "RewardFunction",
    "RewardServerError", "TrainingMethod", "TrainingSummary", "UnknownOpError",
    "UnsafeCheckpointError", "UntrustedComponentError", "cast_inputs", "compute_dtype", "discover",
    "dtype_name", "enable_notices", "get_method", "get_reward", "hookimpl", "instantiate",
    "long_wait", "notices_enabled", "registered_methods", "registered_rewards", "torch_dtype",
]
