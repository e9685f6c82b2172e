"""Flow-GRPO's pieces, shared by the ``flowgrpo`` and ``workflow_rl`` methods.

Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL"): sample a
group of K outputs per prompt with the SDE step (each step a Gaussian policy with a log-prob),
score them, use the group-relative advantage ``A = (r - mean) / (std + eps)`` (clipped to
``±adv_clip_max``), and maximise the PPO clipped objective over the captured steps, with a KL
penalty to a frozen reference: ``KL = ||mean_θ - mean_ref||² / (2 std²)`` per step (their
``train_sd3.py``).

The log-prob recompute of every update runs through the loops' one stepper with the rollout's
kernel pinned (:meth:`flowseam.loops.solvers.SolverSteps.recompute`:
``platform.kernels.pin(record.impl_id)``) — the exact implementation that produced the rollout,
or a :class:`~flowseam.KernelPinError`; never a fresh lookup (C2: on the first inner epoch,
before any weight change, every PPO ratio is 1).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

import torch
from pydantic import Field

from ..errors import InvalidInputError
from ..loops import LoopResult, record_velocity
from ..loops.solvers import SolverSteps
from ..models.instance import ModelInstance
from .config import (
    ConfigSection,
    Names,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    RewardSpec,
    RewardTimeout,
    RunConfig,
)
from .distributed import DataParallel
from ..rewards.spec import DEFAULT_REWARD_TIMEOUT
from .guards import clip_gradients


class GRPOConfig(ConfigSection):
    """Flow-GRPO hyper-parameters, the ``[grpo]`` config section (defaults: Flow-GRPO's SD3
    config). Typed and range-checked (:mod:`flowseam.training.config`).

    :param clip_range: PPO ratio clip ε > 0: ``clip(ratio, 1-ε, 1+ε)``.
    :param adv_clip_max: advantages are clipped to ``[-adv_clip_max, adv_clip_max]``; > 0.
    :param beta: KL-to-reference coefficient, >= 0 (0 disables the reference).
    :param inner_epochs: PPO epochs over each batch of rollouts, >= 1.
    :param timestep_fraction: fraction of the SDE steps (all steps, or the rollout's
        ``sde_window``) trained on (a random subset), in (0, 1].
    :param max_grad_norm: gradient clipping (``clip_grad_norm_``), > 0.
    :param eps: added to the group std, >= 0.
    """

    clip_range: PositiveFloat = 1e-4
    adv_clip_max: PositiveFloat = 5.0
    beta: NonNegativeFloat = 0.04
    inner_epochs: PositiveInt = 1
    timestep_fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    max_grad_norm: PositiveFloat = 1.0
    eps: NonNegativeFloat = 1e-4


#: ``[grpo]``'s defaults, from :class:`GRPOConfig`
GRPO_DEFAULTS = GRPOConfig().model_dump()


class GroupRLConfig(RunConfig):
    """The keys of every Flow-GRPO-style method: ``prompts`` (cycled, ``prompts_per_step`` per
    step), the ``reward`` (a registered name, a reward server URL or a table of weights, with
    ``reward_args`` and ``reward_timeout`` seconds per call: :func:`~.rewards.build_reward`),
    and ``group_size >= 2`` samples per prompt (the advantage is relative to the other samples
    of the same prompt)."""

    prompts: Names | None = None
    reward: RewardSpec = "brightness"
    reward_args: dict[str, Any] = {}
    reward_timeout: RewardTimeout = DEFAULT_REWARD_TIMEOUT
    group_size: Annotated[int, Field(ge=2)] = 4
    prompts_per_step: PositiveInt = 1


def group_advantages(rewards: torch.Tensor, cfg: GRPOConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Group-relative advantages.

    :param rewards: ``(G, K)`` rewards, one row per group (prompt), K samples each.
    :returns: ``(advantages (G, K), valid (G,) bool, stats)``. A group with a non-finite reward is
        invalid (advantage 0, never trained on); a group with zero std gets advantage 0.
    """
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise InvalidInputError(
            f"rewards have shape {tuple(rewards.shape)}; need (groups, K) with K >= 2")
    rewards = rewards.double()
    valid = torch.isfinite(rewards).all(dim=1)
    safe = torch.where(valid[:, None], rewards, torch.zeros_like(rewards))
    mean = safe.mean(dim=1, keepdim=True)
    std = safe.std(dim=1, unbiased=False, keepdim=True)
    zero_std = (std.squeeze(1) < 1e-12) & valid
    adv = ((safe - mean) / (std + cfg.eps)).clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
    keep = valid & ~zero_std
    adv = torch.where(keep[:, None], adv, torch.zeros_like(adv)).float()
    v = adv[valid]
    stats = {
        "groups_skipped_nan": int((~valid).sum()),
        "frac_zero_std_groups": float(zero_std.float().mean()) if len(zero_std) else 0.0,
        "adv_mean": float(v.mean()) if v.numel() else 0.0,
        "adv_std": float(v.std(unbiased=False)) if v.numel() else 0.0,
        "adv_min": float(v.min()) if v.numel() else 0.0,
        "adv_max": float(v.max()) if v.numel() else 0.0,
    }
    return adv, valid, stats


@dataclass
class Trajectory:
    """One rollout batch (its records, conditioning and params) and one advantage per row.

    :ivar trained: whether the group this batch belongs to is trained on (False for a group with
        a NaN reward or zero reward std). None: when any of its advantages is non-zero. A method
        whose batches hold part of a group (data parallelism) sets it from the whole group, so a
        row whose own advantage is 0 still counts. A batch that holds several groups (one
        rollout for all of a step's groups) gives a ``(B,)`` bool tensor: each row's group's flag.
    """

    model: ModelInstance
    result: LoopResult
    advantages: torch.Tensor  # (B,)
    trained: bool | torch.Tensor | None = None

    @property
    def rows_trained(self) -> torch.Tensor:
        """``(B,)`` bool: the rows that are trained on (and counted in the loss's mean)."""
        if isinstance(self.trained, torch.Tensor):
            return self.trained.bool()
        flag = bool((self.advantages != 0).any()) if self.trained is None else self.trained
        return torch.full((len(self.advantages),), flag)

    @property
    def is_trained(self) -> bool:
        return bool(self.rows_trained.any())


@dataclass
class UpdateStats:
    ratios: list[torch.Tensor] = field(default_factory=list)         # every (B,) ratio, all epochs
    first_epoch_ratios: list[torch.Tensor] = field(default_factory=list)
    clipped: list[float] = field(default_factory=list)
    approx_kl: list[float] = field(default_factory=list)
    kl_ref: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def summary(self, prefix: str = "") -> dict[str, float]:
        r = torch.cat(self.ratios) if self.ratios else torch.ones(1)
        first = torch.cat(self.first_epoch_ratios) if self.first_epoch_ratios else torch.ones(1)
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0  # noqa: E731
        return {f"{prefix}ratio_mean": float(r.mean()), f"{prefix}ratio_min": float(r.min()),
                f"{prefix}ratio_max": float(r.max()),
                f"{prefix}ratio_dev_first_epoch": float((first.double() - 1).abs().max()),
                f"{prefix}clip_frac": mean(self.clipped),
                f"{prefix}approx_kl": mean(self.approx_kl), f"{prefix}kl_ref": mean(self.kl_ref),
                f"{prefix}grad_norm": mean(self.grad_norms)}

    @staticmethod
    def by_rank(per_rank: list["UpdateStats"], prefix: str = "") -> dict[str, Any]:
        """With several ranks, each rank's first-epoch ratio deviation from 1 (C2 holds on every
        rank, not only in the merged stats); nothing on one process."""
        if len(per_rank) < 2:
            return {}
        key = f"{prefix}ratio_dev_first_epoch"
        return {f"{key}_by_rank": [s.summary()["ratio_dev_first_epoch"] for s in per_rank]}

    @classmethod
    def merged(cls, per_rank: list["UpdateStats"]) -> "UpdateStats":
        """The stats of every rank as one (what a single process running every rank's share
        would have recorded; gradient norms are the same on every rank, rank 0's are kept)."""
        out = cls(grad_norms=list(per_rank[0].grad_norms))
        for s in per_rank:
            out.ratios += s.ratios
            out.first_epoch_ratios += s.first_epoch_ratios
            out.clipped += s.clipped
            out.approx_kl += s.approx_kl
            out.kl_ref += s.kl_ref
        return out


def train_timesteps(n_steps: int, fraction: float, seed: int) -> list[int]:
    """A reproducible random subset of ``ceil(fraction * n)`` step indices (sorted)."""
    k = max(1, math.ceil(fraction * n_steps))
    order = list(range(n_steps))
    random.Random(seed).shuffle(order)
    return sorted(order[:k])


def ppo_update(policy: torch.nn.Module, reference: torch.nn.Module | None,
               trajectories: list[Trajectory], optimizer: torch.optim.Optimizer, cfg: GRPOConfig,
               seed: int, after_step: Callable[[], None] | None = None,
               dp: DataParallel | None = None, expert: str | None = None) -> UpdateStats:
    """Flow-GRPO's PPO update of ``policy`` on ``trajectories``.

    The loss is the mean, over every trained row (sample) of every trajectory and every selected
    step, of the PPO clipped term plus ``beta`` × the KL to the reference. Per inner epoch:
    gradients accumulate over every trajectory and selected step, then one clipped optimizer
    step, then ``after_step()`` (a WeightSyncPlan's sync). On the first epoch no weight has
    changed yet, so every ratio is 1. Rows that are not trained on
    (:attr:`Trajectory.rows_trained`) contribute nothing and are left out of the stats; with
    none left nothing is updated.

    Under data parallelism (``dp`` with several ranks; ``policy`` is what ``dp.wrap`` returned)
    every rank passes its own trajectories; the row count is summed over ranks, gradients are
    averaged over ranks on the last backward of each epoch, and every rank runs the forwards of
    all its trajectories (an untrained one with weight 0), so all ranks run the same number.

    :param trajectories: rollouts with ``sde_rollout=True``; the steps with a log-prob (every
        step, or those of ``params.sde_window``) are the ones trained on.
    :param seed: picks the trained steps (``timestep_fraction`` of the SDE steps) reproducibly.
    :param expert: train only on the picked steps this DiT expert produced
        (``BehaviorRecord.expert``; ``policy`` is the trainer's copy of that expert): the steps
        are picked among all SDE steps first, with ``seed``, so the experts of a multi-expert
        model share one pick. With none of its steps picked nothing is updated.
    :returns: the ratios (per epoch), clip fractions, approximate KL, KL to the reference and
        gradient norms (before clipping) of this rank's trained trajectories.
    :raises KernelPinError: if a record's kernel is not available on the model's platform.
    :raises ValueError: for a rollout without any log-prob (an ODE rollout).
    """
    dp = dp or DataParallel.single()
    stats = UpdateStats()
    trainable = [p for p in policy.parameters() if p.requires_grad]
    # Rows of untrained groups carry no signal; with none left (on any rank) there is no update
    # at all (an optimizer step on zero gradients would still apply weight decay).
    n_rows = dp.sum(sum(int(t.rows_trained.sum()) for t in trajectories))
    if not n_rows:
        return stats
    work = trajectories if dp.world_size > 1 else [t for t in trajectories if t.is_trained]
    # The steps with a log-prob: every step, or those of the rollout's SDE window; each rollout's
    # recompute pins the kernel that produced them (KernelPinError, ValueError before any update).
    solvers = [SolverSteps.recompute(t.model.platform.kernels, t.result) for t in work]
    stochastic = [j for j, rec in enumerate(work[0].result.records) if rec.log_prob is not None]
    steps = [stochastic[k] for k in train_timesteps(len(stochastic), cfg.timestep_fraction, seed)]
    if expert is not None:
        steps = [j for j in steps if work[0].result.records[j].expert == expert]
        if not steps:
            return stats
    # each row's weight in the mean; × world size because DDP/FSDP average gradients over ranks
    row_weight = dp.world_size / (n_rows * len(steps))
    for epoch in range(cfg.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        for t_index, traj in enumerate(work):
            model, res = traj.model, traj.result
            adv = traj.advantages.to(res.latents.device)
            mask = traj.rows_trained
            weights = (mask.float() * row_weight).to(res.latents.device)
            solve = solvers[t_index]
            for j in steps:
                last = t_index == len(work) - 1 and j == steps[-1]
                with dp.accumulate(policy, sync=last):
                    rec = res.records[j]
                    v = record_velocity(model, res, rec, dit=policy)  # the loop's own recompute
                    out = solve.log_prob(rec, v)  # the rollout's kernel, pinned
                    log_ratio = out.log_prob - rec.log_prob.to(out.log_prob.device)
                    ratio = torch.exp(log_ratio)
                    unclipped = -adv * ratio
                    clipped = -adv * ratio.clamp(1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
                    rows = torch.maximum(unclipped, clipped)  # (B,)
                    if cfg.beta > 0 and reference is not None:
                        with torch.no_grad():
                            v_ref = record_velocity(model, res, rec, dit=reference)
                            ref = solve.log_prob(rec, v_ref)
                        kl = ((out.mean - ref.mean) ** 2).flatten(1).mean(dim=1) / (2 * out.std ** 2)
                        rows = rows + cfg.beta * kl
                        if traj.is_trained:
                            stats.kl_ref.append(float(kl.detach().cpu()[mask].mean()))
                    (rows * weights).sum().backward()  # untrained rows: weight 0
                if not traj.is_trained:
                    continue
                detached = ratio.detach().cpu()[mask]
                stats.ratios.append(detached)
                if epoch == 0:
                    stats.first_epoch_ratios.append(detached)
                stats.clipped.append(float(((detached - 1.0).abs() > cfg.clip_range).float().mean()))
                stats.approx_kl.append(float(0.5 * (log_ratio.detach().cpu()[mask] ** 2).mean()))
        stats.grad_norms.append(clip_gradients(trainable, cfg.max_grad_norm,
                                               f"PPO update (epoch {epoch})"))
        optimizer.step()
        if after_step is not None:
            after_step()
    return stats
