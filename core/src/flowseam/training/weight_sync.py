"""WeightSyncPlan: a versioned hand-off of trained weights from the trainer to the instance that
rolls out.

The trainer owns its own copy of a component (the student it optimises); the rollout instance
serves another copy. ``sync()`` copies the student's weights into the instance according to the
plan's role and bumps both the plan's version and the instance's weights version for that
component, so every cache keyed on those weights (text embeddings of a trained text encoder, for
instance) misses from then on: invalidation by version, not by hope.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..models.base import ModelInstance


class WeightRole(str, enum.Enum):
    """What the synced weights are to the receiving instance.

    STUDENT: the trained weights themselves (on-policy rollouts).
    EMA: an exponential moving average of the student (``decay`` per sync).
    REFERENCE: a frozen copy (e.g. the KL reference), synced once.
    """

    STUDENT = "student"
    EMA = "ema"
    REFERENCE = "reference"


@dataclass
class WeightSyncPlan:
    """Hand the trainer's ``source`` module to ``target.components[component]``.

    :param source: the trainer's module (same architecture as the target component).
    :param target: the model instance that rolls out.
    :param component: the component name in the instance (``"transformer"``).
    :param role: see :class:`WeightRole`.
    :param decay: EMA decay (EMA role only).
    :ivar version: how many times this plan has synced.
    """

    source: torch.nn.Module
    target: ModelInstance
    component: str
    role: WeightRole = WeightRole.STUDENT
    decay: float = 0.99
    version: int = 0

    def __post_init__(self) -> None:
        if self.component not in self.target.components:
            raise ValueError(f"component {self.component!r} is not in {self.target.card.name}; it has "
                             f"{sorted(self.target.components)}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay={self.decay} must be in [0, 1)")

    @torch.no_grad()
    def sync(self) -> int:
        """Copy (or average) the weights into the target; returns the new version.

        :raises RuntimeError: for a REFERENCE plan synced a second time (references are frozen).
        """
        if self.role is WeightRole.REFERENCE and self.version > 0:
            raise RuntimeError("a REFERENCE weight plan is synced once; it is frozen afterwards")
        dst = self.target.components[self.component]
        src_params = dict(self.source.named_parameters())
        for name, param in dst.named_parameters():
            s = src_params[name].detach().to(param.device, param.dtype)
            if self.role is WeightRole.EMA and self.version > 0:
                param.mul_(self.decay).add_(s, alpha=1.0 - self.decay)
            else:
                param.copy_(s)
        src_buffers = dict(self.source.named_buffers())
        for name, buf in dst.named_buffers():
            if name in src_buffers:
                buf.copy_(src_buffers[name].to(buf.device, buf.dtype))
        self.version += 1
        self.target.bump_version(self.component)
        return self.version
