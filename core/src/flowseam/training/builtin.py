"""The plugins that register flowseam's own training methods and rewards.

They are found through core's entry points in the ``flowseam.plugins`` group, the same way a
third-party method or reward package is: ``methods = "flowseam.training.builtin"`` (finetune,
flowgrpo and the built-in rewards), and one entry point per larger method
(``workflow_rl = "flowseam.training.builtin:workflow_rl"``, ``joint_multi_rl``, ``unified_rl``),
each of which can be blocked on its own (``FLOWSEAM_DISABLE_PLUGINS=unified_rl``).

Every method is registered by its import path (``"module:Class"``), so discovery, which every
``flowseam.load`` runs, imports none of the training code: a process that only generates does
not pay for it. The class is imported when the method is first asked for
(:func:`flowseam.training.get_method`).
"""

from __future__ import annotations

from ..seam.hookspecs import hookimpl


@hookimpl
def flowseam_training_methods():
    return {"finetune": "flowseam.training.finetune:Finetune",
            "flowgrpo": "flowseam.training.flowgrpo:FlowGRPO"}


@hookimpl
def flowseam_rewards():
    from ..rewards.simple import BUILTIN_REWARDS

    return dict(BUILTIN_REWARDS)


class workflow_rl:  # noqa: N801 - named as its entry point
    """Entry point ``workflow_rl``: :class:`flowseam.training.workflow_rl.WorkflowRL`."""

    @staticmethod
    @hookimpl
    def flowseam_training_methods():
        return {"workflow_rl": "flowseam.training.workflow_rl:WorkflowRL"}


class joint_multi_rl:  # noqa: N801
    """Entry point ``joint_multi_rl``: :class:`flowseam.training.joint_multi_rl.JointMultiRL`."""

    @staticmethod
    @hookimpl
    def flowseam_training_methods():
        return {"joint_multi_rl": "flowseam.training.joint_multi_rl:JointMultiRL"}


class unified_rl:  # noqa: N801
    """Entry point ``unified_rl``: :class:`flowseam.training.unified_rl.UnifiedRL`."""

    @staticmethod
    @hookimpl
    def flowseam_training_methods():
        return {"unified_rl": "flowseam.training.unified_rl:UnifiedRL"}
