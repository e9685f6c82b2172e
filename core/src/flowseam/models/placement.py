"""Where a loaded model's components run, and when they move: ``flowseam.load``'s memory options
(:class:`~flowseam.memory.MemoryOptions`) applied to the built components.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Mapping

import torch

from ..memory import Components, MemoryOptions, advice, offload_model

#: the order a request runs the component kinds in (``offload="model"`` chains its hooks in it)
RUN_ORDER = ("text_encoder", "image_encoder", "text_connectors", "dit", "latent_upsampler", "vae",
             "audio_vae", "vocoder")


class Placement:
    """The memory placement of one model's components.

    :param components: the model's components (released ones are built again on access).
    :param specs: name → ``(kind, ComponentSpec)`` of every built component.
    :param options: the memory options.
    :param build: ``build(kind, spec)`` builds a component again (``platform.build_component``).
    """

    def __init__(self, components: Components, specs: Mapping[str, tuple[str, Any]],
                 options: MemoryOptions, build: Callable[[str, Any], Any]) -> None:
        self.components, self.specs, self.options = components, dict(specs), options
        self._build = build
        self._execution_device: torch.device | None = None

    def apply(self, dit: torch.nn.Module | None) -> None:
        """VAE tiling and slicing, and for ``offload="model"`` the offload hooks, chained in
        :data:`RUN_ORDER` onto ``dit``'s device (the accelerator). ``offload="text_encoder"``
        acts after each encoding (:meth:`release_encoders`)."""
        if self.options.vae_tiling:
            self.components["vae"].enable_tiling(**self.options.tiling_args)
        if self.options.vae_slicing:
            self.components["vae"].enable_slicing()
        if self.options.offload == "model":
            device = next(dit.parameters()).device if dit is not None else None
            order = [name for kind in RUN_ORDER for name, (k, _) in self.specs.items()
                     if k == kind and isinstance(self.components[name], torch.nn.Module)]
            offload_model([self.components[n] for n in order], device)
            self._execution_device = device

    def device(self, name: str) -> torch.device:
        """Where component ``name`` runs: its parameters' device, or with ``offload="model"``
        the accelerator every component is moved to for its forward."""
        if self._execution_device is not None:
            return self._execution_device
        try:
            return next(self.components[name].parameters()).device
        except (StopIteration, AttributeError):
            return torch.device("cpu")

    def advice(self, kinds: tuple[str, ...]) -> str:
        """What lowers the memory a component of ``kinds`` needs (:func:`flowseam.memory.advice`;
        the loops name it when a component runs out of memory)."""
        dtypes = {kind: spec.dtype for kind, spec in self.specs.values() if spec.dtype}
        return advice(kinds, self.options, dtypes)

    def release_encoders(self) -> None:
        """With ``offload="text_encoder"``, free the text encoders once a request's prompts are
        encoded (the loops call it after encoding); a prompt the cache misses later builds them
        again, as :func:`flowseam.load` did."""
        if self.options.offload != "text_encoder":
            return
        for name, (kind, spec) in self.specs.items():
            if kind == "text_encoder" and not self.components.is_released(name):
                self.components.release(name, lambda kind=kind, spec=spec: self._build(kind, spec))
        gc.collect()
