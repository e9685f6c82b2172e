"""flowseam's built-in toy rewards: ``constant``, ``brightness``, ``channel_contrast`` and
``audio_rms`` (the contract they follow: :class:`flowseam.seam.RewardFunction`).

A module of their own, with nothing but numpy and torch, because plugin discovery (which every
``flowseam.load`` runs) imports it to register them (:mod:`flowseam.training.builtin`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidInputError


def constant(prompts, outputs) -> torch.Tensor:
    """1.0 for every sample: the control (no signal, so no update)."""
    return torch.ones(len(prompts))


def brightness(prompts, outputs) -> torch.Tensor:
    """Mean pixel intensity over frames, pixels and channels, in [0, 1]."""
    return torch.from_numpy(np.asarray(outputs, dtype=np.float32).reshape(len(prompts), -1).mean(axis=1))


class ChannelContrast:
    """Mean of channel ``channel`` minus the mean of the other two, in [-1, 1] (e.g. 0 = "red")."""

    def __init__(self, channel: int = 0) -> None:
        if channel not in (0, 1, 2):
            raise InvalidInputError(f"channel={channel} must be 0, 1 or 2 (R, G, B)")
        self.channel = channel

    def __call__(self, prompts, outputs) -> torch.Tensor:
        x = np.asarray(outputs, dtype=np.float32)
        others = [c for c in range(3) if c != self.channel]
        score = x[..., self.channel].mean(axis=tuple(range(1, x.ndim - 1))) - \
            x[..., others].mean(axis=tuple(range(1, x.ndim)))
        return torch.from_numpy(score.astype(np.float32))


def audio_rms(prompts, outputs) -> torch.Tensor:
    """Root-mean-square amplitude of the waveform over channels and samples (loudness), in
    [0, 1]."""
    x = np.asarray(outputs, dtype=np.float64).reshape(len(prompts), -1)
    return torch.from_numpy(np.sqrt((x ** 2).mean(axis=1)).astype(np.float32))


audio_rms.modality = "audio"

BUILTIN_REWARDS = {"constant": constant, "brightness": brightness, "channel_contrast": ChannelContrast,
                   "audio_rms": audio_rms}
