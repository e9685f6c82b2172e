"""Built-in rewards (registered by the ``flowseam-methods`` plugin, like any third party's).

A reward is ``reward(prompts: list[str], outputs: np.ndarray (B, F, H, W, 3) in [0, 1]) ->
torch.Tensor (B,)`` float32. A reward whose ``modality`` attribute is ``"audio"`` scores sound
instead: ``outputs`` is then the waveform ``(B, channels, samples)`` in [-1, 1] of a model that
makes it (LTX-2). A reward may return NaN for a sample it cannot score; the method skips that
sample's group.
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


def reward_input(reward, result) -> np.ndarray:
    """What ``reward`` scores in a :class:`~flowseam.loops.LoopResult`: its frames, or its
    waveform for a reward whose ``modality`` is ``"audio"``.

    :raises ValueError: for an audio reward on a result without sound.
    """
    if getattr(reward, "modality", "video") == "audio":
        if result.audio is None:
            raise InvalidInputError(
                f"reward {getattr(reward, '__name__', reward)!r} scores audio, and "
                "this model makes none (use a video reward, or an LTX-2 checkpoint)")
        return result.audio
    return result.frames


def score(reward, prompts: list[str], outputs: np.ndarray) -> torch.Tensor:
    """Call ``reward`` and check its result: ``(B,)`` float.

    :raises ValueError: naming the shape it returned.
    """
    r = reward(prompts, outputs)
    r = torch.as_tensor(r, dtype=torch.float32).flatten()
    if r.shape != (len(prompts),):
        raise InvalidInputError(
            f"reward returned shape {tuple(r.shape)} for {len(prompts)} samples; expected "
            f"({len(prompts)},)")
    return r
