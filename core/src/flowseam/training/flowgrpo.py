"""The ``flowgrpo`` training method: Flow-GRPO on one model (text-to-image or text-to-video; for
LTX-2 both stages' steps are captured, and the reward may score the video or the audio).

Each step rolls out ``prompts_per_step`` groups of ``group_size`` samples with the SDE step (the
serve loop with ``ExecutionProfile.ROLLOUT``, every member its own seed), scores them with the
reward, computes group-relative advantages, runs the PPO update (:func:`.grpo.ppo_update`) on the
trainer's copy of the DiT and hands the new weights to the rollout instance through a
:class:`WeightSyncPlan`. The same step runs data-parallel (:mod:`.distributed`), with every
rollout split over the ranks (``[parallel]``: :mod:`flowseam.parallel`), or on a Ray rollout
fleet (``[ray]``: :mod:`.fleet`); docs/scaling.md says how.

Every config key with its default: ``flowseam train --method flowgrpo --show-config``; what each
means: docs/training.md ("Config keys").
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, Field

import numpy as np
import torch

from ..errors import FlowseamError
from ..loading import load
from ..loops import ExecutionProfile, run_loop
from ..models.instance import ModelInstance
from ..seam.platform import Platform
from ..request import DiffusionParams, GenerationRequest, TaskType
from .common import RunFiles, Stage, SteppedMethod, Timer, derive_seed, reward_summary, run_training
from .config import (
    ConfigSection,
    LoraSection,
    Name,
    NonNegativeFloat,
    NonNegativeInt,
    OptimSection,
    PositiveFloat,
    PositiveInt,
    StepWindow,
    UnitFloat,
    schema_defaults,
    tuple_to_list,
    validate_config,
)
from .distributed import DataParallel, DistributedSection, ParallelSection, data_parallel
from .fleet import RaySection, fleet_from_config
from .grpo import GroupRLConfig, GRPOConfig, Trajectory, UpdateStats, group_advantages, ppo_update
from ..rewards.spec import RewardScores, as_reward, build_reward, check_scores, reward_input


if TYPE_CHECKING:  # pragma: no cover
    from ..parallel import Parallel


class SamplingSection(ConfigSection):
    """``[sampling]``: the rollouts' :class:`~flowseam.DiffusionParams` (None: the card's
    default); also checked by ``DiffusionParams`` itself. ``chunk_frames``, ``local_attn_size``
    and ``sink_size`` are for a causal checkpoint (the ``wan_causal`` loop); ``frame_rate`` to
    ``refine_guidance_scale`` for LTX-2."""

    num_steps: PositiveInt = 4
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    num_frames: PositiveInt | None = None
    guidance_scale: NonNegativeFloat | None = None
    noise_level: NonNegativeFloat = 0.7
    sde_window: StepWindow | None = None
    flow_shift: PositiveFloat | None = None
    negative_prompt: str | None = None
    max_sequence_length: PositiveInt | None = None
    chunk_frames: PositiveInt | None = None
    local_attn_size: PositiveInt | None = None
    sink_size: NonNegativeInt | None = None
    frame_rate: PositiveFloat | None = None
    audio_guidance_scale: NonNegativeFloat | None = None
    stages: Annotated[int, Field(ge=1, le=2)] | None = None
    refine_sigmas: Annotated[list[UnitFloat], Field(min_length=1),
                             BeforeValidator(tuple_to_list)] | None = None
    refine_guidance_scale: NonNegativeFloat | None = None


class FlowGRPOConfig(GroupRLConfig):
    """The ``flowgrpo`` config: every key with its default is what ``--show-config`` prints;
    docs/training.md says what each means."""

    model: Name | None = None
    backend: Name | None = None
    sampling: SamplingSection = SamplingSection()
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimSection = OptimSection()
    lora: LoraSection = LoraSection()
    distributed: DistributedSection = DistributedSection()
    parallel: ParallelSection = ParallelSection()
    ray: RaySection = RaySection()


def require_prompts(cfg: dict[str, Any]) -> None:
    if not cfg["prompts"]:
        raise FlowseamError("config needs prompts = [\"...\", ...] (a non-empty list of strings)")


def sampling_params(sampling: dict[str, Any]) -> DiffusionParams:
    """The rollouts' params (SDE steps) from a validated ``[sampling]`` section.

    :raises InvalidParameterError: for what ``DiffusionParams`` refuses (naming the field).
    """
    return DiffusionParams(sde_rollout=True, **sampling)


def check_sampling(sampling: dict[str, Any], where: str = "sampling") -> dict[str, Any]:
    """Refuse sampling settings a policy-gradient update cannot learn from.

    :raises FlowseamError: for ``noise_level=0``: every SDE step is then deterministic
        (Flow-GRPO's evaluation setting), its log-prob is 0 and every PPO ratio exactly 1.
    """
    if sampling.get("noise_level") == 0:
        raise FlowseamError(f"[{where}] noise_level=0 makes every SDE step deterministic (Flow-"
                            "GRPO's evaluation setting): its log-prob is 0 and every PPO ratio 1, "
                            "so nothing would be learned; use noise_level > 0 (default 0.7)")
    return sampling


def check_sampling_against(model: ModelInstance, sampling: dict[str, Any], table: str) -> None:
    """Validate a ``[sampling]`` table with the model's own checks, before any step runs (so a
    bad size fails before the progress bar, not at the first rollout).

    :raises FlowseamError: naming the table and the bad value.
    """
    params = sampling_params(sampling)
    image = np.zeros((16, 16, 3), np.float32) if TaskType.I2V in model.card.tasks else None
    try:  # a split model ([parallel]) also checks that its split divides the rollouts' tokens
        model.validate(GenerationRequest("a prompt", model.card.task, params, image=image))
    except ValueError as exc:
        raise FlowseamError(f"config [{table}]: {exc}") from exc


class FlowGRPO(SteppedMethod):
    """Flow-GRPO on one model. ``FlowGRPO(config).run()``; see the module docstring.

    :param model: an already loaded instance (else ``config["model"]`` is loaded).
    :param reward: a reward callable (else ``config["reward"]`` is built:
        :func:`~flowseam.rewards.spec.build_reward`).
    :raises FlowseamError: for an invalid config (:class:`FlowGRPOConfig`: unknown keys, wrong
        types, values out of range, no prompts), an ``output_dir`` another run holds or that
        was started with another config, a reward spec that cannot be built
        (:class:`~flowseam.errors.InvalidInputError`); all before the model loads.
    """

    name = "flowgrpo"
    #: the layout every rollout is split over (``[parallel]``), None: one rank a rollout (a
    #: subclass that takes no ``[parallel]`` table, joint_multi_rl, keeps this)
    parallel: "Parallel | None" = None
    #: the config's tables (``flowseam train --method flowgrpo --show-config``)
    config_tables = ("sampling", "grpo", "optim", "lora", "distributed", "parallel", "ray")

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """Every config key with its default, tables as dicts (None: required or chosen at run
        time)."""
        return schema_defaults(FlowGRPOConfig)

    def __init__(self, config: dict[str, Any], model: ModelInstance | None = None, reward=None) -> None:
        # everything that can be checked is checked before a model loads
        self.config = cfg = validate_config(FlowGRPOConfig, config)
        require_prompts(cfg)
        self.sampling = check_sampling(cfg["sampling"])
        sampling_params(self.sampling)  # DiffusionParams' own checks
        self.grpo = GRPOConfig(**cfg["grpo"])
        optim, lora = cfg["optim"], cfg["lora"]
        self.dp = data_parallel(cfg)
        self.shard_sizes = (cfg["prompts_per_step"], cfg["group_size"])
        self.shard = self.dp.shard_groups(*self.shard_sizes)
        ray_options = cfg["ray"]
        if ray_options["rollout_workers"] and self.dp.world_size > 1:
            raise FlowseamError("[ray] rollout_workers with several ranks is not implemented: one "
                                "process drives a rollout fleet (drop --nproc, or the [ray] table)")
        self.parallel = split_rollouts(cfg["parallel"], self.dp.world_size)
        self.files = RunFiles(Path(cfg["output_dir"]) if cfg["output_dir"] else None,
                              cfg["checkpoint_every"], dp=self.dp, method=self.name,
                              config=cfg)
        # the reward is built (and its factories' checks run) before the model loads
        self.reward = as_reward(reward, cfg["reward_timeout"]) if reward is not None else \
            build_reward(cfg["reward"], cfg["reward_args"], cfg["reward_timeout"])
        if ray_options["reward_workers"] and self.reward.modality == "audio":
            raise FlowseamError("[ray] reward_workers score frames; an audio reward runs in the "
                                "trainer (set reward_workers = 0)")
        if model is None:
            if not cfg["model"]:
                raise FlowseamError("config needs model = <checkpoint directory>")
            platform = self.dp.platform(
                lambda: Platform(cfg["backend"]) if cfg["backend"] else Platform.detect())
            model = load(cfg["model"], platform=platform, parallel=self.parallel,
                         dtype=cfg["dtype"])
        elif self.parallel is not None and model.parallel is None:
            raise FlowseamError("[parallel] splits the rollouts of the model this run loads; the "
                                "model passed in was loaded without parallel= (flowseam.load)")
        if TaskType.I2V in model.card.tasks:
            raise FlowseamError(f"flowgrpo trains text-conditioned models; {model.card.name} needs an "
                                "image per prompt (use the workflow_rl method for image-to-video)")
        check_sampling_against(model, self.sampling, "sampling")
        self.model = model
        self.stage = Stage.create("dit", model, optim, lora, with_reference=self.grpo.beta > 0,
                                  gradient_checkpointing=cfg["gradient_checkpointing"],
                                  dp=self.dp)
        self.fleet = fleet_from_config(model, ray_options, lora, self.reward)
        if self.fleet is not None:  # the fleet receives every weights version from now on
            self.stage.sync.receivers.append(self.fleet)
            self.fleet.push(self.stage.sync.update())
        self.step = 0
        self.progress = True
        self.last_stats = None
        self.skipped_groups = 0

    schema = FlowGRPOConfig

    @classmethod
    def check_world_size(cls, config: dict[str, Any], world_size: int) -> None:
        """:raises FlowseamError: for an invalid config, or if a step's samples do not split
        evenly over ``world_size`` ranks (checked by ``flowseam train --nproc`` before the ranks
        start)."""
        cfg = validate_config(cls.schema, config)
        DataParallel(world_size=world_size).shard_groups(cfg["prompts_per_step"], cfg["group_size"])
        split_rollouts(cfg.get("parallel", {}), world_size)

    # -- one step ---------------------------------------------------------------------------
    def rollout(self, step: int) -> tuple[list[Trajectory], list, list[str], list | None]:
        """This process's SDE rollouts of step ``step``: for each group (prompt) of the step it
        holds, one batch of its members — split into one batch per worker on a rollout fleet.

        :returns: ``(trajectories, results, prompts, rewards)``, one entry per batch, in group
            then member order; ``rewards`` are the fleet's reward workers' scores
            (:class:`~flowseam.rewards.spec.RewardScores`, else None).
        """
        cfg = self.config
        params = sampling_params(self.sampling)
        requests, prompts, owners = [], [], []
        # with [parallel] every rank runs every rank's share (split), then keeps its own
        shards = ([DataParallel(r, self.dp.world_size).shard_groups(*self.shard_sizes)
                   for r in range(self.dp.world_size)] if self.parallel else [self.shard])
        for owner, shard in enumerate(shards):
            for i, members in shard.parts():
                prompt = cfg["prompts"][(step * cfg["prompts_per_step"] + i) % len(cfg["prompts"])]
                for part in _split(members, self.fleet.size if self.fleet else 1):
                    seeds = [derive_seed(cfg["seed"], step, i, k) for k in part]
                    requests.append(GenerationRequest([prompt] * len(part), self.model.card.task,
                                                      params, seeds=seeds))
                    prompts.append(prompt)
                    owners.append(owner if self.parallel else self.dp.rank)
        if self.fleet is None:
            results = [run_loop(self.model, r, profile=ExecutionProfile.ROLLOUT) for r in requests]
            mine = [o == self.dp.rank for o in owners]
            results = [r for r, keep in zip(results, mine) if keep]
            prompts = [p for p, keep in zip(prompts, mine) if keep]
            rewards = None
        else:
            results, rewards = self.fleet.rollout(
                requests, [[p] * len(r.seeds) for p, r in zip(prompts, requests)])
        trajectories = [Trajectory(self.model, r, torch.zeros(len(r.seeds))) for r in results]
        return trajectories, results, prompts, rewards

    def train_step(self) -> dict[str, Any]:
        """One Flow-GRPO step; returns its metrics (also written to metrics.jsonl)."""
        timer = Timer()
        with timer("rollout"):
            trajectories, results, prompts, scored = self.rollout(self.step)
        with timer("reward"):
            if scored is None:
                scored = [self.score(p, r) for p, r in zip(prompts, results)]
            shape = (len(self.shard.groups), len(self.shard.members))
            # (G, K) on every rank: whole groups (each component too, for a weighted sum)
            scores = RewardScores.cat(scored).map(lambda t: self.shard.gather(t.view(shape)))
            check_scores(self.reward, scores, f"step {self.step + 1}")
            rewards = scores.total
        adv, valid, adv_stats = group_advantages(rewards, self.grpo)
        if adv_stats["groups_skipped_nan"]:
            self.skipped_groups += adv_stats["groups_skipped_nan"]
            warnings.warn(f"step {self.step}: reward returned NaN for {adv_stats['groups_skipped_nan']} "
                          "group(s); skipped them (no update from those samples)", stacklevel=2)
        trained = (adv != 0).any(dim=1)  # groups with a finite reward and a non-zero std
        rows, start = self.shard.local(adv).flatten(), 0
        for traj in trajectories:  # batches in group then member order
            n = len(traj.advantages)
            traj.advantages = rows[start:start + n]
            traj.trained = bool(trained[self.shard.groups[start // len(self.shard.members)]])
            start += n
        with timer("update"):
            stats = ppo_update(self.stage.trainer, self.stage.reference, trajectories,
                               self.stage.optimizer, self.grpo, seed=derive_seed(self.config["seed"], self.step, 99),
                               after_step=None, dp=self.dp)
        with timer("sync"):
            if stats.grad_norms:
                self.stage.sync.sync()
        per_rank = self.dp.gather_objects(stats)
        self.last_stats = stats = UpdateStats.merged(per_rank)
        self.step += 1
        record = {"step": self.step, **reward_summary(rewards, scores.parts), **adv_stats, "groups_skipped_nan_total": self.skipped_groups, **stats.summary(),
                  "updated": bool(stats.grad_norms), "weights_version": self.stage.sync.version,
                  **UpdateStats.by_rank(per_rank),
                  **{f"seconds_{k}": v for k, v in timer.seconds.items()}}
        self.files.write(record)
        self.files.maybe_checkpoint(self.step, [self.stage], {"skipped_groups": self.skipped_groups})
        return record

    def score(self, prompt: str, result) -> RewardScores:
        """The reward of every sample of ``result`` (all rendered from ``prompt``), checked
        (:meth:`flowseam.rewards.spec.Reward.score`)."""
        reward = as_reward(self.reward, self.config["reward_timeout"])
        return reward.score([prompt] * len(result.seeds), reward_input(reward, result))

    # -- the run ----------------------------------------------------------------------------
    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train for ``steps`` steps (resuming from ``output_dir``'s latest checkpoint); with an
        ``output_dir`` the run ends with its final checkpoint and the trained model (``model/``,
        diffusers format; ``pytorch_lora_weights.safetensors`` for a LoRA run).

        :returns: ``{"steps", "records", "weights_version", "exported": {stage: {"model", "lora"}}}``
        """
        self.progress = progress
        records = run_training(self, [self.stage], "flowgrpo", "reward_mean")
        return {"steps": self.step, "records": records, "weights_version": self.stage.sync.version,
                "exported": self.files.exported_paths()}

    def close(self) -> None:
        """Shut the rollout fleet down (if any)."""
        if self.fleet is not None:
            self.stage.sync.receivers.remove(self.fleet)
            self.fleet.shutdown()
            self.fleet = None

    def evaluate(self, seeds: list[int], prompts: list[str] | None = None) -> torch.Tensor:
        """Mean reward per seed of ODE (serve) samples from the rollout instance: ``(len(seeds),)``."""
        params = sampling_params(self.sampling).replace(sde_rollout=False)
        out = []
        for prompt in prompts or self.config["prompts"]:
            request = GenerationRequest([prompt] * len(seeds), self.model.card.task, params, seeds=list(seeds))
            result = run_loop(self.model, request)
            out.append(self.score(prompt, result).total)
        return torch.stack(out).mean(dim=0)


def split_rollouts(table: dict[str, Any], world_size: int) -> "Parallel | None":
    """The :class:`flowseam.Parallel` layout of a ``[parallel]`` table (None: one rank a
    rollout), which must take all ``world_size`` ranks of the run.

    :raises FlowseamError: naming the numbers.
    """
    from ..parallel import Parallel

    section = ParallelSection(**(table or {}))
    parallel = Parallel(sp=section.sp, cfg=section.cfg)
    if not parallel.enabled:
        return None
    if parallel.world_size != world_size:
        raise FlowseamError(
            f"[parallel] sp={parallel.sp}{' with cfg' if parallel.cfg else ''} splits each "
            f"rollout over {parallel.world_size} ranks, and takes every rank of the run; the run "
            f"has {world_size} (flowseam train --nproc {parallel.world_size})")
    return parallel


def _split(members: list[int], parts: int) -> list[list[int]]:
    """``members`` in at most ``parts`` contiguous, near-equal, non-empty pieces."""
    size, extra = divmod(len(members), parts)
    out, start = [], 0
    for p in range(parts):
        n = size + (p < extra)
        if n:
            out.append(members[start:start + n])
        start += n
    return out
