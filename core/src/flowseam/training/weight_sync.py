"""WeightSyncPlan: a versioned hand-off of trained weights from the trainer to the instances that
roll out.

The trainer owns its own copy of a component (the student it optimises); the rollout instance
serves another copy. ``sync()`` copies the student's weights into the instance according to the
plan's role and bumps both the plan's version and the instance's weights version for that
component, so every cache keyed on those weights (text embeddings of a trained text encoder, for
instance) misses from then on: invalidation by version, not by hope.

The same plan is the contract of every transport that carries the weights further (a Ray rollout
fleet, :mod:`flowseam.training.fleet`): after each sync it hands each of its ``receivers`` a
:class:`WeightUpdate` — the in-process instance's weights after the sync (so an EMA is averaged
once, on the trainer, and a worker that joins late receives the same weights), serialized with
safetensors, under the plan's version and with the sha256 of those bytes. A receiver checks the
checksum before it applies an update and rolls out only under the version it was asked for.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FlowseamError, InvalidInputError
from ..models.instance import ModelInstance
from .distributed import full_state, whole


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
    :ivar receivers: further transports; each gets :meth:`update` after every sync.
    """

    source: torch.nn.Module
    target: ModelInstance
    component: str
    role: WeightRole = WeightRole.STUDENT
    decay: float = 0.99
    version: int = 0
    #: transports that carry each new version further (anything with ``push(WeightUpdate)``)
    receivers: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.component not in self.target.components:
            raise InvalidInputError(
                f"component {self.component!r} is not in {self.target.card.name}; it has "
                f"{sorted(self.target.components)}")
        if not 0.0 <= self.decay < 1.0:
            raise InvalidInputError(f"decay={self.decay} must be in [0, 1)")

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
            if src_params[name] is param:  # shared (a LoRA run's frozen base): nothing to copy
                continue
            s = whole(src_params[name].detach()).to(param.device, param.dtype)
            if self.role is WeightRole.EMA and self.version > 0:
                param.mul_(self.decay).add_(s, alpha=1.0 - self.decay)
            else:
                param.copy_(s)
        src_buffers = dict(self.source.named_buffers())
        for name, buf in dst.named_buffers():
            if name in src_buffers and src_buffers[name] is not buf:
                buf.copy_(src_buffers[name].to(buf.device, buf.dtype))
        self.version += 1
        self.target.bump_version(self.component)
        if self.receivers:
            update = self.update()
            for receiver in self.receivers:
                receiver.push(update)
        return self.version

    def update(self) -> "WeightUpdate":
        """The target component's weights as they are now, under the current :attr:`version`."""
        return WeightUpdate.of(self.target.components[self.component], self.component,
                               self.role, self.version)


class WeightChecksumError(FlowseamError):
    """A weight update's bytes do not match its checksum (corrupted or truncated in transit)."""


@dataclass(frozen=True)
class WeightUpdate:
    """One version of a component's weights, as it travels to a rollout worker.

    :ivar component: the component name in the receiving instance (``"transformer"``).
    :ivar role: the plan's :class:`WeightRole` (the weights are already what the receiver holds:
        an EMA was averaged on the trainer).
    :ivar version: the plan's version after the sync that produced it.
    :ivar checksum: sha256 hex digest of ``data``.
    :ivar data: the component's ``state_dict()`` serialized with ``safetensors.torch.save``
        (no pickle: a receiver never runs code from what it receives).
    """

    component: str
    role: WeightRole
    version: int
    checksum: str
    data: bytes

    @classmethod
    def of(cls, module: torch.nn.Module, component: str, role: WeightRole, version: int) -> "WeightUpdate":
        from safetensors.torch import save

        keys = module.state_dict().keys()  # parameters and persistent buffers
        data = save({k: v.contiguous() for k, v in full_state(module).items() if k in keys})
        return cls(component, WeightRole(role), version, hashlib.sha256(data).hexdigest(), data)

    def verify(self) -> None:
        """:raises WeightChecksumError: naming the version, if ``data`` does not hash to
        ``checksum``."""
        got = hashlib.sha256(self.data).hexdigest()
        if got != self.checksum:
            raise WeightChecksumError(f"weight update v{self.version} of {self.component!r}: sha256 "
                                      f"{got[:16]}… != declared {self.checksum[:16]}…; not applied")

    @torch.no_grad()
    def apply(self, instance: ModelInstance) -> None:
        """Verify, then copy the weights into ``instance.components[component]`` and bump the
        instance's weights version (its caches keyed on those weights miss from now on).

        :raises WeightChecksumError: for corrupted bytes (nothing is changed).
        :raises ValueError: if the tensors' names or shapes differ from the component's.
        """
        from safetensors.torch import load

        self.verify()
        tensors = load(self.data)
        module = instance.components[self.component]
        own = module.state_dict()
        if set(tensors) != set(own):
            extra, missing = sorted(set(tensors) - set(own)), sorted(set(own) - set(tensors))
            raise InvalidInputError(
                f"weight update v{self.version} of {self.component!r} does not fit "
                f"{instance.card.name}: unexpected {extra[:3]}, missing {missing[:3]}")
        for name, value in tensors.items():
            if own[name].shape != value.shape:
                raise InvalidInputError(
                    f"weight update v{self.version}: {name} has shape "
                    f"{tuple(value.shape)}, the component {tuple(own[name].shape)}")
        for name, value in tensors.items():
            own[name].copy_(value)
        instance.bump_version(self.component)

