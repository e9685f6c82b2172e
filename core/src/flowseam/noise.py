"""Noise drawn per sample: the one helper that models (initial latents) and loops (SDE noise)
share. It sits below both so neither imports the other for it."""

from __future__ import annotations

import torch

from .errors import InvalidInputError


def draw_noise(shape: tuple[int, ...], generators: list[torch.Generator],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal noise ``shape = (B, ...)``, row ``b`` drawn from ``generators[b]`` (as
    diffusers' ``randn_tensor`` does with a list of generators), on the CPU.

    :raises ValueError: if the number of generators is not B.
    """
    if len(generators) != shape[0]:
        raise InvalidInputError(f"{len(generators)} generators for a batch of {shape[0]}")
    rows = [torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generators]
    return torch.cat(rows, dim=0)


def noise_like(latents: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Per-sample float32 noise of ``latents``' shape on its device: row b from
    ``generators[b]``, so every group member has its own (SDE steps, re-noising)."""
    return draw_noise(tuple(latents.shape), generators, torch.float32).to(latents.device)
