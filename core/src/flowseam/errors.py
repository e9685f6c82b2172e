"""Exceptions raised by flowseam. Every one names the bad value and what is allowed."""

from __future__ import annotations


class FlowseamError(Exception):
    """Base class of every error flowseam raises on purpose."""


class PluginLoadError(FlowseamError):
    """A plugin failed to import, failed hook validation or raised in its availability check,
    and strict mode (``FLOWSEAM_STRICT=1``) turns that into an error. The message names the
    plugin and carries its traceback."""


class BackendUnavailableError(FlowseamError):
    """``Platform(name)`` named a backend that is unknown, blocked, broken or unavailable.
    The message lists every backend and why each unavailable one is unavailable."""


class UnknownOpError(FlowseamError, KeyError):
    """``platform.kernels.get(op)`` asked for an op that no plugin on the device chain registers."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class KernelPinError(FlowseamError):
    """``platform.kernels.pin(impl_id)`` asked for an implementation that this platform cannot
    run. The message lists the implementation ids it can run."""


class ComponentBuildError(FlowseamError):
    """No plugin on the device chain could build a component of the requested kind."""
