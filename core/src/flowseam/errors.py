"""Exceptions raised by flowseam. Every one names the bad value and what is allowed."""

from __future__ import annotations


class FlowseamError(Exception):
    """Base class of every error flowseam raises on purpose."""


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


class UntrustedComponentError(FlowseamError):
    """A checkpoint names a component class flowseam does not import: only diffusers,
    transformers and classes declared by installed plugins (``flowseam_component_classes``) are
    allowed. The message names the module, which was not imported."""


class UnsafeCheckpointError(FlowseamError):
    """A training checkpoint file needs more than tensors and plain values to load (a pickle that
    would run code); flowseam refuses to unpickle it. The message names the file."""


class CheckpointError(FlowseamError):
    """A checkpoint cannot be read as it claims to be: a missing, corrupt or truncated file, or a
    ``config.json`` that disagrees with its weights (missing or unexpected tensors, shape
    mismatches). The message names the files and tensors."""


class PluginFaultError(FlowseamError):
    """A plugin's kernel or component failed at run time: it raised, or returned something the
    op's contract or the component's kind does not allow (a wrong shape, dtype or device,
    non-finite values, a string instead of a module). The message names the plugin, its
    distribution and version, the op or component kind and, for a kernel, its ``impl_id``; the
    original exception is ``__cause__``. flowseam does not retry on another backend by itself:
    the message says how to run without the plugin (``--backend cpu``,
    ``FLOWSEAM_DISABLE_PLUGINS=<plugin>``).

    :ivar plugin, distribution, version: who provided the faulty code.
    :ivar what: the op (``"flow_match_step"``) or component kind (``"dit"``).
    :ivar impl_id: the kernel's implementation id (None for components).
    """

    def __init__(self, message: str, plugin: str = "?", distribution: str = "?",
                 version: str = "?", what: str = "?", impl_id: str | None = None) -> None:
        super().__init__(message)
        self.plugin, self.distribution, self.version = plugin, distribution, version
        self.what, self.impl_id = what, impl_id

    def __reduce__(self):  # keep the attributes across pickling (worker processes)
        return (type(self), (self.args[0], self.plugin, self.distribution, self.version,
                             self.what, self.impl_id))


class PluginLoadError(PluginFaultError):
    """A plugin failed to import, broke a hook's contract (a kernel for an unknown op, a
    declaration of the wrong type), raised in its availability check, or registered an import
    path that does not import, and it is asked for: in strict mode (``FLOWSEAM_STRICT=1``) any
    broken plugin, else the one a command needs. The message names the plugin and carries its
    traceback."""


class KernelFaultError(PluginFaultError):
    """A kernel (``platform.kernels.get(op)`` / ``pin(impl_id)``) raised or returned a result its
    op's contract does not allow."""


class KernelArgumentError(KernelFaultError, ValueError):
    """A kernel raised ``ValueError``: the op contract's way of rejecting its arguments. Still a
    ``ValueError`` (callers that check arguments keep working), and named like every fault."""


class ComponentFaultError(PluginFaultError):
    """A component a plugin built (``dit``, ``vae``, ``text_encoder``, ...) failed to build, or
    raised or returned something wrong while a loop ran it."""


class RewardFaultError(PluginFaultError):
    """A reward failed while a training method scored samples: it raised, returned a result of
    the wrong shape, returned NaN for every sample, or ran past its timeout. ``what`` is
    ``"reward <name>"``; the message says what it returned (or how long it ran). Never turned
    into a silent zero: the run stops."""


class RewardServerError(FlowseamError):
    """A reward server (``reward = "http://HOST:PORT/NAME"``) could not be reached, or kept
    answering with an error, through every retry. The message names the URL, the attempts and the
    last error; a training method adds the last complete checkpoint, from which ``--resume``
    continues without losing a step."""


class InvalidInputError(FlowseamError, ValueError):
    """Input flowseam refuses: a request, option, config value, file or argument that is not
    allowed. The message names the value and what is allowed; it is raised before any model runs
    where the input is known that early. Still a ``ValueError``, as diffusers raises for the same
    kind of input, so callers that catch ``ValueError`` keep working. The CLI prints it as one line
    and exits 2 ("bad input")."""


class InvalidParameterError(InvalidInputError):
    """A request parameter is invalid (not finite, out of range, the wrong type, more memory
    than the machine has). ``field`` names it (``"guidance_scale"``); the message names the
    value and what is allowed. The CLI names the matching option (``--guidance``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return (type(self), (self.field, self.args[0]))


class NotEnoughMemoryError(MemoryError):
    """Memory ran out while loading weights or running a component: the message says how much
    was asked for and which options lower it (``--dtype``, ``--offload``, ``--vae-tiling``,
    ``--vae-slicing``: :mod:`flowseam.memory`). A ``MemoryError``, so
    :func:`flowseam.seam.faults.is_out_of_memory` and the command line treat it as one (exit 1)."""
