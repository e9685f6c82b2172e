"""Training: methods that turn rollouts or data into weight updates, all registered as plugins.

Methods (``finetune``, ``flowgrpo``, ``workflow_rl``, and any third party's) are found through the
``flowseam_training_methods`` hook, rewards through ``flowseam_rewards``. They drive the same loops
that serve (:func:`flowseam.loops.run_loop`): a rollout is serve plus capture.
"""

from __future__ import annotations

from typing import Any

from ..errors import FlowseamError


def _collect(attr: str) -> dict[str, Any]:
    from ..plugins import discover

    found: dict[str, Any] = {}
    for rec in sorted(discover().usable(), key=lambda r: r.name):
        for name, obj in getattr(rec, attr).items():
            found.setdefault(name, obj)
    return found


def registered_methods() -> dict[str, Any]:
    """Every registered training method: name → class (from the discovered plugins)."""
    return _collect("methods")


def get_method(name: str) -> Any:
    """:raises FlowseamError: for an unknown method, listing the registered ones."""
    available = registered_methods()
    if name not in available:
        raise FlowseamError(f"unknown training method {name!r}; registered methods: {sorted(available)}")
    return available[name]


def registered_rewards() -> dict[str, Any]:
    """Every registered reward: name → reward (or factory)."""
    return _collect("rewards")


def get_reward(name: str, **kwargs: Any):
    """Resolve a reward plugin by name; a factory (class) is called with ``kwargs``.

    :raises FlowseamError: for an unknown reward, listing the registered ones.
    """
    available = registered_rewards()
    if name not in available:
        raise FlowseamError(f"unknown reward {name!r}; registered rewards: {sorted(available)}")
    reward = available[name]
    return reward(**kwargs) if isinstance(reward, type) else reward


def train(method: str, config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Run training method ``method`` with ``config``; returns the method's summary."""
    return get_method(method)(config).run(progress=progress)
