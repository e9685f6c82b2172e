"""The contract of a reward, and how a registered one is found and made.

A reward is registered through the ``flowseam_rewards`` hook as a callable following
:class:`RewardFunction`, or as a factory (a class) called with the config's ``reward_args``; a
factory checks its arguments in ``__init__`` (paths, files) before it loads anything heavy. How a
training config's ``reward`` spec (a name, a weighted sum, a reward server's URL) becomes one
checked reward is :func:`flowseam.rewards.spec.build_reward`.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Protocol

from ..errors import InvalidInputError
from .discovery import PluginRecord, claims, registered, resolve


class RewardFunction(Protocol):
    """``reward(prompts, outputs) -> scores``.

    :param prompts: the B prompts.
    :param outputs: ``(B, F, H, W, 3)`` float32 frames in [0, 1] (``F = 1`` for images); for a
        reward whose ``modality`` attribute is ``"audio"``, the waveform ``(B, channels,
        samples)`` in [-1, 1] of a model that makes sound.
    :returns: one float score per sample, ``(B,)`` (a tensor, a numpy array or a list of numbers;
        ``(B, 1)`` is taken as ``(B,)``). NaN means "cannot score this sample": the method skips
        that sample's group. Raising, another shape or a non-number is a fault of the reward.

    A reward that scores sound declares ``modality = "audio"`` (an attribute of the function or
    the class); one that declares nothing scores video (:func:`modality`).
    """

    def __call__(self, prompts: list[str], outputs: Any) -> Any: ...


#: what a reward may score (:func:`modality`)
MODALITIES = ("video", "audio")


def modality(reward: Any) -> str:
    """What ``reward`` scores: its declared ``modality``, ``"video"`` when it declares none.

    :raises ValueError: for a declared modality that is not one of :data:`MODALITIES`.
    """
    declared = getattr(reward, "modality", "video")  # optional in the contract
    if declared not in MODALITIES:
        raise ValueError(f"reward {reward!r:.60} declares modality={declared!r}; a reward scores "
                         f"one of {MODALITIES}")
    return declared


def make_reward(key: str, obj: Any, args: Mapping[str, Any]) -> Any:
    """The reward registered as ``obj`` under ``key``: a factory (class) called with ``args``, a
    callable as it is.

    :raises InvalidInputError: for arguments the factory does not take, arguments for a reward
        that is not a factory, or what the factory's ``__init__`` refuses.
    """
    args = dict(args)
    if not isinstance(obj, type):
        if args:
            raise InvalidInputError(
                f"reward {key!r} is a function and takes no reward_args; got {sorted(args)}")
        return obj
    try:
        inspect.signature(obj).bind(**args)
    except TypeError as exc:
        try:
            takes = [p for p in inspect.signature(obj).parameters]
        except (TypeError, ValueError):  # pragma: no cover - a C extension type
            takes = []
        raise InvalidInputError(f"reward_args {args} do not fit reward {key!r} "
                                f"({obj.__module__}.{obj.__qualname__}): {exc}; it "
                                f"takes {takes}") from None
    except ValueError:  # no signature to read: let the call decide
        pass
    return obj(**args)


def registered_rewards() -> dict[str, Any]:
    """Every registered reward: name → reward (or factory); a name two plugins register appears
    only qualified, as ``"<plugin>:<name>"``."""
    return {name: obj for name, (_, obj) in registered("rewards").items()}


def resolve_reward(name: str) -> tuple[PluginRecord, Any]:
    """``(plugin record, registered reward or factory)`` of ``name`` (or ``"plugin:name"``).

    :raises InvalidInputError: for an unknown reward (listing the registered ones), or one that
        several plugins register (naming them).
    """
    return resolve("rewards", "reward", name)


def get_reward(name: str, **kwargs: Any) -> Any:
    """The reward ``name`` (or ``"<plugin>:<name>"``); a factory is called with ``kwargs``. This
    is the registered object itself; a training method builds its reward from the config with
    :func:`flowseam.rewards.spec.build_reward` (weighted sums, reward servers, a timeout and
    checked calls).

    :raises InvalidInputError: for an unknown reward, one that several plugins register, ``kwargs``
        the factory does not take (or any for a reward that is not a factory), or what the
        factory's ``__init__`` refuses.
    """
    return make_reward(name, resolve_reward(name)[1], kwargs)


def reward_owner(obj: Any) -> tuple[PluginRecord, str] | None:
    """``(plugin record, registered name)`` of the plugin that registered ``obj`` (or its class),
    or None."""
    for name, found in claims("rewards").items():
        for rec, reg in found:
            if obj is reg or (isinstance(reg, type) and type(obj) is reg):
                return rec, name
    return None
