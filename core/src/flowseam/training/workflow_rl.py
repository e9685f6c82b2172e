"""The ``workflow_rl`` training method: one reward on the final output of a cross-model workflow
trains every stage.

Each step, per prompt: roll out the text-to-image stage (SDE, a group of ``group_size`` samples,
each with its own seed), decode the images, roll out the image-to-video stage on each image (SDE,
one first frame per sample), score the final videos with one reward, and use that one
group-relative advantage for a Flow-GRPO update of *both* stages' transformers: the T2I model
gets credit for images that lead to better videos. Each stage has its own trainer copy,
optimizer and WeightSyncPlan, on two model instances (each with its own platform resolution).
Data-parallel as ``flowgrpo`` (:mod:`.distributed`). Registered through its own entry point, as a
third party's would be.

Config keys: ``flowseam train --method workflow_rl --show-config``; what each means:
docs/training.md ("Config keys").
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import FlowseamError
from ..loading import load
from ..loops import ExecutionProfile, run_loop
from ..models.instance import ModelInstance
from ..seam.platform import Platform
from ..request import GenerationRequest, TaskType
from .common import (
    RunFiles, Stage, SteppedMethod, Timer, derive_seed, reward_summary, run_training, sync_updated,
)
from .config import (
    LoraSection,
    Name,
    OptimOverrides,
    OptimSection,
    PositiveInt,
    merge_overrides,
    schema_defaults,
    validate_config,
)
from .distributed import DataParallel, DistributedSection, data_parallel
from .flowgrpo import (
    FlowGRPO,
    SamplingSection,
    check_sampling,
    check_sampling_against,
    require_prompts,
    sampling_params,
)
from .grpo import GroupRLConfig, GRPOConfig, Trajectory, UpdateStats, group_advantages, ppo_update
from ..rewards.spec import RewardScores, as_reward, build_reward, check_scores


class WorkflowRLConfig(GroupRLConfig):
    """The ``workflow_rl`` config: every key with its default is what ``--show-config`` prints;
    docs/training.md says what each means."""

    t2i_model: Name | None = None
    i2v_model: Name | None = None
    t2i_backend: Name | None = None
    i2v_backend: Name | None = None
    t2i_sampling: SamplingSection = SamplingSection()
    i2v_sampling: SamplingSection = SamplingSection()
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimSection = OptimSection()
    t2i_optim: OptimOverrides = OptimOverrides()
    i2v_optim: OptimOverrides = OptimOverrides()
    lora: LoraSection = LoraSection()
    distributed: DistributedSection = DistributedSection()
    #: samples per rollout batch (both stages), taken across groups in order (Flow-GRPO's
    #: ``sample.train_batch_size``); None: one group. The update recomputes each batch as one.
    rollout_batch_size: PositiveInt | None = None


def _load(path: str | None, backend: str | None, what: str, dp: DataParallel,
          dtype: Any = None) -> ModelInstance:
    if not path:
        raise FlowseamError(f"config needs {what}_model = <checkpoint directory>")
    return load(path, platform=dp.platform(lambda: Platform(backend) if backend else Platform.detect()),
                dtype=dtype)


class WorkflowRL(SteppedMethod):
    """Flow-GRPO across the t2i → i2v workflow. ``WorkflowRL(config).run()``."""

    name = "workflow_rl"
    #: the config's tables (``flowseam train --method workflow_rl --show-config``)
    config_tables = ("t2i_sampling", "i2v_sampling", "grpo", "optim", "t2i_optim", "i2v_optim",
                     "lora", "distributed")

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """Every config key with its default, tables as dicts (``[t2i_optim]`` and
        ``[i2v_optim]`` take any ``[optim]`` key, for that stage only)."""
        return schema_defaults(WorkflowRLConfig)

    def __init__(self, config: dict[str, Any], t2i: ModelInstance | None = None,
                 i2v: ModelInstance | None = None, reward=None) -> None:
        # everything that can be checked is checked before a model loads
        self.config = cfg = validate_config(WorkflowRLConfig, config)
        require_prompts(cfg)
        self.t2i_sampling = check_sampling(cfg["t2i_sampling"], "t2i_sampling")
        self.i2v_sampling = check_sampling(cfg["i2v_sampling"], "i2v_sampling")
        for sampling in (self.t2i_sampling, self.i2v_sampling):
            sampling_params(sampling)  # DiffusionParams' own checks
        self.grpo = GRPOConfig(**cfg["grpo"])
        self.dp = data_parallel(cfg)
        self.shard = self.dp.shard_groups(cfg["prompts_per_step"], cfg["group_size"])
        self.files = RunFiles(Path(cfg["output_dir"]) if cfg["output_dir"] else None,
                              cfg["checkpoint_every"], dp=self.dp, method=self.name,
                              config=cfg)
        # the reward is built (and its factories' checks run) before any model loads
        self.reward = as_reward(reward, cfg["reward_timeout"]) if reward is not None else \
            build_reward(cfg["reward"], cfg["reward_args"], cfg["reward_timeout"])
        self.t2i = t2i or _load(cfg["t2i_model"], cfg["t2i_backend"], "t2i", self.dp, cfg["dtype"])
        self.i2v = i2v or _load(cfg["i2v_model"], cfg["i2v_backend"], "i2v", self.dp, cfg["dtype"])
        if TaskType.T2I not in self.t2i.card.tasks or TaskType.I2V not in self.i2v.card.tasks:
            raise FlowseamError(f"workflow_rl needs a text-to-image then an image-to-video model; got "
                                f"{self.t2i.card.name} and {self.i2v.card.name}")
        check_sampling_against(self.t2i, self.t2i_sampling, "t2i_sampling")
        check_sampling_against(self.i2v, self.i2v_sampling, "i2v_sampling")
        self.stages = [Stage.create(name, model, merge_overrides(cfg["optim"], cfg[f"{name}_optim"]),
                                    cfg["lora"], with_reference=self.grpo.beta > 0, dp=self.dp,
                                    gradient_checkpointing=cfg["gradient_checkpointing"])
                       for name, model in (("t2i", self.t2i), ("i2v", self.i2v))]
        self.step = 0
        self.progress = True
        self.skipped_groups = 0
        self.last_stats: dict[str, Any] = {}

    schema = WorkflowRLConfig
    check_world_size = classmethod(FlowGRPO.check_world_size.__func__)

    def batches(self, n_rows: int, group: int) -> list[slice]:
        """``n_rows`` samples (groups of ``group`` in order) → the row slices rolled out as one
        batch each: ``rollout_batch_size`` rows (default ``group``), the last one shorter."""
        size = self.config["rollout_batch_size"] or group
        return [slice(start, min(start + size, n_rows)) for start in range(0, n_rows, size)]

    def train_step(self) -> dict[str, Any]:
        timer = Timer()
        cfg = self.config
        parts = self.shard.parts()  # this rank's members of each group it holds
        prompts, seeds = [], []
        for i, members in parts:
            prompt = cfg["prompts"][(self.step * cfg["prompts_per_step"] + i) % len(cfg["prompts"])]
            prompts += [prompt] * len(members)
            seeds += [derive_seed(cfg["seed"], self.step, i, k) for k in members]
        K = len(parts[0][1])
        batches = self.batches(len(prompts), K)
        with timer("rollout"):
            rollouts = [workflow_rollout(self.t2i, self.i2v, prompts[b], seeds[b], self.t2i_sampling,
                                         self.i2v_sampling) for b in batches]
        with timer("reward"):
            reward = as_reward(self.reward, cfg["reward_timeout"])
            scored = RewardScores.cat([reward.score(prompts[b], videos)
                                       for b, (_, _, videos) in zip(batches, rollouts)])
            # (G, K) on every rank: whole groups (each component too, for a weighted sum)
            scores = scored.map(lambda t: self.shard.gather(t.view(len(parts), K)))
            check_scores(reward, scores, f"step {self.step + 1}")
            rewards = scores.total
        adv, valid, adv_stats = group_advantages(rewards, self.grpo)
        if adv_stats["groups_skipped_nan"]:
            self.skipped_groups += adv_stats["groups_skipped_nan"]
            warnings.warn(f"step {self.step}: reward returned NaN for {adv_stats['groups_skipped_nan']} "
                          "group(s); skipped them", stacklevel=2)
        trained = (adv != 0).any(dim=1)  # groups with a finite reward and a non-zero std
        # every row gets its group's advantage row and flag (a batch may hold several groups)
        row_adv = self.shard.local(adv).reshape(-1)
        row_trained = trained[self.shard.groups.start:self.shard.groups.stop].repeat_interleave(K)
        t2i_traj = [Trajectory(self.t2i, images, row_adv[b], row_trained[b])
                    for b, (images, _, _) in zip(batches, rollouts)]
        i2v_traj = [Trajectory(self.i2v, videos, row_adv[b], row_trained[b])
                    for b, (_, videos, _) in zip(batches, rollouts)]
        stats, per_rank = {}, {}
        with timer("update"):
            for stage, trajs in zip(self.stages, (t2i_traj, i2v_traj)):
                mine = ppo_update(stage.trainer, stage.reference, trajs, stage.optimizer, self.grpo,
                                  seed=derive_seed(cfg["seed"], self.step, 99), dp=self.dp)
                per_rank[stage.name] = self.dp.gather_objects(mine)
                stats[stage.name] = UpdateStats.merged(per_rank[stage.name])
        with timer("sync"):
            sync_updated(self.stages, stats)
        self.last_stats = stats
        self.step += 1
        record = {"step": self.step, **reward_summary(rewards, scores.parts),
                  **adv_stats, "groups_skipped_nan_total": self.skipped_groups,
                  **{k: v for s in self.stages for k, v in stats[s.name].summary(f"{s.name}_").items()},
                  **{k: v for s in self.stages
                     for k, v in UpdateStats.by_rank(per_rank[s.name], f"{s.name}_").items()},
                  **{f"{s.name}_weights_version": s.sync.version for s in self.stages},
                  **{f"seconds_{k}": v for k, v in timer.seconds.items()}}
        self.files.write(record)
        self.files.maybe_checkpoint(self.step, self.stages, {"skipped_groups": self.skipped_groups})
        return record

    def run(self, progress: bool = True) -> dict[str, Any]:
        """Train for ``steps`` steps (resuming from ``output_dir``'s latest checkpoint); with an
        ``output_dir`` the run ends with its final checkpoint and each stage's trained model
        (``t2i/model/``, ``i2v/model/``; LoRA files beside them for a LoRA run).

        :returns: ``{"steps", "records", "weights_versions", "exported": {stage: {"model", "lora"}}}``
        """
        self.progress = progress
        records = run_training(self, self.stages, "workflow_rl", "reward_mean")
        return {"steps": self.step, "records": records,
                "weights_versions": {s.name: s.sync.version for s in self.stages},
                "exported": self.files.exported_paths()}

    def evaluate(self, seeds: list[int], prompts: list[str] | None = None) -> torch.Tensor:
        """Mean final-video reward per seed over the prompts, with ODE (serve) sampling:
        ``(len(seeds),)``. Each prompt with every seed, in batches as the rollouts."""
        prompts = list(prompts or self.config["prompts"])
        rows = [(p, s) for p in prompts for s in seeds]
        out = []
        for b in self.batches(len(rows), len(seeds)):
            batch_prompts = [p for p, _ in rows[b]]
            _, _, videos = workflow_rollout(self.t2i, self.i2v, batch_prompts,
                                            [s for _, s in rows[b]], self.t2i_sampling,
                                            self.i2v_sampling, sde=False)
            out.append(as_reward(self.reward, self.config["reward_timeout"])
                       .score(batch_prompts, videos).total)
        return torch.cat(out).view(len(prompts), len(seeds)).mean(dim=0)


def workflow_rollout(t2i: ModelInstance, i2v: ModelInstance, prompts: list[str], seeds: list[int],
                     t2i_sampling: dict[str, Any], i2v_sampling: dict[str, Any], sde: bool = True):
    """The t2i → i2v workflow for ``B`` samples, each stage as one batch: stage 1 row ``k``
    prompt ``prompts[k]``, seed ``seeds[k]``; stage 2 row ``k`` the same prompt, image ``k`` of
    stage 1 as its first frame, seed ``derive_seed(seeds[k], 2)`` (each row equals its own B=1
    run to float rounding: :class:`~flowseam.models.wan.WanI2V` takes one image per prompt).
    With ``sde`` both stages are SDE rollouts with records, else served (ODE).

    :returns: ``(t2i LoopResult (B), i2v LoopResult (B), videos (B, F, H, W, 3))``.
    """
    profile = ExecutionProfile.ROLLOUT if sde else ExecutionProfile.SERVE
    p1 = sampling_params(t2i_sampling).replace(sde_rollout=sde)
    p2 = sampling_params(i2v_sampling).replace(sde_rollout=sde)
    images = run_loop(t2i, GenerationRequest(list(prompts), TaskType.T2I, p1, seeds=seeds), profile=profile)
    videos = run_loop(i2v, GenerationRequest(list(prompts), TaskType.I2V, p2,
                                             image=[images.frames[k, 0] for k in range(len(prompts))],
                                             seeds=[derive_seed(s, 2) for s in seeds]), profile=profile)
    return images, videos, videos.frames

