"""Adaptive step caching: skip the DiT on steps where its output changes little.

A per-request policy (``DiffusionParams.cache``, ``flowseam generate --cache NAME:THRESHOLD``),
off by default, that lives in the loop and never inside a model: the loop asks :class:`StepCache`
for each step's velocity, and the cache either runs the DiT (through the model's
``branch_velocity``) or predicts the velocity from the ones it computed before. Like TeaCache,
First-Block Cache and MagCache it accumulates an estimate of the change since the last computed
step and computes again once the sum passes a threshold; its estimate, the velocity's own rate
of change between the last two computed steps, needs no per-model calibration and no DiT work
(the rule: :meth:`StepCache.velocity`; docs/step-caching.md). The policy value is parsed in
:mod:`flowseam.request_fields` when the request is made; :class:`CachePolicy` and
:func:`normalize_cache` are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

# the request's policy value, parsed in the seam (DiffusionParams.cache); re-exported here
from ..errors import InvalidInputError
from ..request_fields import POLICIES, CachePolicy, normalize_cache  # noqa: F401

if TYPE_CHECKING:  # pragma: no cover
    import torch


def check_cache(policy: CachePolicy | None, capture: bool) -> None:
    """Refuse a cache policy in an RL rollout with capture unless it allows it
    (``in_rollouts=True``): the recorded log-probs must be those of the model that is trained.

    :raises ValueError: naming the policy and how to allow it.
    """
    if policy is not None and capture and not policy.in_rollouts:
        raise InvalidInputError(
            f"cache={policy} in an RL rollout: predicted velocities would make the "
            "recorded log-probs those of a cached model, not of the model that is "
            "trained; drop the cache, or pass CachePolicy(..., in_rollouts=True) "
            "to ask for it (its records then say so)")


@dataclass
class _History:
    """One branch's computed velocities: (sigma, velocity) of the last two, and the estimate."""

    computed: list[tuple[float, torch.Tensor]] = field(default_factory=list)
    accumulated: float = 0.0
    skips: int = 0
    last_sigma: float | None = None

    def rate(self) -> float:
        (s_b, v_b), (s_a, v_a) = self.computed[-2:]
        norm = float(v_a.float().norm())
        if norm == 0.0 or s_a == s_b:
            return float("inf")
        return float((v_a - v_b).float().norm()) / (norm * abs(s_a - s_b))


class StepCache:
    """One request's cache: per (expert, branch) histories, and what it computed and skipped.

    :param policy: the request's :class:`CachePolicy`.
    :param sigmas: the schedule's sigmas (N + 1 floats); step ``i`` starts at ``sigmas[i]``.
    """

    def __init__(self, policy: CachePolicy, sigmas: Sequence[float]) -> None:
        self.policy = policy
        self.sigmas = list(sigmas)
        self.num_steps = len(self.sigmas) - 1
        self._histories: dict[tuple[str, int], _History] = {}
        self.steps_computed = 0
        self.steps_skipped = 0
        self.branches_computed = 0
        self.branches_skipped = 0
        #: per step: whether it skipped the DiT entirely
        self.skipped: list[bool] = []
        #: per step: whether any branch's velocity was predicted rather than computed
        self.predicted: list[bool] = []

    def velocity(self, i: int, expert: str, num_branches: int,
                 compute: Callable[[list[int]], list[torch.Tensor]],
                 combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """Step ``i``'s velocity from ``expert``: each of the ``num_branches`` branches is
        computed (``compute(branch indices) -> their velocities``, one DiT call) or predicted,
        then ``combine(per-branch velocities)`` guides them (CFG).

        The rule, per branch. The family is TeaCache (Liu et al. 2024, "Timestep Embedding
        Tells: It's Time to Cache for Video Diffusion Model"), First-Block Cache (ParaAttention;
        diffusers' ``FirstBlockCacheConfig``) and MagCache (Ma et al. 2025, "MagCache: Fast
        Video Generation with Magnitude-Aware Cache"): estimate how much the output would change
        since the last computed step, accumulate that estimate over skipped steps, and compute
        again once the sum passes the threshold. What differs is the estimate: TeaCache needs a
        per-model polynomial fitted offline, MagCache a per-model table of magnitude ratios,
        First-Block Cache runs the first transformer block on every step. This estimate needs
        none of these and no DiT work: the velocity's own rate of change,

            rate = ||v_a - v_b|| / (||v_a|| * |sigma_a - sigma_b|)

        from the last two computed velocities ``v_a`` (at ``sigma_a``) and ``v_b``. A step at
        ``sigma`` adds ``rate * |sigma - sigma_prev|`` to the accumulated estimate; while the sum
        stays below the threshold (a relative change of the velocity: 0.05 = 5 %; 0 computes
        every step) and the branch has skipped fewer than ``max_skips`` steps in a row, the DiT
        is skipped and the velocity is predicted:

        * ``reuse``: the last computed velocity (TeaCache / First-Block Cache reuse the cached
          residual);
        * ``extrapolate``: first order in sigma through the last two computed velocities,
          ``v_a + (sigma - sigma_a) (v_a - v_b) / (sigma_a - sigma_b)`` (TaylorSeer's
          first-order forecast, Liu et al. 2025, "From Reusing to Forecasting").

        The first ``warmup`` steps (at least two, to have a rate) and the last step are always
        computed. With classifier-free guidance each branch (unconditional, conditional) has its
        own history and its own decision, and only the branches that must be computed run (a
        batch of B rather than 2B). Each ``expert`` (Wan2.2's two DiTs) has its own histories,
        so a model starts a fresh history at each expert. A step where no branch ran the DiT
        counts as skipped (:meth:`report`).
        """
        sigma = self.sigmas[i]
        histories = [self._histories.setdefault((expert, b), _History())
                     for b in range(num_branches)]
        must = i < self.policy.warmup or i == self.num_steps - 1
        run: list[int] = []
        for b, h in enumerate(histories):
            if must or len(h.computed) < 2 or h.skips >= self.policy.max_skips:
                run.append(b)
                continue
            estimate = h.accumulated + h.rate() * abs(sigma - h.last_sigma)
            if estimate >= self.policy.threshold:
                run.append(b)
            else:
                h.accumulated = estimate
        out: list[torch.Tensor | None] = [None] * num_branches
        if run:
            for b, v in zip(run, compute(run)):
                h = histories[b]
                h.computed = (h.computed + [(sigma, v)])[-2:]
                h.accumulated, h.skips = 0.0, 0
                out[b] = v
        for b, h in enumerate(histories):
            h.last_sigma = sigma
            if out[b] is None:
                h.skips += 1
                out[b] = self._predict(h, sigma)
        self.branches_computed += len(run)
        self.branches_skipped += num_branches - len(run)
        self.steps_computed += bool(run)
        self.steps_skipped += not run
        self.skipped.append(not run)
        self.predicted.append(len(run) < num_branches)
        return combine(out)

    def _predict(self, h: _History, sigma: float) -> torch.Tensor:
        (s_b, v_b), (s_a, v_a) = h.computed[-2:]
        if self.policy.name == "reuse":
            return v_a
        return v_a + (v_a - v_b) * ((sigma - s_a) / (s_a - s_b))

    def report(self) -> dict:
        """``{"policy", "steps_computed", "steps_skipped", "branches_computed",
        "branches_skipped"}`` (``LoopResult.cache``)."""
        return {"policy": str(self.policy), "steps_computed": self.steps_computed,
                "steps_skipped": self.steps_skipped, "branches_computed": self.branches_computed,
                "branches_skipped": self.branches_skipped}
