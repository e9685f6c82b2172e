"""Rollout fleets on Ray: rollout (and reward) workers as Ray actors that a trainer feeds.

RL for video models is rollout-bound, so a step's rollouts may run on a fleet of workers (one Ray
actor per device) while the trainer keeps the policy, the optimizer and the log-prob recompute;
flowseam has no scheduler of its own. A worker gets the driver's frozen Platform
(:meth:`flowseam.Platform.from_dict`: no discovery, the same kernel ids, so the trainer's pinned
recompute holds) and the checkpoint path; every weights version reaches it as a
:class:`~flowseam.training.weight_sync.WeightUpdate`, checksum first, through the object store.
A worker with other weights raises :class:`StaleWeightsError` instead of rolling out and is
resynced; a dead one is replaced in its placement-group bundle and its shares run again, each
result taken exactly once. Rewards may run in actors of their own, the frames going there from
the rollout worker, never through the driver. Details: docs/scaling.md ("Rollout fleets on
Ray"); install with ``pip install "flowseam[ray]"``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from ..errors import FlowseamError
from .config import ConfigSection, Name, NonNegativeFloat, NonNegativeInt

if TYPE_CHECKING:  # pragma: no cover
    from ..loops import LoopResult
    from ..models.instance import ModelInstance
    from ..request import GenerationRequest
    from .weight_sync import WeightUpdate


class StaleWeightsError(FlowseamError):
    """A rollout worker holds other weights than the trainer expects (it never rolls out)."""


def require_ray():
    """Import Ray. :raises FlowseamError: saying how to install it, when it is missing."""
    try:
        import ray
    except ImportError as exc:
        raise FlowseamError("rollout fleets need Ray: pip install 'flowseam[ray]'") from exc
    return ray


class RolloutWorker:
    """One rollout worker (a Ray actor; see the module docstring).

    :param platform: the driver's ``platform.to_dict()``.
    :param checkpoint: the checkpoint directory (visible at the same path on every node).
    :param lora: the trainer's LoRA settings, so the DiT has the adapters the weights fill.
    :param torch_threads: torch CPU threads (default: what Ray's ``num_cpus`` allows).
    """

    def __init__(self, platform: dict[str, Any], checkpoint: str, lora: dict[str, Any] | None,
                 torch_threads: int | None) -> None:
        from ..loading import load
        from ..seam.platform import Platform
        from .common import _add_lora

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.platform = Platform.from_dict(platform)
        self.model = load(checkpoint, platform=self.platform)
        if lora and lora.get("rank"):
            _add_lora(self.model.dit, lora)
        #: component → the plan version of the weights this worker holds (absent: as loaded)
        self.versions: dict[str, int] = {}

    def describe(self) -> dict[str, Any]:
        """Where and how this worker runs: pid, torch threads, CPU seconds used so far, the
        rebuilt platform's dict, and whether this process ever scanned the plugin entry points."""
        import time

        from ..seam import discovery

        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "cpu_seconds": time.process_time(), "platform": self.platform.to_dict(),
                "discovered_plugins": discovery.scanned()}

    def apply(self, update: "WeightUpdate") -> int:
        """Verify and apply one weight update; returns the version now held."""
        update.apply(self.model)
        self.versions[update.component] = update.version
        return update.version

    def rollout(self, request: "GenerationRequest", expected: dict[str, int], profile: str):
        """Run the card's loop for ``request`` under the weight versions ``expected``.

        :returns: ``((LoopResult without frames, versions), frames (B, F, H, W, 3))``, two Ray
            objects (the frames can go to a reward worker without passing the driver).
        :raises StaleWeightsError: if this worker's versions differ from ``expected``.
        """
        from ..loops import ExecutionProfile, run_loop

        held = {c: self.versions.get(c) for c in expected}
        if held != expected:
            raise StaleWeightsError(f"rollout worker (pid {os.getpid()}) holds weight versions "
                                    f"{held}, the trainer expects {expected}; not rolling out")
        result = run_loop(self.model, request, profile=ExecutionProfile(profile))
        frames = result.frames
        return (dataclasses.replace(result, frames=np.zeros((0,), np.float32)), dict(self.versions)), frames

    def ping(self) -> int:
        return os.getpid()


class RewardWorker:
    """A reward in its own actor: ``score(prompts, frames) -> RewardScores`` (the total ``(B,)``
    and, for a weighted sum, each component's), checked as in the trainer
    (:meth:`flowseam.rewards.spec.Reward.score`), with its timeout. It holds the trainer's reward
    as :func:`~flowseam.rewards.spec.build_reward` built it, pickled (so every component's
    callable must be picklable); a :class:`~flowseam.errors.RewardFaultError` it raises reaches
    the trainer as it is."""

    def __init__(self, reward: Any) -> None:
        from ..rewards.spec import as_reward

        self.reward = as_reward(reward)

    def score(self, prompts: list[str], frames: np.ndarray):
        return self.reward.score(prompts, frames)

    def ping(self) -> int:
        return os.getpid()


@dataclasses.dataclass
class _Share:
    """One rollout request in flight: the worker it runs on and its result refs."""

    index: int
    request: Any
    worker: int = -1
    handle: Any = None
    meta: Any = None      # ref → (LoopResult without frames, weight versions held)
    frames: Any = None    # ref → frames (B, F, H, W, 3)
    reward: Any = None    # ref → (B,) rewards (reward workers only)


class RolloutFleet:
    """Ray actors that roll out ``model``'s checkpoint on ``model``'s platform.

    Ray must be initialised (``ray.init(...)``) before a fleet is built.

    :param model: the trainer's instance (its ``platform`` and ``path`` travel to the workers).
    :param workers: number of rollout workers (>= 1).
    :param lora: the trainer's LoRA settings (``rank`` 0: none).
    :param num_cpus, num_gpus: resources of each rollout worker (one per device: ``num_gpus=1``).
    :param placement: placement-group strategy for the rollout workers (``"PACK"``,
        ``"SPREAD"``, ``"STRICT_PACK"``, ``"STRICT_SPREAD"``).
    :param reward: a reward callable (picklable: a module-level function or class instance) to
        run in ``reward_workers`` actors of ``reward_num_cpus``/``reward_num_gpus`` each; with 0
        reward workers the trainer scores in its own process.
    :param torch_threads: torch threads per rollout worker (default ``num_cpus``).
    :param max_replacements: how many dead rollout workers the fleet replaces over its life
        before it gives up (a crash loop is a bug to report, not to retry forever).
    :raises FlowseamError: for invalid sizes, a model without a checkpoint directory, Ray not
        initialised / not installed, or more resources than the Ray cluster has.
    """

    def __init__(self, model: "ModelInstance", workers: int, *, lora: dict[str, Any] | None = None,
                 num_cpus: float = 1, num_gpus: float = 0, placement: str = "PACK",
                 reward: Any = None, reward_workers: int = 0, reward_num_cpus: float = 0,
                 reward_num_gpus: float = 0, torch_threads: int | None = None,
                 max_replacements: int = 8) -> None:
        ray = require_ray()
        if not isinstance(workers, int) or workers < 1:
            raise FlowseamError(f"rollout_workers={workers!r} must be an integer >= 1")
        if reward_workers and reward is None:
            raise FlowseamError("reward_workers > 0 needs a reward to run")
        if model.path is None:
            raise FlowseamError("a rollout fleet loads the model's checkpoint on every worker; this "
                                "model was not loaded from a checkpoint directory")
        if placement not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise FlowseamError(f"placement={placement!r}; allowed: PACK, SPREAD, STRICT_PACK, "
                                "STRICT_SPREAD")
        if not ray.is_initialized():
            raise FlowseamError("Ray is not initialised: call ray.init() (or ray.init(address=...)) "
                                "before building a rollout fleet")
        from ray.util.placement_group import placement_group

        self._ray = ray
        self._args = (model.platform.to_dict(), str(model.path), dict(lora or {}),
                      torch_threads or max(1, int(num_cpus)))
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        have = ray.cluster_resources()
        short = {k: v * workers for k, v in bundle.items() if v * workers > have.get(k, 0)}
        if short:
            raise FlowseamError(f"{workers} rollout workers of {bundle} need {short}; the Ray cluster "
                                f"has {({k: have.get(k, 0) for k in bundle})}")
        self._pg = placement_group([bundle] * workers, strategy=placement)
        try:
            ray.get(self._pg.ready(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise FlowseamError(f"Ray could not place {workers} bundles of {bundle} with strategy "
                                f"{placement} within 10 minutes (cluster: {have})") from None
        self._worker_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(RolloutWorker)
        self.workers = [self._spawn(i) for i in range(workers)]
        self._reward_cls = ray.remote(num_cpus=reward_num_cpus, num_gpus=reward_num_gpus)(RewardWorker)
        self._reward = reward
        self.reward_workers = [self._reward_cls.remote(reward) for _ in range(reward_workers)]
        self.max_replacements = max_replacements
        self._updates: dict[str, Any] = {}  # component → ref of the latest WeightUpdate
        self.versions: dict[str, int] = {}   # component → its version
        self.stats = {"shares": 0, "rerun": 0, "replaced": 0, "stale": 0}
        ray.get([w.ping.remote() for w in self.workers + self.reward_workers])  # all started

    @property
    def size(self) -> int:
        return len(self.workers)

    def _spawn(self, i: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
        return self._worker_cls.options(scheduling_strategy=strategy).remote(*self._args)

    def describe(self) -> list[dict[str, Any]]:
        """:meth:`RolloutWorker.describe` of every rollout worker."""
        return self._ray.get([w.describe.remote() for w in self.workers])

    # -- weights -------------------------------------------------------------------------------
    def push(self, update: "WeightUpdate") -> None:
        """Hand ``update`` to every worker (stored once in the object store) and wait until each
        has verified and applied it. A worker that dies meanwhile is replaced (and the
        replacement receives every latest update)."""
        ray = self._ray
        ref = ray.put(update)
        self._updates[update.component] = ref
        self.versions[update.component] = update.version
        for i, w in enumerate(list(self.workers)):
            try:
                ray.get(w.apply.remote(ref))
            except ray.exceptions.RayActorError:
                self._replace(i, w)

    def _replace(self, i: int, dead) -> None:
        """Replace worker ``i`` (if it still is ``dead``) and give it the latest weights."""
        if self.workers[i] is not dead:
            return
        if self.stats["replaced"] >= self.max_replacements:
            raise FlowseamError(f"rollout fleet: {self.stats['replaced']} workers replaced already; "
                                "giving up (see the Ray logs of the dead workers)")
        self._ray.kill(dead, no_restart=True)
        self.workers[i] = self._spawn(i)
        self.stats["replaced"] += 1
        self._ray.get([self.workers[i].apply.remote(ref) for ref in self._updates.values()])

    # -- rollouts ------------------------------------------------------------------------------
    def rollout(self, requests: list["GenerationRequest"], prompts: list[list[str]] | None = None
                ) -> tuple[list["LoopResult"], list[torch.Tensor] | None]:
        """Roll out every request on the fleet (request ``j`` on worker ``j % size``), each under
        the weight versions last pushed.

        :param prompts: per request, the prompts its reward is scored with (reward workers only).
        :returns: ``(results, rewards)``: one LoopResult (with its frames and BehaviorRecords)
            per request, in order; with reward workers one
            :class:`~flowseam.rewards.spec.RewardScores` per request, else None.
        :raises FlowseamError: when more workers died than ``max_replacements``; a worker's own
            error (a bad request, a :class:`~flowseam.errors.RewardFaultError`) is raised as it
            is.
        """
        ray = self._ray
        expected = dict(self.versions)
        shares = [_Share(j, r) for j, r in enumerate(requests)]
        for s in shares:
            self._submit(s, s.index % self.size, expected, prompts)
        self.stats["shares"] += len(shares)
        results: list[Any] = [None] * len(shares)
        rewards: list[Any] = [None] * len(shares)
        waiting = {s.meta: s for s in shares}  # the ref each share waits on next
        reruns_left = 4 * len(shares) + self.max_replacements
        while waiting:
            (ref,), _ = ray.wait(list(waiting), num_returns=1)
            s = waiting.pop(ref)
            try:
                if ref == s.reward:
                    try:
                        rewards[s.index] = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:  # the reward's own fault
                        if isinstance(exc.cause, FlowseamError):
                            raise exc.cause from None
                        raise
                    continue
                result, held = ray.get(ref)
                if {c: held.get(c) for c in expected} != expected:  # the worker checks too
                    raise StaleWeightsError(f"worker reported versions {held}, expected {expected}")
                results[s.index] = dataclasses.replace(result, frames=ray.get(s.frames))
                if s.reward is not None:
                    waiting[s.reward] = s
                continue
            except StaleWeightsError:
                self.stats["stale"] += 1
                ray.get([s.handle.apply.remote(u) for u in self._updates.values()])
            except ray.exceptions.RayActorError as exc:  # a worker of this share died
                self._replace_actor(exc.actor_id)
            except ray.exceptions.ObjectLostError:  # its frames went with their worker
                pass
            # run the whole share again, on worker index s.worker (its replacement if it died)
            reruns_left -= 1
            if reruns_left < 0:
                raise FlowseamError(f"rollout fleet: shares keep failing ({self.stats}); giving up")
            self.stats["rerun"] += 1
            results[s.index] = rewards[s.index] = None
            self._submit(s, s.worker, expected, prompts)
            waiting[s.meta] = s
        return results, (rewards if self.reward_workers else None)

    def _submit(self, s: _Share, worker: int, expected: dict[str, int], prompts) -> None:
        s.worker, s.handle = worker, self.workers[worker]
        s.meta, s.frames = s.handle.rollout.options(num_returns=2).remote(s.request, expected, "rollout")
        s.reward = None
        if self.reward_workers:
            scorer = self.reward_workers[s.index % len(self.reward_workers)]
            s.reward = scorer.score.remote(prompts[s.index], s.frames)

    def _replace_actor(self, actor_id: str | None) -> None:
        """Replace the rollout or reward worker with Ray actor id ``actor_id`` (once)."""
        for i, w in enumerate(self.workers):
            if w._actor_id.hex() == actor_id:
                return self._replace(i, w)
        for i, w in enumerate(self.reward_workers):
            if w._actor_id.hex() == actor_id:
                self._ray.kill(w, no_restart=True)
                self.reward_workers[i] = self._reward_cls.remote(self._reward)
                self.stats["replaced"] += 1

    def __repr__(self) -> str:
        return f"<RolloutFleet {self.size} rollout + {len(self.reward_workers)} reward workers {self.stats}>"

    def shutdown(self) -> None:
        """Kill every worker and release the placement group."""
        from ray.util.placement_group import remove_placement_group

        for w in self.workers + self.reward_workers:
            self._ray.kill(w, no_restart=True)
        remove_placement_group(self._pg)
        self.workers, self.reward_workers = [], []


class RaySection(ConfigSection):
    """The ``[ray]`` config table of the methods that can roll out on a fleet (see
    :class:`RolloutFleet` for each key; ``rollout_workers = 0``: no fleet)."""

    rollout_workers: NonNegativeInt = 0
    reward_workers: NonNegativeInt = 0
    address: Name | None = None
    num_cpus: NonNegativeFloat = 1
    num_gpus: NonNegativeFloat = 0
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    reward_num_cpus: NonNegativeFloat = 0
    reward_num_gpus: NonNegativeFloat = 0


def fleet_from_config(model: "ModelInstance", options: dict[str, Any], lora: dict[str, Any],
                      reward: Any) -> RolloutFleet | None:
    """The fleet a method's ``[ray]`` table asks for (None for ``rollout_workers = 0``):
    ``ray.init(address=address)`` first unless Ray is initialised (no address: a local Ray)."""
    if not options["rollout_workers"]:
        return None
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=options["address"] or None)
    return RolloutFleet(model, options["rollout_workers"], lora=lora, num_cpus=options["num_cpus"],
                        num_gpus=options["num_gpus"], placement=options["placement"],
                        reward=reward if options["reward_workers"] else None,
                        reward_workers=options["reward_workers"],
                        reward_num_cpus=options["reward_num_cpus"],
                        reward_num_gpus=options["reward_num_gpus"])
