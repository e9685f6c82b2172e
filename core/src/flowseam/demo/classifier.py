"""A digit classifier trained only on the held-out split, and the rewards built on it.

The classifier is scikit-learn's ``LogisticRegression`` on 16x16 gray windows centred on the
digit (:func:`features`); it never sees the generators' split.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .data import DIRECTIONS, parse_prompt, splits


FEATURE_PX = 16


@lru_cache(maxsize=1)
def classifier():
    """The fitted classifier: held-out scans only, rendered as the generators render digits
    (16 px on a 32 px canvas) and read through :func:`features`, so that real and generated
    frames are seen the same way. Deterministic."""
    from sklearn.linear_model import LogisticRegression

    from .data import moving_clip

    _, held = splits()
    x = np.stack([features(moving_clip(img, "left", frames=1)[0], FEATURE_PX) for img in held.images])
    clf = LogisticRegression(max_iter=3000, C=0.5)
    clf.fit(x, held.labels)
    return clf


def features(frame: np.ndarray, digit_px: int) -> np.ndarray:
    """A frame ``(H, W, 3)`` in [0, 1] → the classifier's input: a ``digit_px`` square window
    centred on the intensity centroid (zero-padded), area-resized to 16x16 gray, flattened."""
    from PIL import Image

    gray = np.asarray(frame, np.float32).mean(axis=-1)
    cy, cx = (int(round(c)) for c in centroid(frame))
    half = digit_px // 2
    pad = np.pad(gray, half)
    window = pad[cy: cy + digit_px, cx: cx + digit_px]
    im = Image.fromarray((np.clip(window, 0, 1) * 255).astype(np.uint8))
    return (np.asarray(im.resize((FEATURE_PX, FEATURE_PX), Image.BOX), np.float32) / 255.0).reshape(-1)


def digit_probabilities(frames: np.ndarray, digit_px: int) -> np.ndarray:
    """``(N, H, W, 3)`` frames showing a digit about ``digit_px`` tall → ``(N, 10)``
    probabilities."""
    return classifier().predict_proba(np.stack([features(f, digit_px) for f in frames]))


def centroid(frame: np.ndarray) -> np.ndarray:
    """Intensity-weighted (y, x) centroid in pixels (the frame centre if the frame is black)."""
    gray = np.asarray(frame, np.float32).mean(axis=-1)
    total = gray.sum()
    h, w = gray.shape
    if total <= 1e-6:
        return np.array([(h - 1) / 2, (w - 1) / 2])
    ys, xs = np.mgrid[:h, :w]
    return np.array([(gray * ys).sum() / total, (gray * xs).sum() / total])


def displacement(video: np.ndarray, direction: str) -> tuple[float, float]:
    """``(along, across)``: the centroid's move from the first to the last frame, in pixels,
    along the named direction and (absolute) across it."""
    dy, dx = DIRECTIONS[direction]
    d = centroid(video[-1]) - centroid(video[0])
    along = d[0] * dy + d[1] * dx
    across = abs(d[0] * dx) + abs(d[1] * dy)
    return float(along), float(across)


def motion_score(video: np.ndarray, direction: str, target_px: float) -> float:
    """Displacement of the centroid from the first to the last frame along ``direction``,
    divided by ``target_px`` and clipped to [0, 1]."""
    return float(np.clip(displacement(video, direction)[0] / target_px, 0.0, 1.0))


class DigitImageReward:
    """Probability the classifier gives the prompted digit, averaged over frames: ``(B,)``.
    NaN for a prompt that names no digit.

    :param digit_px: how tall the digit is in the frames (16 in the demo's images and videos;
        32 for a digit filling a 32 px image).
    """

    def __init__(self, digit_px: int = 16) -> None:
        self.digit_px = digit_px

    def __call__(self, prompts, outputs) -> torch.Tensor:
        out = []
        for prompt, video in zip(prompts, np.asarray(outputs)):
            digit, _ = parse_prompt(prompt)
            out.append(float("nan") if digit is None
                       else float(digit_probabilities(video, self.digit_px)[:, digit].mean()))
        return torch.tensor(out, dtype=torch.float32)


class DigitVideoReward:
    """The final-video reward: mean probability of the prompted digit over the frames × the motion
    term (centroid displacement in the prompted direction / ``target_px``, clipped to [0, 1]).
    NaN for a prompt that names no digit or no direction."""

    def __init__(self, target_px: float = 8.0, digit_px: int = 16) -> None:
        self.target_px = target_px
        self.image = DigitImageReward(digit_px)

    def __call__(self, prompts, outputs) -> torch.Tensor:
        probs = self.image(prompts, outputs)
        out = []
        for p, prompt, video in zip(probs.tolist(), prompts, np.asarray(outputs)):
            _, direction = parse_prompt(prompt)
            out.append(float("nan") if direction is None else p * motion_score(video, direction, self.target_px))
        return torch.tensor(out, dtype=torch.float32)
