"""Training: methods that turn rollouts or data into weight updates, all registered as plugins.

Every method (``finetune``, ``flowgrpo``, ``workflow_rl``, ``joint_multi_rl``, ``unified_rl``,
and any third party's) is a :class:`flowseam.seam.TrainingMethod` registered through the
``flowseam_training_methods`` hook; rewards come through ``flowseam_rewards``
(:mod:`flowseam.rewards`). The methods drive the same loops that serve
(:func:`flowseam.loops.run_loop`): a rollout is serve plus capture.
"""

from __future__ import annotations

from typing import Any

from ..seam.method_contract import TrainingMethod, TrainingSummary, get_method, registered_methods
from ..seam.reward_contract import get_reward, registered_rewards


def train(method: str, config: dict[str, Any], progress: bool = True) -> TrainingSummary:
    """Run training method ``method`` with ``config``; returns its summary
    (:class:`~flowseam.seam.method_contract.TrainingSummary`)."""
    return get_method(method)(config).run(progress=progress)


__all__ = ["TrainingMethod", "TrainingSummary", "get_method", "get_reward", "registered_methods",
           "registered_rewards", "train"]
