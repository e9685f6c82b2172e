"""The demo's reward plugin: the digit rewards, registered like any third party's.

Found through core's entry point ``demo = "flowseam.demo.plugin"`` in the ``flowseam.plugins``
group. Importing this module is cheap (scikit-learn and the classifier load on the first reward
call), so discovery stays fast and works without the ``demo`` extra installed.
"""

from __future__ import annotations

from ..seam.hookspecs import hookimpl


@hookimpl
def flowseam_rewards():
    """``digit_image`` (probability of the prompted digit) and ``digit_video`` (that probability
    over the frames × motion in the prompted direction); both are factories (classes)."""
    from .classifier import DigitImageReward, DigitVideoReward

    return {"digit_image": DigitImageReward, "digit_video": DigitVideoReward}
