"""Rewards as a training method uses them: built from a config's spec, called with a deadline, and
checked.

A reward follows the contract of :class:`flowseam.seam.RewardFunction`. :func:`build_reward`
turns a config's ``reward`` (a registered name, a reward server's URL or a table of weights),
``reward_args`` and ``reward_timeout`` into a :class:`Reward`, refusing a bad spec before any
model loads (:class:`~flowseam.errors.InvalidInputError`). :meth:`Reward.score` calls each
component on a worker thread with that deadline and checks what it returns: a reward that
raises, returns something that is not one number per sample, runs past its timeout or can score
none of a step's samples (:func:`check_scores`) stops the run with a
:class:`~flowseam.errors.RewardFaultError` naming the reward and the plugin that registered it —
never a silent zero. The user's side: docs/rewards.md ("Weighted sums, timeouts and errors").
"""

from __future__ import annotations

import inspect
import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..errors import (
    FlowseamError, InvalidInputError, PluginFaultError, RewardFaultError, RewardServerError,
)
from ..seam.faults import describe, is_out_of_memory
from ..seam.reward_contract import make_reward, modality, resolve_reward, reward_owner

#: Seconds one reward call may take by default (``reward_timeout`` in a config).
DEFAULT_REWARD_TIMEOUT = 600.0


# -- built rewards ----------------------------------------------------------------------------

def _label(text: str) -> str:
    """``text`` as a metric-key segment: each run of anything but letters, digits and ``_``
    becomes one ``_``."""
    return re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_") or "reward"


#: component labels that would collide with the methods' own reward metrics
_RESERVED_LABELS = ("mean", "std", "refined", "unrefined")


@dataclass
class RewardComponent:
    """One reward of a :class:`Reward`: what its config calls it, the callable that scores, its
    weight in the sum, and who provided it (for fault messages).

    :ivar key: as the config names it (``"ocr"``, ``"plugin:ocr"``, ``"http://h:8000/ocr"``).
    :ivar label: its segment in metric keys (``reward_<label>_mean``): the name (after a
        ``plugin:`` prefix) or a URL's last path segment, letters, digits and ``_`` only; the
        whole key sanitised when two components would share a label.
    :ivar plugin, distribution, version: the plugin that registered it (``"?"`` for a callable
        handed in by the caller); ``remote``, flowseam's, for a reward server.
    """

    key: str
    fn: Callable
    weight: float = 1.0
    plugin: str = "?"
    distribution: str = "?"
    version: str = "?"
    label: str = ""

    @property
    def modality(self) -> str:
        """What it scores (:func:`flowseam.seam.reward_contract.modality`).

        :raises RewardFaultError: for a modality the contract does not have.
        """
        try:
            return modality(self.fn)
        except ValueError as exc:
            raise self.fault(f"breaks the reward contract: {exc}") from None

    def who(self) -> str:
        if self.plugin == "remote":
            return "served by a reward server (flowseam.rewards.remote.RemoteReward)"
        if self.plugin == "?":
            module = getattr(self.fn, "__module__", None) or type(self.fn).__module__
            return f"(not registered by a plugin: a callable from {module} handed to the method)"
        return f"of plugin {self.plugin!r} ({self.distribution} {self.version})"

    def fault(self, problem: str) -> RewardFaultError:
        """The :class:`RewardFaultError` for this reward having ``problem``."""
        avoid = (f"; to run without it: another reward in the config, or "
                 f"FLOWSEAM_DISABLE_PLUGINS={self.plugin}" if self.plugin not in ("?", "remote")
                 else "")
        return RewardFaultError(f"reward {self.key!r} {self.who()} {problem}{avoid}",
                                self.plugin, self.distribution, self.version, f"reward {self.key}")


@dataclass
class RewardScores:
    """What a reward gave for a batch (or a whole step).

    :ivar total: ``(B,)`` float32, what the method trains on (the weighted sum).
    :ivar parts: label → ``(B,)`` float32, each component's own scores; empty for a single
        reward (its scores are ``total``).
    """

    total: torch.Tensor
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "RewardScores":
        """``fn`` applied to the total and to every part (a view, a gather over ranks)."""
        return RewardScores(fn(self.total), {k: fn(v) for k, v in self.parts.items()})

    @staticmethod
    def cat(scores: Sequence["RewardScores"]) -> "RewardScores":
        """The batches ``scores`` as one, in order."""
        return RewardScores(torch.cat([s.total for s in scores]),
                            {k: torch.cat([s.parts[k] for s in scores]) for k in scores[0].parts})

    @staticmethod
    def stack(scores: Sequence["RewardScores"]) -> "RewardScores":
        """The batches ``scores`` stacked along a new first dimension."""
        return RewardScores(torch.stack([s.total for s in scores]),
                            {k: torch.stack([s.parts[k] for s in scores]) for k in scores[0].parts})


class Reward:
    """A reward as a training method calls it: one or a weighted sum of rewards, each call run
    with a deadline and checked (:meth:`score`). Built by :func:`build_reward` from a config's
    spec, or by :func:`as_reward` around a callable. Itself a reward by the contract: calling it
    returns the checked total ``(B,)`` float32.

    :param components: the rewards it sums (one for a single reward).
    :param timeout: seconds each call of each component may take (finite, > 0).
    :param weighted: whether the spec was a table of weights (then every component's scores
        are kept as :attr:`RewardScores.parts`).
    """

    def __init__(self, components: list[RewardComponent], timeout: float = DEFAULT_REWARD_TIMEOUT,
                 weighted: bool = False) -> None:
        if not components:
            raise InvalidInputError("a reward needs at least one component")
        self.components, self.weighted = list(components), weighted
        self.timeout = check_timeout(timeout)
        #: called as ``observer(prompts, outputs, scores)`` after every checked :meth:`score`
        #: (the sample logging of ``[logging]`` listens here); not pickled
        self.observers: list[Callable[[list[str], Any, "RewardScores"], None]] = []

    def __getstate__(self) -> dict[str, Any]:  # reward workers get the reward, not the listeners
        return {**self.__dict__, "observers": []}

    @property
    def name(self) -> str:
        """``"ocr"``, or ``"0.7*ocr + 0.3*clip_score"`` for a weighted sum."""
        if not self.weighted:
            return self.components[0].key
        return " + ".join(f"{c.weight:g}*{c.key}" for c in self.components)

    @property
    def modality(self) -> str:
        """``"video"`` (frames) or ``"audio"`` (a waveform): what every component scores."""
        return self.components[0].modality

    @property
    def labels(self) -> list[str]:
        """The components' metric labels (weighted sums only; empty for a single reward)."""
        return [c.label for c in self.components] if self.weighted else []

    def __repr__(self) -> str:
        return f"<Reward {self.name} (timeout {self.timeout:g} s)>"

    def __call__(self, prompts: list[str], outputs: Any) -> torch.Tensor:
        return self.score(prompts, outputs).total

    def score(self, prompts: list[str], outputs: Any) -> RewardScores:
        """Score ``outputs`` (one per prompt) with every component, each call on a worker thread
        waited on for at most :attr:`timeout` seconds, and check each result.

        :returns: the total ``(B,)`` float32 (``Σ wᵢ·rᵢ``, computed in float64) and, for a
            weighted sum, every component's scores.
        :raises InvalidInputError: when finite weights make the total infinite in float32.
        :raises RewardFaultError: for a component that raises, returns something that is not
            ``(B,)`` numbers (or an infinity), or runs past the timeout; a reward server's
            :class:`~flowseam.errors.RewardServerError`, another plugin fault and running out of
            memory pass through unchanged.
        """
        n = len(prompts)
        values = [_checked(c, _call(c, prompts, outputs, self.timeout), n) for c in self.components]
        if not self.weighted:
            scores = RewardScores(values[0])
        else:
            total = sum(c.weight * v.double() for c, v in zip(self.components, values)).float()
            inf = torch.isinf(total)
            if inf.any():  # finite weights and scores whose sum is past float32's range
                raise InvalidInputError(
                    f"reward {self.name}: the weighted sum is infinite in float32 for sample(s) "
                    f"{inf.nonzero().flatten().tolist()} of {n} (components "
                    f"{ {c.label: v[inf].tolist() for c, v in zip(self.components, values)} }); "
                    "use weights of a smaller magnitude")
            scores = RewardScores(total, {c.label: v for c, v in zip(self.components, values)})
        for observer in self.observers:
            observer(prompts, outputs, scores)
        return scores

    def fault(self, problem: str) -> RewardFaultError:
        """A fault of the whole (summed) reward: every component's plugin named."""
        if len(self.components) == 1:
            return self.components[0].fault(problem)
        owners = ", ".join(f"{c.key!r} {c.who()}" for c in self.components)
        return RewardFaultError(
            f"reward {self.name} (components {owners}) {problem}",
            ", ".join(c.plugin for c in self.components),
            ", ".join(c.distribution for c in self.components),
            ", ".join(c.version for c in self.components), f"reward {self.name}")


def check_timeout(timeout: Any) -> float:
    """:raises InvalidInputError: unless ``timeout`` is a finite number of seconds > 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not math.isfinite(timeout) or timeout <= 0:
        raise InvalidInputError(
            f"reward_timeout={timeout!r} must be a finite number of seconds > 0")
    return float(timeout)


def _call(comp: RewardComponent, prompts: list[str], outputs: Any, timeout: float) -> Any:
    """``comp.fn(prompts, outputs)`` on a daemon thread, waited on for ``timeout`` seconds.

    Python cannot stop a thread: one that runs past the deadline keeps running in the background
    until the process exits, so the fault stops the run."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = comp.fn(prompts, outputs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"flowseam reward {comp.key}", daemon=True)
    worker.start()
    worker.join(min(timeout, threading.TIMEOUT_MAX))
    if worker.is_alive():
        raise comp.fault(
            f"did not return within reward_timeout={timeout:g} s (scoring {len(prompts)} "
            "samples); its thread cannot be stopped and keeps running in the background, so the "
            "run stops here (a slow reward needs a larger reward_timeout in the config)")
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, SystemExit):  # a library's exit() inside a reward must not end the
            # run as a success (status 0, no model): it is the reward failing
            raise comp.fault(f"raised SystemExit({exc.code!r}) (scoring {len(prompts)} samples)"
                             ) from exc
        if not isinstance(exc, Exception) or isinstance(exc, PluginFaultError) or \
                is_out_of_memory(exc) or isinstance(exc, RewardServerError):
            raise exc
        raise comp.fault(f"{describe(exc)} (scoring {len(prompts)} samples)") from exc
    return box.get("value")


def _shown(value: Any) -> str:
    """``value``'s type and repr on one line, cut at 60 characters."""
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _checked(comp: RewardComponent, value: Any, n: int) -> torch.Tensor:
    """``value`` as ``(n,)`` float32 on the CPU.

    :raises RewardFaultError: for anything but ``n`` real numbers (shape ``(n,)`` or ``(n, 1)``)
        with no infinity; NaN is allowed (cannot score that sample)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        numeric = not t.dtype.is_complex
        shape = tuple(t.shape)
    else:
        try:
            arr = np.asarray(value)
        except Exception:  # noqa: BLE001 - a ragged list, an object numpy cannot take
            arr = np.asarray(None)
        numeric = arr.dtype.kind in "biuf"
        shape = arr.shape
        t = torch.from_numpy(arr.astype(np.float32)) if numeric else None
    if not numeric or t is None or t.dtype.is_complex:
        raise comp.fault(f"returned {_shown(value)} for {n} samples, which is not numbers; "
                         f"expected a float tensor of shape ({n},)")
    if shape not in ((n,), (n, 1)):
        raise comp.fault(f"returned shape {shape} ({_shown(value)}) for {n} samples; "
                         f"expected ({n},)")
    t = t.reshape(n).to(torch.float32)
    inf = torch.isinf(t)
    if inf.any():
        raise comp.fault(f"returned an infinity for sample(s) {inf.nonzero().flatten().tolist()} "
                         f"of {n} ({t.tolist()}); a reward gives finite scores, or NaN for a "
                         "sample it cannot score")
    return t


def check_scores(reward: Any, scores: RewardScores, where: str) -> None:
    """Refuse a step (or an evaluation) on which the reward could score nothing.

    :param reward: what scored (a :class:`Reward` or a callable, see :func:`as_reward`).
    :param scores: every score of the step (all ranks' samples).
    :param where: ``"step 3"``, for the message.
    :raises RewardFaultError: when a component (or the total) is NaN for every sample: NaN means
        "cannot score this sample", and a reward that can score none of a step's samples is
        broken or given outputs it was not made for; training on would skip every group.
    """
    reward = as_reward(reward)
    n = scores.total.numel()
    if not n:
        return
    for comp in reward.components:
        v = scores.parts.get(comp.label) if reward.weighted else scores.total
        if v is not None and bool(torch.isnan(v).all()):
            raise comp.fault(f"returned NaN for every sample of {where} ({n} samples); NaN means "
                             "'cannot score this sample', and a reward that can score none is "
                             "broken or scoring outputs it was not made for")
    if bool(torch.isnan(scores.total).all()):
        counts = ", ".join(f"{c.key} {int(torch.isnan(scores.parts[c.label]).sum())}"
                           for c in reward.components)
        raise reward.fault(f"is NaN for every sample of {where} ({n} samples): a NaN in any "
                           f"component makes the sum NaN (NaN samples per component: {counts})")


# -- building ---------------------------------------------------------------------------------

def as_reward(reward: Any, timeout: float | None = None) -> Reward:
    """``reward`` as a :class:`Reward`: itself if it is one, else one component around the
    callable (named by its ``__name__`` or class, and by the plugin that registered it when one
    did), called with ``timeout`` (default :data:`DEFAULT_REWARD_TIMEOUT`).

    :raises InvalidInputError: for something that is not callable.
    """
    if isinstance(reward, Reward):
        return reward
    if not callable(reward):
        raise InvalidInputError(f"reward {_shown(reward)} is not callable; a reward is "
                                "reward(prompts, outputs) -> (B,) scores")
    owner = reward_owner(reward)
    if owner is not None:
        rec, key = owner
        comp = RewardComponent(key, reward, plugin=rec.name, distribution=rec.distribution,
                               version=rec.version)
    else:
        key = getattr(reward, "__name__", None) or type(reward).__name__
        comp = RewardComponent(key, reward)
    comp.label = _label(key.rpartition(":")[2])
    return Reward([comp], DEFAULT_REWARD_TIMEOUT if timeout is None else timeout)


def _server_component(url: str, args: Mapping[str, Any]) -> RewardComponent:
    scheme = url.split("://", 1)[0]
    if scheme.lower() not in ("http", "https"):
        raise InvalidInputError(f"reward {url!r}: a reward server URL must start with http:// or "
                                f"https:// (got {scheme}://), e.g. http://127.0.0.1:8000/ocr")
    from .. import __version__
    from .remote import RemoteReward

    try:
        inspect.signature(RemoteReward).bind(url, **dict(args))
    except TypeError as exc:
        takes = [p for p in inspect.signature(RemoteReward).parameters if p != "url"]
        raise InvalidInputError(f"reward_args {dict(args)} do not fit reward server {url!r}: "
                                f"{exc}; a reward server URL takes {takes}") from None
    fn = RemoteReward(url, **dict(args))  # checks the URL and its own arguments
    comp = RewardComponent(url, fn, plugin="remote", distribution="flowseam", version=__version__)
    comp.label = _label(url.rstrip("/").rpartition("/")[2])
    return comp


def _component(key: Any, args: Any, weight: float = 1.0) -> RewardComponent:
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"reward {key!r} must be a non-empty string: a registered reward "
                                "name or a reward server URL")
    if not isinstance(args, Mapping):
        raise InvalidInputError(f"reward_args for {key!r} must be a table of keyword arguments, "
                                f"got {_shown(args)}")
    if "://" in key:
        comp = _server_component(key, args)
    else:
        rec, registered = resolve_reward(key)
        try:
            fn = make_reward(key, registered, args)
        except FlowseamError:
            raise
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            comp = RewardComponent(key, registered, plugin=rec.name, distribution=rec.distribution,
                                   version=rec.version)
            raise comp.fault(f"{describe(exc)} while being built with reward_args "
                             f"{dict(args)}") from exc
        comp = RewardComponent(key, fn, plugin=rec.name, distribution=rec.distribution,
                               version=rec.version, label=_label(key.rpartition(":")[2]))
    comp.weight = weight
    return comp


def build_reward(spec: Any, args: Mapping[str, Any] | None = None,
                 timeout: float = DEFAULT_REWARD_TIMEOUT) -> Reward:
    """The :class:`Reward` a config's ``reward``/``reward_args``/``reward_timeout`` name
    (docs/rewards.md); every factory is built now (so what its ``__init__`` refuses is refused
    before any model loads).

    :param spec: ``"NAME"``, ``"plugin:NAME"``, ``"http(s)://HOST:PORT/NAME"``, or a mapping
        of those to finite weights.
    :param args: the factory's keyword arguments (a single reward), or one table per component
        of a weighted sum.
    :param timeout: seconds each reward call may take (finite, > 0).
    :raises InvalidInputError: naming the value and what is allowed: an unknown name (the
        registered ones listed), a name several plugins register, a weight that is not a finite
        number, a URL that is not http(s), video and audio rewards in one sum, ``reward_args``
        for a name that is not a component, or what a factory refuses.
    :raises RewardFaultError: when a factory raises anything else.
    """
    timeout = check_timeout(timeout)
    args = {} if args is None else args
    if not isinstance(args, Mapping):
        raise InvalidInputError(f"reward_args must be a table, got {_shown(args)}")
    if isinstance(spec, str):
        return Reward([_component(spec, args)], timeout)
    if not isinstance(spec, Mapping):
        raise InvalidInputError(
            f"reward={spec!r} must be a reward name (\"ocr\"), a reward server URL "
            "(\"http://127.0.0.1:8000/ocr\") or a table of weights ({ocr = 0.7, clip_score = 0.3})")
    if not spec:
        raise InvalidInputError("reward = {} names no reward; a weighted sum needs at least one "
                                "name = weight")
    for key, weight in spec.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or \
                not math.isfinite(weight):
            raise InvalidInputError(f"reward weight {key}={weight!r} must be a finite number")
    stray = sorted(set(args) - set(spec))
    if stray:
        raise InvalidInputError(
            f"reward_args names {stray}, which are not components of reward {dict(spec)}; a "
            f"weighted sum takes one table per component (reward_args = {{{next(iter(spec))} = "
            "{...}}), for the components " + str(sorted(spec)))
    components = [_component(key, args.get(key, {}), float(weight)) for key, weight in spec.items()]
    modalities = {c.modality for c in components}
    if len(modalities) > 1:
        by = {m: [c.key for c in components if c.modality == m] for m in sorted(modalities)}
        raise InvalidInputError(
            f"reward {dict(spec)} mixes rewards of sound and of frames ({by}); a weighted sum "
            "scores one output: use only video rewards or only audio rewards")
    labels = [c.label for c in components]
    for c in components:
        if labels.count(c.label) > 1:
            c.label = _label(c.key)
    labels = [c.label for c in components]
    if len(set(labels)) < len(labels) or set(labels) & set(_RESERVED_LABELS):
        raise InvalidInputError(
            f"reward {dict(spec)}: the components' metric names {labels} collide (with each other "
            f"or with {list(_RESERVED_LABELS)}); rename one")
    return Reward(components, timeout, weighted=True)


def reward_name(reward: Any) -> str:
    """What messages call ``reward``: its spec's name, else its ``__name__`` or class."""
    if isinstance(reward, Reward):
        return reward.name
    return getattr(reward, "__name__", None) or type(reward).__name__


# -- calling ----------------------------------------------------------------------------------

def reward_input(reward, result) -> np.ndarray:
    """What ``reward`` scores in a :class:`~flowseam.loops.LoopResult`: its frames, or its
    waveform for a reward whose ``modality`` is ``"audio"``.

    :raises InvalidInputError: for an audio reward on a result without sound.
    """
    if modality(reward) == "audio":
        if result.audio is None:
            raise InvalidInputError(
                f"reward {reward_name(reward)!r} scores audio, and "
                "this model makes none (use a video reward, or an LTX-2 checkpoint)")
        return result.audio
    return result.frames


def score(reward: Any, prompts: list[str], outputs: Any,
          timeout: float | None = None) -> torch.Tensor:
    """Call ``reward`` (a :class:`Reward`, or a callable wrapped by :func:`as_reward` with
    ``timeout``) and check its result (:meth:`Reward.score`): the total ``(B,)`` float32.

    :raises RewardFaultError: for a reward that raises, returns a wrong shape or something that
        is not numbers, or runs past ``timeout`` (naming the plugin and the reward).
    """
    return as_reward(reward, timeout).score(prompts, outputs).total
