"""flowseam's real rewards, registered like any third party's (core's entry point ``rewards``).

Importing this module imports no reward model: each value is a factory (class) that loads its
model when a training method (or ``flowseam reward-serve``) builds the reward, so discovery stays
fast and works without the optional extras installed.
"""

from __future__ import annotations

from ..seam.hookspecs import hookimpl


@hookimpl
def flowseam_rewards():
    """``ocr`` (:class:`flowseam.rewards.ocr.OcrReward`), ``clip_score``, ``pickscore`` and
    ``aesthetic`` (:mod:`flowseam.rewards.clip`)."""
    from .clip import AestheticScore, ClipScore, PickScore
    from .ocr import OcrReward

    return {"ocr": OcrReward, "clip_score": ClipScore, "pickscore": PickScore,
            "aesthetic": AestheticScore}
