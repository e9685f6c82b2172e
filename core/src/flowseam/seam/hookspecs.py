"""The hooks a flowseam plugin may implement, each a documented contract.

A plugin is a module (or object) exposed under the ``flowseam.plugins`` entry-point group::

    [project.entry-points."flowseam.plugins"]
    mybackend = "flowseam_mybackend.plugin"

whose functions are marked with :data:`flowseam.seam.hookimpl`. Every hook is optional. Hooks are
called once per plugin, one plugin at a time (the loader needs to know which plugin answered),
while plugins are discovered and while a :class:`~flowseam.Platform` is built, never during
denoising (``flowseam_conformance_expectations`` only by the conformance suite); ``firstresult``
is stated for code that calls ``pm.hook.<name>(...)`` directly. An implementation whose name is
not listed here, or that takes an argument its spec lacks, marks the plugin ``broken`` (an error
in strict mode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .components import ComponentSpec
    from .declarations import Availability, BackendInfo, ConformanceExpectations, KernelRegistration

PROJECT = "flowseam"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def flowseam_backend() -> BackendInfo | None:
    """Declare that this plugin is a backend, and for which device.

    firstresult: yes (one declaration per plugin).

    Called once when the plugin is discovered. Plugins that only add training methods or
    rewards do not implement it.

    :returns: a :class:`flowseam.seam.BackendInfo` (``device``, ``priority``, ``description``), or
        None. The backend's name is the plugin's entry-point name. ``Platform.detect()`` picks
        the available backend with the highest ``priority`` (ties broken by name); the cpu
        backend declares priority 0.
    """


@hookspec(firstresult=True)
def flowseam_backend_available() -> Availability | None:
    """Say whether this backend can run in this process, and why not if it cannot.

    firstresult: yes.

    Called once at discovery, only on plugins that declared a backend. It must not fail on a
    machine without the hardware: return ``Availability(False, "no CUDA device visible")``
    instead. An exception raised here marks the plugin ``broken`` (with its traceback).

    :returns: a :class:`flowseam.seam.Availability`; None means available.
    """


@hookspec(firstresult=True)
def flowseam_arch_chain() -> Sequence[str] | None:
    """Detect the arch rungs of this backend's device, most specific first.

    firstresult: yes.

    Called once at discovery, right after the availability check (only if the backend is
    available); an exception or a result that is not a list of names marks the plugin broken.
    Example: ``["sm90", "sm80", "generic"]`` on an H100. ``"generic"`` is appended when
    missing, so every chain ends in it.

    :returns: a sequence of arch names, or None for ``["generic"]``.
    """


@hookspec
def flowseam_register_kernels() -> Iterable[KernelRegistration] | None:
    """Register kernel implementations for ops in :mod:`flowseam.ops`.

    firstresult: no — every plugin's registrations are collected.

    Called once at discovery. Each registration names an op, the arch rung it is written for and
    the callable, which must follow the op's contract (:mod:`flowseam.ops.reference`: the
    docstring of the op's oracle). The kernels run on the backend's declared device. One plugin may register an (op, arch) pair once; two plugins
    of the same device registering the same (op, arch) are a conflict, won by the higher
    ``priority`` and then the smaller plugin name, and reported in ``platform.conflicts``.

    :returns: an iterable of :class:`flowseam.seam.KernelRegistration`, or None.
    """


@hookspec
def flowseam_component_kinds() -> Iterable[str] | None:
    """Declare the component kinds (``"dit"``, ``"vae"``, ``"text_encoder"``, ...) this backend
    can build on its device; ``"*"`` means every kind (the cpu backend declares it).

    firstresult: no — every plugin's kinds are collected.

    Called once at discovery. A kind that no plugin of a device declares falls back to the next
    device of the chain (ultimately ``cpu``), and the platform records that fallback.

    :returns: an iterable of kind names, or None.
    """


@hookspec
def flowseam_component_dtypes() -> Mapping[str, Iterable[str]] | None:
    """Declare the dtypes this backend builds each component kind in when a user asks for one
    (``flowseam.load(dtype=...)``, ``--dtype``): component kind (or ``"*"``: every kind it
    builds) → dtype names (``"float32"``, ``"bfloat16"``, ``"float16"``).

    firstresult: no — every plugin's declarations are collected (each plugin's own).

    Called once at discovery. The builder then gets the asked dtype as ``ComponentSpec.dtype``
    and loads the weights in it. A request for a dtype the plugin that builds the kind does not
    declare — or any dtype, from a plugin that implements no such hook — is refused before any
    weights load, naming the plugin and what it builds; without a request ``spec.dtype`` is
    None and the plugin builds in its own default.

    Example::

        @hookimpl
        def flowseam_component_dtypes():
            return {"dit": ["bfloat16", "float16"], "vae": ["float32"]}

    :returns: a mapping of kind → dtype names, or None.
    """


@hookspec
def flowseam_component_classes() -> Iterable[str] | None:
    """Declare the model component classes this plugin ships, so that checkpoints may name them.

    firstresult: no — every plugin's classes are collected.

    Called once at discovery. A checkpoint's ``model_index.json`` names each component's class as
    ``[library, class]`` (``["diffusers", "AutoencoderKLWan"]``); flowseam imports a component
    class only if ``library`` is ``diffusers`` or ``transformers`` (or one of their submodules),
    or if ``"<library>.<class>"`` is one of the dotted paths an installed, usable plugin declares
    here. Anything else is refused, naming the module, before it is imported: a checkpoint folder
    never decides which code runs (``model_index.json`` naming ``["evilmod", "AutoencoderKL"]``
    with an ``evilmod.py`` beside it is an error, not an import). flowseam never passes
    ``trust_remote_code`` to transformers.

    Example::

        @hookimpl
        def flowseam_component_classes():
            return ["flowseam_myvendor.models.MyVendorDiT"]

    :returns: an iterable of dotted class paths (``"package.module.Class"``), or None.
    """


@hookspec(firstresult=True)
def flowseam_build_component(kind: str, spec: ComponentSpec, device: str) -> torch.nn.Module | None:
    """Build one model component of ``kind`` on ``device``, or return None to decline.

    firstresult: yes — the first non-None result wins.

    Called by ``platform.build_component`` while a model is loaded, once per (component,
    device) along the device chain, only on plugins that declared ``kind`` in
    :func:`flowseam_component_kinds` for ``device``; never during denoising. The first
    non-None result wins; declining moves on to the next plugin, then the next device.

    :param kind: ``"dit"``, ``"vae"``, ``"text_encoder"``, ...
    :param spec: where the weights are, which class loads them, and the dtype the card asks
        for (``spec.dtype``: build in it or decline; None leaves the dtype to the backend).
    :param device: the flowseam device this backend is asked to serve (its declared device).
    :returns: a ``torch.nn.Module`` (or a tokenizer/processor object for non-module kinds), or
        None. An exception propagates to the caller: a component that should build and does
        not is an error, not a fallback.
    """


@hookspec
def flowseam_training_methods() -> Mapping[str, Any] | None:
    """Register training methods by name (``"finetune"``, ``"flowgrpo"``, ...).

    firstresult: no — every plugin's methods are collected.

    Called once at discovery. Values are subclasses of :class:`flowseam.seam.TrainingMethod`
    (the contract ``flowseam train`` runs a method by; anything else is the plugin's fault when
    the method is asked for), or their import paths (``"package.module:Class"``, an entry
    point's form), imported as discovery imports a plugin when the method is first asked for
    (:func:`flowseam.seam.get_method`): discovery runs in every process that loads a model, and a
    path keeps the training code out of the ones that only generate. A name is letters, digits,
    ``_``, ``-`` and ``.``. Two plugins registering one name are a conflict, reported like
    kernel conflicts.

    :returns: a mapping name → class or import path, or None.
    """


@hookspec
def flowseam_rewards() -> Mapping[str, Any] | None:
    """Register reward functions by name.

    firstresult: no — every plugin's rewards are collected.

    Called once at discovery. A reward follows :class:`flowseam.seam.RewardFunction`
    (``reward(prompts, outputs) -> Tensor (B,)``), or is a factory (a class) returning one,
    called with the config's ``reward_args``. Names as for :func:`flowseam_training_methods`.

    :returns: a mapping name → reward, or None.
    """


@hookspec(firstresult=True)
def flowseam_conformance_expectations() -> ConformanceExpectations | None:
    """Tell flowseam's conformance suite what this backend promises beyond its declarations.

    firstresult: yes (one answer per backend).

    Called only by the conformance suite (``pytest --pyargs flowseam.testing.conformance
    --flowseam-backend NAME``), once per run, on the backend under test; never by discovery, a
    Platform, serving or training, so a mistake here fails the suite and nothing else. Backends
    that do not implement it get the defaults described in
    :class:`flowseam.ConformanceExpectations` (derived from ``flowseam_component_kinds``).

    Example (a backend whose ``dit`` and ``vae`` are always its own, ``text_encoder`` never)::

        @hookimpl
        def flowseam_conformance_expectations():
            return ConformanceExpectations(
                overrides=["dit", "vae"], falls_back=["text_encoder"],
                xfail_file=importlib.resources.files(__package__) / "conformance-xfail.txt",
                torch_device=str(torch_device()))

    :returns: a :class:`flowseam.ConformanceExpectations`, or None for the defaults.
    """
