"""Which DiT expert denoises a step, and with which guidance scale.

A model has one DiT (Wan2.1, FLUX.1) or two experts that split the steps by timestep, as
diffusers' ``WanPipeline`` does for Wan2.2 A14B: ``transformer`` denoises the steps whose timestep
is ``>= boundary_ratio * num_train_timesteps`` with ``guidance_scale``, ``transformer_2`` the
others with ``guidance_scale_2`` (default ``guidance_scale``). Every ``BehaviorRecord`` names the
expert of its step, so a trainer credits each expert for its own steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from ..errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from ..request import DiffusionParams


class Experts(Mapping[str, torch.nn.Module]):
    """A model's DiT experts: a live mapping, component name → module, high-noise first (the
    card's expert names the checkpoint has), read from ``components`` on every access (so a
    component replaced in the model is the expert from then on).

    :param names: the card's expert component names, high-noise first.
    :param components: the model's components (name → module).
    :param boundary_timestep: ``boundary_ratio * num_train_timesteps`` for two experts, else None.
    :param model: the model's name, in error messages.
    """

    def __init__(self, names: tuple[str, ...], components: Mapping[str, Any],
                 boundary_timestep: float | None, model: str) -> None:
        self.names = names
        self.boundary_timestep = boundary_timestep if len(names) > 1 else None
        self._components = components
        self._model = model

    def __getitem__(self, name: str) -> torch.nn.Module:
        if name not in self.names or name not in self._components:
            raise KeyError(name)
        return self._components[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.names if name in self._components)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"Experts({list(self)}, boundary_timestep={self.boundary_timestep})"

    def at(self, timestep: torch.Tensor | float) -> str:
        """The expert that denoises at ``timestep`` (a scalar, or the first element of a ``(B,)``
        tensor), compared as diffusers compares it: ``t >= boundary_timestep``."""
        if self.boundary_timestep is None:
            return self.names[0]
        t = timestep.reshape(-1)[0] if torch.is_tensor(timestep) else torch.tensor(float(timestep))
        return self.names[0] if bool(t >= self.boundary_timestep) else self.names[1]

    def guidance(self, expert: str, params: "DiffusionParams") -> float:
        """``expert``'s guidance scale: ``guidance_scale`` for the first (high-noise) expert,
        ``guidance_scale_2`` (default ``guidance_scale``) for the second."""
        if expert == self.names[0] or params.guidance_scale_2 is None:
            return params.guidance_scale
        return params.guidance_scale_2

    def check(self, params: "DiffusionParams") -> None:
        """``guidance_scale_2`` only for two experts (diffusers refuses likewise; its range is
        :class:`~flowseam.DiffusionParams`' to check).

        :raises InvalidInputError: naming the value.
        """
        if params.guidance_scale_2 is not None and self.boundary_timestep is None:
            raise InvalidInputError(
                f"guidance_scale_2={params.guidance_scale_2!r} is for two-expert "
                f"(Wan2.2) models; {self._model} has one DiT")

    def pick(self, timestep: torch.Tensor, expert: str | None,
             dit: torch.nn.Module | None) -> tuple[str, torch.nn.Module]:
        """``(name, module)`` of the expert a velocity runs: ``expert`` (default the one that
        owns ``timestep``), its module or ``dit`` (a trainer's copy of it) when given.

        :raises InvalidInputError: for an expert name the model does not have.
        """
        name = self.at(timestep) if expert is None else expert
        if name not in self:
            raise InvalidInputError(f"expert={name!r}: {self._model} has experts {list(self)}")
        return name, self[name] if dit is None else dit
