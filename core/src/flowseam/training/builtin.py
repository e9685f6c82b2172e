"""The plugin that registers flowseam's own training methods and rewards.

It is found through core's entry point ``methods = "flowseam.training.builtin"`` in the
``flowseam.plugins`` group — the same way a third-party method or reward package is.
"""

from __future__ import annotations

from ..hookspecs import hookimpl


@hookimpl
def flowseam_training_methods():
    from .finetune import Finetune
    from .flowgrpo import FlowGRPO

    return {"finetune": Finetune, "flowgrpo": FlowGRPO}


@hookimpl
def flowseam_rewards():
    from .rewards import BUILTIN_REWARDS

    return dict(BUILTIN_REWARDS)
